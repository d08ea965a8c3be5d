"""The command lines' faults: one line naming what to change, status 1, no traceback; the
traceback at --verbosity=1; a bug keeps its traceback."""

import contextlib
import os
import pathlib
import subprocess
import sys

import pytest
from absl import flags, logging
from absl.testing import flagsaver

from areal_jax import cli
from areal_jax import config as config_lib
from areal_jax import generate, models
from areal_jax.tasks import data
from areal_jax.vllm_rollout import VllmNotInstalledError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"


@contextlib.contextmanager
def verbosity(level):
  before = logging.get_verbosity()
  logging.set_verbosity(level)
  try:
    yield
  finally:
    logging.set_verbosity(before)


@pytest.mark.parametrize("fault", [
    config_lib.ConfigError("rollout.n_samples=0 must be >= 1"),
    models.CheckpointError("/runs/x/checkpoints/3: no 'state' item"),
    data.MalformedRowError("/data/train.jsonl", 7, "invalid JSON"),
    data.DataNotFoundError("data path not found: /data/missing.jsonl"),
    MemoryError("sampler memory plan: does not fit"),
    VllmNotInstalledError("vLLM is not installed in this environment"),
])
def test_a_fault_of_what_was_given_ends_in_one_line(fault, capsys):
  with verbosity(0), pytest.raises(SystemExit) as info:
    with cli.reported_faults():
      raise fault
  assert info.value.code == 1
  assert capsys.readouterr().err == f"error: {fault}\n"


def test_verbosity_keeps_the_traceback_and_a_bug_is_not_reported_as_a_fault(capsys):
  with verbosity(1), pytest.raises(config_lib.ConfigError, match="n_samples"):
    with cli.reported_faults():
      raise config_lib.ConfigError("rollout.n_samples=0 must be >= 1")
  with verbosity(0):
    for bug in (KeyError("params"), RuntimeError("boom"), ValueError("a plain ValueError"),
                MemoryError()):  # (the host out of memory, not a plan: its traceback says where)
      with pytest.raises(type(bug)):
        with cli.reported_faults():
          raise bug
  assert capsys.readouterr().err == ""


def test_generate_says_a_model_that_is_not_there_in_one_line(tmp_path, capsys):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(model=str(tmp_path / "missing")), verbosity(0):
    with pytest.raises(SystemExit) as info:
      generate.main([])
  assert info.value.code == 1
  assert capsys.readouterr().err.startswith(f"error: model source '{tmp_path / 'missing'}'")


def run(args, cwd):
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  return proc


@pytest.mark.slow
def test_launch_names_task_data_or_a_workdir_it_cannot_use(tmp_path):
  """A train path that is not there, then a file with a broken line: the path (and line) in one
  message, before anything is trained; a --workdir that is a file."""
  missing = tmp_path / "missing.jsonl"
  proc = run([str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path / 'a'}",
              f"--config.task.train_path={missing}"], tmp_path)
  assert f"error: data path not found: {missing}" in proc.stderr
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "q"\n')
  proc = run([str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path / 'b'}",
              f"--config.task.train_path={bad}"], tmp_path)
  assert f"error: {bad}:2: invalid JSON" in proc.stderr
  assert not (tmp_path / "b" / "metrics.jsonl").exists()
  proc = run([str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={bad}"], tmp_path)
  assert f"error: --workdir={bad} is a file, not a directory" in proc.stderr


@pytest.mark.slow
def test_evaluate_and_export_name_a_checkpoint_or_setting_they_cannot_use(tmp_path):
  proc = run(["-m", "areal_jax.evaluate", f"--config={TINY}",
              f"--checkpoint={tmp_path / 'nope'}"], tmp_path)
  assert f"error: --checkpoint={tmp_path / 'nope'}: no such file or directory" in proc.stderr
  proc = run(["-m", "areal_jax.export", f"--config={TINY}", f"--checkpoint={tmp_path}",
              f"--output={tmp_path / 'peft'}"], tmp_path)
  assert f"error: --checkpoint={tmp_path} is neither a run workdir" in proc.stderr  # full-weight
  proc = run(["-m", "areal_jax.export", f"--config={TINY}", "--config.actor.lora.rank=4",
              f"--checkpoint={tmp_path}", f"--output={tmp_path / 'peft'}"], tmp_path)
  assert f"error: --checkpoint={tmp_path} is neither a run workdir" in proc.stderr
  assert not (tmp_path / "peft").exists()
