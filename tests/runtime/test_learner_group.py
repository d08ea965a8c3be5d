"""The learner as a group of 2 processes in a real run: it trains, publishes Orbax versions the
driver's sampler loads, checkpoints; a SIGKILLed learner process makes the run restart from its
last checkpoint by itself and finish with continuous versions; with LoRA only the adapters are
published and the driver samples the merged policy. And the keys a group needs, and a worker's
fault raised by the driver under its own type."""

import glob
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from areal_jax import config as config_lib
from areal_jax.runtime import learner_group
from areal_jax.runtime import metrics as metrics_lib

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import lora_run  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"
GROUP = {"runtime.learner_processes": 2, "mesh.learner_devices": 2, "weights.transfer": "orbax"}


def test_group_config_is_checked():
  """The keys a group needs are config faults (one line from launch.py), found by validate."""
  c = config_lib.load(TINY)
  assert learner_group.check_config(c) == 1
  for k, v in GROUP.items():
    config_lib.override(c, k, v)
  assert learner_group.check_config(c) == 2
  for key, value, match in [("weights.transfer", "device_put", "weights.transfer='orbax'"),
                            ("mesh.colocated", True, "mesh.colocated=False"),
                            ("mesh.learner_devices", 3, "not divisible"),
                            ("runtime.learner_address", "host-without-port", "not host:port")]:
    bad = config_lib.load(TINY)
    for k, v in dict(GROUP, **{key: value}).items():
      config_lib.override(bad, k, v)
    with pytest.raises(config_lib.ConfigError, match=match):
      learner_group.check_config(bad)
    with pytest.raises(config_lib.ConfigError, match=match):  # a run stops before it loads a model
      config_lib.validate(bad)


# A stand-in learner process speaking the driver's protocol (no JAX): replies to train_step with
# its process id as the loss, fails or dies when the batch says so.
FAKE_WORKER = """
import os, sys
from multiprocessing.connection import Client
from areal_jax.runtime import learner_worker
pid, address = int(sys.argv[1]), sys.argv[2]
host, port = address.rsplit(":", 1)
import time
for _ in range(100):
  try:
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[learner_worker.AUTHKEY_ENV]))
    break
  except ConnectionRefusedError:
    time.sleep(0.1)
conn.send(("hello", pid, os.getpid()))
while True:
  try:
    cmd, args = conn.recv()
  except EOFError:
    sys.exit(0)
  if cmd == "init":
    conn.send(("ok", dict(version=5, num_params=7, devices=4)))
  elif cmd == "train_step" and args[0] == "die" and pid == 1:
    os._exit(3)
  elif cmd == "train_step" and args[0] == "fail" and pid == 1:
    conn.send(("error", "FloatingPointError", "non-finite loss"))
  elif cmd == "train_step" and args[0] == "bad config" and pid == 1:
    from areal_jax import config
    from areal_jax.runtime import process_group
    try:
      raise config.ConfigError("actor.lr=-1 must be >= 0")
    except config.ConfigError as e:
      conn.send(process_group.error_reply(e))
  elif cmd == "train_step":
    conn.send(("ok", dict(loss=float(pid))))
  elif cmd == "restore":
    conn.send(("ok", (4, dict(version=4))))
  else:
    conn.send(("ok", None))
"""


def test_group_protocol_with_external_processes(tmp_path, monkeypatch):
  """runtime.learner_address: the driver waits for processes started elsewhere; process 0's
  metrics come back, a worker's error is raised under its type naming the process (a fault a
  person fixes under its own type, its message one line), and a
  dead worker stops the group with LearnerProcessDied."""
  from areal_jax.runtime import distributed, learner_worker
  from areal_jax.runtime.errors import LearnerProcessDied

  monkeypatch.setenv(learner_worker.AUTHKEY_ENV, "ab" * 16)
  address = f"127.0.0.1:{distributed.free_port()}"
  c = config_lib.load(TINY)
  for k, v in dict(GROUP, **{"runtime.learner_address": address}).items():
    config_lib.override(c, k, v)
  procs = [subprocess.Popen([sys.executable, "-c", FAKE_WORKER, str(i), address],
                            stderr=subprocess.PIPE) for i in (1, 0)]
  try:
    group = learner_group.LearnerGroup(c, str(tmp_path), start_timeout_s=60)
    assert group.version == 5 and group.num_params == 7
    assert group.train_step("batch", []) == {"loss": 0.0} and group.version == 6
    ckpt = group.checkpointer()
    ckpt.save(6, group.state, dict(version=6))
    with pytest.raises(TypeError, match="restores its own state"):
      ckpt.save(6, {"params": {}}, dict(version=6))  # only the group's own state is saved
    assert ckpt.restore_latest(None) == (4, learner_group.REMOTE_STATE, dict(version=4))
    assert group.version == 4
    group.load_state(learner_group.REMOTE_STATE)
    with pytest.raises(FloatingPointError, match="learner process 1: .*non-finite loss"):
      group.train_step("fail", [])
    with pytest.raises(config_lib.ConfigError) as fault:
      group.train_step("bad config", [])
    assert str(fault.value) == "learner process 1: actor.lr=-1 must be >= 0"  # (traceback: a note)
    with pytest.raises(LearnerProcessDied, match="learner process 1 closed its connection"):
      group.train_step("die", [])
    with pytest.raises(RuntimeError, match="closed"):
      group.train_step("batch", [])
    assert [p.wait(timeout=30) for p in procs] == [3, 0]  # process 0 exits when the driver goes
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.mark.slow
def test_killed_learner_process_restarts_the_run_from_its_checkpoint(tmp_path):
  steps, eta = 3, 1
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path}",
         f"--config.train.total_steps={steps}", "--config.train.checkpoint_every=1",
         "--config.train.dump_trajectories=True", f"--config.rollout.max_head_offpolicyness={eta}",
         "--config.rollout.max_new_tokens=16"] + [f"--config.{k}={v}" for k, v in GROUP.items()]
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  out, err = open(tmp_path / "out.txt", "w+"), open(tmp_path / "err.txt", "w+")
  proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
  pids_file, ckpt_dir = tmp_path / "learner_processes.json", tmp_path / "checkpoints"
  try:
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
      if ckpt_dir.exists() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        break
      time.sleep(0.2)
    assert proc.poll() is None, "the run ended before a learner process could be killed"
    first = json.loads(pids_file.read_text())
    os.kill(first[1]["pid"], signal.SIGKILL)
    proc.wait(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  out.seek(0), err.seek(0)
  stdout, stderr = out.read(), err.read()
  assert proc.returncode == 0, stderr[-3000:]
  assert "learner process 1 exited with status -9" in stderr
  assert "supervisor: the training process lost a learner process; restart 1/3" in stderr
  assert f"resumed from {ckpt_dir} at version" in stdout
  # The run finished at total_steps: every version once, in order, within the staleness bound.
  rows = metrics_lib.read(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [r["version"] for r in rows] == list(range(1, steps + 1))
  assert all(r["staleness_max"] <= eta for r in rows)
  assert max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == steps
  assert max(int(p.name) for p in (tmp_path / "weights").iterdir() if p.name.isdigit()) == steps
  samples = []
  for path in sorted(glob.glob(str(tmp_path / "trajectories" / "step_*.jsonl"))):
    samples += [json.loads(line) for line in open(path)]
  assert sorted({s["trained_at_version"] for s in samples}) == list(range(steps))
  assert all(0 <= s["staleness"] <= eta for s in samples)
  trained = [s["example_id"] for s in samples if s["index"] == 0]
  assert len(trained) == len(set(trained)) == steps * 4  # no prompt trained twice
  # Both groups' processes are gone.
  last = json.loads(pids_file.read_text())
  assert {p["pid"] for p in last} != {p["pid"] for p in first}
  assert not any(_alive(p["pid"]) for p in first + last)


@pytest.mark.slow
def test_a_lora_group_publishes_adapters_and_the_driver_samples_the_merged_policy(tmp_path):
  """actor.lora with a learner group: the processes train and publish only the adapters; the
  driver's sampler merges each version into its base, so its behaviour logprobs are those of the
  merged policy of their version."""
  from areal_jax.runtime import trainer

  steps, eta = 3, 1
  c = config_lib.load(f"{ROOT}/configs/arithmetic.py:tiny")
  for k, v in dict(GROUP, **{
      "mesh.colocated": False, "mesh.sampler_devices": 1, "actor.lora.rank": 4,
      "actor.lora.alpha": 8.0, "train.total_steps": steps, "rollout.max_head_offpolicyness": eta,
      "train.eval_every": 0, "train.checkpoint_every": 100, "train.dump_trajectories": True,
      "weights.keep": steps + 1,
      # the random model never scores: a constant advantage of 1 still trains the adapters
      "actor.adv_norm": "none", "actor.reward_bias": 1.0}).items():
    config_lib.override(c, k, v)
  trainer.run(c, str(tmp_path))
  lora_run.check_adapters_trained_and_sampled(c, tmp_path, steps, eta)
