"""The run directory's faults: named, with what to do, as RunDirError (one line at the CLI). An
error of another process (a learner process, the serve trainer process) raised here as the fault
it is: a fault a person fixes keeps its type and a one-line message (its traceback only as a
note), other errors take their nearest builtin type, and the older one-name form still works."""

import os

import pytest

from areal_jax import cli
from areal_jax.config import ConfigError
from areal_jax.learner import memory
from areal_jax.models import CheckpointError
from areal_jax.runtime import errors
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


def _raised_elsewhere(error, where="learner process 1"):
  """``error`` raised in another process, sent as error_fields, raised again here."""
  try:
    raise error
  except Exception as e:  # pylint: disable=broad-except
    fields = errors.error_fields(e)
  return errors.remote_error(where, *fields)


@pytest.mark.parametrize("error", [ConfigError("actor.lr=-1 must be >= 0"),
                                   CheckpointError("model.source: /x is not there"),
                                   RunDirError("checkpoint 3 does not fit this run")])
def test_faults_of_another_process_keep_their_type_and_one_line(error):
  raised = _raised_elsewhere(error)
  assert type(raised) is type(error)
  assert str(raised) == f"learner process 1: {error}"
  (note,) = raised.__notes__
  assert note.startswith("learner process 1's traceback:\nTraceback")
  assert f"{type(error).__name__}: {error}" in note


def test_other_errors_of_another_process_take_the_nearest_known_base():
  plan = _raised_elsewhere(memory.DoesNotFit("actor.micro_batch_tokens=64 does not fit", None))
  assert type(plan) is MemoryError and isinstance(plan, cli.fault_kinds())
  assert str(plan) == "learner process 1: DoesNotFit: actor.micro_batch_tokens=64 does not fit"
  missing = _raised_elsewhere(KeyError("params"), where="trainer process")
  assert type(missing) is LookupError and str(missing) == "trainer process: KeyError: 'params'"

  class Unknown(Exception):
    pass

  bug = _raised_elsewhere(Unknown("boom"))
  assert type(bug) is RuntimeError and not isinstance(bug, cli.fault_kinds())
  assert str(bug) == "learner process 1: Unknown: boom"
  old = errors.remote_error("learner process 0", "FloatingPointError", "non-finite loss")
  assert type(old) is FloatingPointError and str(old) == "learner process 0: non-finite loss"
  assert not getattr(old, "__notes__", None)


def test_a_fault_of_another_process_ends_a_command_line_in_one_line(capsys):
  with pytest.raises(SystemExit) as exit_:
    with cli.reported_faults():
      raise _raised_elsewhere(ConfigError("actor.lr=-1 must be >= 0"))
  assert exit_.value.code == 1
  assert capsys.readouterr().err == "error: learner process 1: actor.lr=-1 must be >= 0\n"


def test_a_bare_memory_error_of_another_process_is_a_bug_with_its_traceback(capsys):
  """A MemoryError without a message is the host running out of memory, not a plan of ours: here
  too it is not a fault, so the command line lets it through with the other process's traceback."""
  raised = _raised_elsewhere(MemoryError())
  assert type(raised) is RuntimeError and not errors.is_fault(raised)
  assert str(raised) == "learner process 1: MemoryError: (no message)"
  (note,) = raised.__notes__
  assert note.startswith("learner process 1's traceback:\nTraceback") and "MemoryError" in note
  with pytest.raises(RuntimeError) as passed:
    with cli.reported_faults():
      raise raised
  assert passed.value is raised and capsys.readouterr().err == ""
