"""The run directory's faults: named, with what to do, as RunDirError (one line at the CLI)."""

import os

import pytest

from areal_jax.runtime.errors import RunDirError, make_run_dir


def test_make_run_dir_creates_parents_and_accepts_an_existing_one(tmp_path):
  workdir = tmp_path / "runs" / "a"
  make_run_dir(str(workdir))
  assert workdir.is_dir()
  (workdir / "metrics.jsonl").write_text("{}\n")
  make_run_dir(str(workdir))  # a run directory already there (a resume): kept as it is
  assert (workdir / "metrics.jsonl").read_text() == "{}\n"


def test_make_run_dir_names_a_file_in_the_way(tmp_path):
  file = tmp_path / "notes.txt"
  file.write_text("x")
  with pytest.raises(RunDirError, match=f"--workdir={file} is a file, not a directory"):
    make_run_dir(str(file))
  with pytest.raises(RunDirError, match=f"--workdir={file}/run: cannot create the run directory"):
    make_run_dir(str(file / "run"))  # a parent that is a file
  assert file.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_make_run_dir_names_a_directory_it_cannot_write(tmp_path):
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o555)
  try:
    with pytest.raises(RunDirError, match="not writable"):
      make_run_dir(str(locked))
    with pytest.raises(RunDirError, match="cannot create the run directory"):
      make_run_dir(str(locked / "run"))
  finally:
    locked.chmod(0o755)
