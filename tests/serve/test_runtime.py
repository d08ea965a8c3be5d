"""The serve runtime's set-up: its JAX sampler is planned against its devices' memory like the
training run's (the plan printed; a sampler that cannot fit stops start-up with a MemoryError that
names the keys to change)."""

import pytest

from areal_jax import config as config_lib
from areal_jax.serve import runtime
from areal_jax.serve.runtime import ServeRuntime


def _config(**overrides):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.port = 0
  config.serve.train = False  # the sampler only
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  config.lock()
  return config


@pytest.mark.slow
def test_the_sampler_is_planned_against_its_devices(tmp_path, capsys):
  rt = ServeRuntime(_config(**{"mesh.device_memory_gib": 64.0}), str(tmp_path / "a"))
  try:
    assert "sampler memory plan:" in capsys.readouterr().out
    assert rt.engine.engine.config.num_slots == rt.config.rollout.num_slots  # they fit
  finally:
    rt.stop()
  with pytest.raises(MemoryError, match="sampler memory plan: does not fit.*rollout.num_slots"):
    ServeRuntime(_config(**{"mesh.device_memory_gib": 1e-4}), str(tmp_path / "b"))


@pytest.mark.slow
def test_the_cli_prints_a_plan_that_cannot_fit_without_a_traceback(tmp_path):
  import subprocess
  import sys
  out = subprocess.run(
      [sys.executable, "-m", "areal_jax.serve", "--config=configs/serve_arithmetic.py:tiny",
       f"--workdir={tmp_path}", "--config.serve.port=0", "--config.serve.train=False",
       "--config.mesh.device_memory_gib=0.0001"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "error: sampler memory plan: does not fit" in out.stderr
  assert "Traceback" not in out.stderr


@pytest.mark.parametrize("verbosity", [None, 1])
@pytest.mark.slow
def test_the_cli_says_a_model_that_is_not_there_with_a_traceback_only_if_asked(tmp_path,
                                                                                 verbosity):
  import subprocess
  import sys
  out = subprocess.run(
      [sys.executable, "-m", "areal_jax.serve", "--config=configs/serve_arithmetic.py:tiny",
       f"--workdir={tmp_path}", "--config.serve.port=0", "--config.serve.train=False",
       f"--config.model.source={tmp_path / 'missing'}"]
      + ([f"--verbosity={verbosity}"] if verbosity is not None else []),
      capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  message = f"model.source: model source '{tmp_path / 'missing'}': no such"
  if verbosity is None:
    assert f"error: {message}" in out.stderr
    assert "Traceback" not in out.stderr
  else:  # as launch.py and evaluate do at --verbosity=1: the exception with its traceback
    assert "Traceback" in out.stderr and message in out.stderr


def test_a_port_another_server_holds_stops_start_up_before_the_model_loads(tmp_path, monkeypatch):
  import socket
  with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    with pytest.raises(config_lib.ConfigError,
                       match=f"serve.host='127.0.0.1', serve.port={port}: cannot listen there"):
      runtime.check_listen("127.0.0.1", port)
    loads = []
    monkeypatch.setattr(runtime.model_source, "load", lambda *a: loads.append(a))
    with pytest.raises(config_lib.ConfigError, match="choose another serve.port"):
      ServeRuntime(_config(), str(tmp_path), port=port)
    assert not loads
  runtime.check_listen("127.0.0.1", port)  # free again
  runtime.check_listen("127.0.0.1", 0)  # any free port


def test_warmup_progress_prints_at_most_every_interval_and_not_the_end(capsys):
  clock = [100.0]
  progress = runtime._WarmupProgress(t0=100.0, every=10.0, clock=lambda: clock[0])
  for done, t in enumerate([3.0, 12.0, 15.0, 130.0, 131.0], start=1):
    clock[0] = 100.0 + t
    progress(done, 6, f"generate kv 512 width {done}")
  clock[0] = 240.0
  progress(6, 6, "move 1")  # the end: the runtime's own line says it
  lines = capsys.readouterr().out.splitlines()
  assert lines == ["engine warm-up: 2/6 programs compiled in 12 s (last: generate kv 512 width 2)",
                   "engine warm-up: 4/6 programs compiled in 130 s (last: generate kv 512 width 4)"]



@pytest.mark.slow
def test_a_current_teacher_at_the_judge_follows_what_the_trainer_publishes(tmp_path):
  """``serve.teacher_weights = "current"`` at the judge: the in-process trainer publishes through
  the teacher's ``FollowingEngine`` (the version it restored, at start-up, is the first), so the
  teacher scores with the weights serving was handed."""
  import jax
  import numpy as np

  from areal_jax.serve import teacher as teacher_lib
  rt = ServeRuntime(_config(**{"serve.train": True, "serve.trainer_process": False,
                               "serve.signal": "opd", "serve.teacher_at": "judge",
                               "serve.teacher_weights": "current"}), str(tmp_path))
  try:
    teacher = rt.judge.teaching.teacher
    assert isinstance(rt.trainer.engine, teacher_lib.FollowingEngine)
    assert rt.trainer.engine.teacher is teacher and rt.trainer.teaching is None
    learner = rt.trainer.learner.params()
    for got, want in zip(jax.tree.leaves(teacher.params), jax.tree.leaves(learner)):
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 rtol=1e-2)  # (a version may be sent in the compute dtype)
    moved = jax.tree.map(lambda x: x * 1.5, learner)
    rt.trainer.engine.update_params(moved, 1)  # what the next publish does
    assert teacher.params is moved and rt.engine.version in (0, 1)
  finally:
    rt.stop()
