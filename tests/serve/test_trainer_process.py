"""The trainer loop in its own process (``serve.trainer_process``) on the tiny model: it trains on the
server's recorded turns, the server loads the versions it publishes, and a SIGKILL leaves serving up
while the supervisor restarts it; the new process resumes with nothing trained twice. A fault a
restart would not change is not restarted into but named in one line, an interrupted start
leaves no process behind, and with LoRA the server serves the merged policy of each version."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "runtime"))
import lora_run  # noqa: E402  pylint: disable=wrong-import-position

from areal_jax import config as config_lib
from areal_jax.serve import trainer_loop, trainer_process
from areal_jax.serve.runtime import ServeRuntime
from areal_jax.serve.simulated_user import SimulatedUsers


def _wait(cond, users, timeout=120.0):
  deadline = time.time() + timeout
  while not cond():
    assert time.time() < deadline, "timed out"
    users.run(1.0)


def _poll(cond, timeout=120.0):  # (a wait the users' turns do not help)
  deadline = time.time() + timeout
  while not cond():
    assert time.time() < deadline, "timed out"
    time.sleep(0.2)


@pytest.mark.slow
def test_trainer_process_trains_survives_sigkill_and_resumes_without_training_twice(tmp_path):
  """With ``serve.signal = "combined"`` and users who give the verdict and the way, the OPD teacher
  runs in the trainer process too (``serve.teacher_at = "trainer"``): its counters come through the
  status file and its scores survive the restart. After the restart it waits for one step past
  the version it resumed from: a step trained by the new process, which is the lost step redone
  when the kill lost one (the metrics then hold each version once). While the trainer restarts
  the users pause (one request shows serving is up); they talk again for the step after it, and
  pause while the server loads the trainer's last version (a swap needs no request)."""
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.signal, config.serve.sim_feedback = "combined", "both"
  config.serve.port = 0
  config.serve.judge_timeout_s = 0.5
  config.serve.trainer_process = True
  config.serve.weights_poll_s = 0.2
  config.train.checkpoint_every = 2  # a kill can lose a step: it must be redone, not repeated
  config.lock()
  affinity = os.sched_getaffinity(0)
  rt = ServeRuntime(config, str(tmp_path))
  rt.start()
  try:
    if len(affinity) > 1:  # pinned apart
      server, trainer = rt.cores
      assert os.sched_getaffinity(0) == set(server) and not set(server) & set(trainer)
    users = SimulatedUsers(rt.config, rt.url)
    _wait(lambda: rt.engine.version >= 2, users)  # trained there, loaded here
    _wait(lambda: rt.status()["trainer"].get("teacher_scored", 0) > 0, users)
    health = rt.status()["trainer"]
    assert health["process"] and health["alive"] and health["error"] is None
    assert health["teacher_s_per_turn"] > 0 and "teacher_s" not in rt.status()["judge"]
    pid = rt.trainer.pid
    os.kill(pid, signal.SIGKILL)
    # the version the killed trainer last wrote (a restarted one writes only after restoring); a
    # step checkpoints before that status write, so a kill between them leaves one newer checkpoint
    before = trainer_process.read_status(rt.trainer.workdir)["version"]
    client = openai.OpenAI(base_url=rt.url, api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=config.serve.model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "What is 2 + 3?"}])
    assert r.choices[0].message.content is not None  # serving is up while the trainer is down
    _poll(lambda: rt.trainer.restarts >= 1 and rt.trainer.status() is not None)
    assert rt.trainer.pid != pid
    resumed = rt.trainer.status()["published"]
    assert resumed <= before + 1  # resumed from its newest checkpoint
    # one step past the resumed version: trained after the restart, the lost step (if any) redone
    _wait(lambda: rt.trainer.status()["version"] > resumed, users)
    _poll(lambda: rt.engine.version == rt.trainer.status()["published"], timeout=30)

    rt.trainer.stop()  # SIGTERM: it checkpoints and writes its final counters
    st = rt.trainer.status()
    assert st["stopped"] and not rt.trainer.alive
    stats, counts = st["stats"], rt.store.counts()
    assert stats["trained"] == counts["train_status.trained"] == config.actor.batch_size * stats["steps"]
    taught = [r for r in rt.store.first(10_000) if r["teacher"] is not None]
    assert taught and stats["teacher_scored"] >= 1 and stats["taught"] >= 1
    assert all(len(r["teacher"]["logprobs"]) == len(r["completion_tokens"]) for r in taught)
    with open(tmp_path / trainer_loop.METRICS_FILE, encoding="utf-8") as f:
      versions = [json.loads(line)["version"] for line in f]
    assert versions == list(range(1, st["version"] + 1))  # each step once, the lost one redone
  finally:
    rt.stop()
  assert os.sched_getaffinity(0) == affinity and not rt.trainer.alive  # no process left behind
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)


def test_the_server_cli_imports_the_trainer_process_module_without_flag_clashes():
  import areal_jax.serve.__main__  # noqa: F401  (defines --workdir)  pylint: disable=import-outside-toplevel
  from areal_jax.serve import trainer_process, trainer_supervisor  # noqa: F401  pylint: disable=import-outside-toplevel

  assert trainer_process.STATUS_FILE and trainer_supervisor.plan_cores


@pytest.mark.slow
def test_a_trainer_process_fault_stops_the_server_start_in_one_line_not_a_restart_loop(tmp_path):
  """A trainer process that cannot start for a reason a restart does not change (here: the
  workdir's checkpoint was saved with another model.source) is not restarted; the server names
  the fault in one line and exits, leaving the checkpoint where it was."""
  from areal_jax.runtime.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel

  other = config_lib.load("configs/serve_arithmetic.py:tiny")
  config_lib.override(other, "model.source", "small")
  ckpt = Checkpointer(str(tmp_path), keep=2, config=other)
  ckpt.save(1, {"w": np.zeros(2, np.float32)}, dict(version=1, data_state={}, next_group_id=0,
                                                    pending=[], staleness={}, totals={}))
  ckpt.close()
  out = subprocess.run(
      [sys.executable, "-m", "areal_jax.serve", "--config=configs/serve_arithmetic.py:tiny",
       f"--workdir={tmp_path}", "--config.serve.port=0", "--config.serve.trainer_process=True",
       "--config.serve.warmup=False"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  (error,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert error.startswith(f"error: trainer process: checkpoint 1 in {tmp_path}/checkpoints does "
                          "not fit this run"), error
  assert "saved with other settings: model.source: 'small' then, 'tiny' now" in error
  assert "Traceback" not in out.stderr and "restarting" not in out.stderr
  assert os.listdir(tmp_path / "checkpoints") == ["1"]  # nothing moved aside
  status = trainer_process.read_status(str(tmp_path))
  assert status["fault"]["types"][0] == "RunDirError"
  with pytest.raises(ProcessLookupError):  # the trainer process is gone
    os.kill(status["pid"], 0)


@pytest.mark.slow
def test_a_start_interrupted_while_waiting_for_the_trainer_stops_the_trainer_process(tmp_path,
                                                                                      monkeypatch):
  """SIGTERM/Ctrl-C while the server starts (serve's __main__ makes both KeyboardInterrupt): start
  stops what it started, the trainer process included, and serves nothing."""
  from areal_jax.serve import trainer_supervisor  # pylint: disable=import-outside-toplevel

  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  for key, value in {"serve.port": 0, "serve.trainer_process": True, "serve.warmup": False}.items():
    config_lib.override(config, key, value)
  pids = []

  def interrupted(self, timeout):
    pids.append(self.pid)
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer_supervisor.TrainerProcess, "wait_announced", interrupted)
  rt = ServeRuntime(config, str(tmp_path))
  with pytest.raises(KeyboardInterrupt):
    rt.start()
  assert not rt.trainer.alive and rt._server is None  # pylint: disable=protected-access
  with pytest.raises(ProcessLookupError):
    os.kill(pids[0], 0)


@pytest.mark.slow
def test_lora_with_a_trainer_process_serves_the_merged_policy_of_each_version(tmp_path):
  """actor.lora with serve.trainer_process: the trainer process publishes adapters only, and the
  server merges each version into its base: the recorded turns' behaviour logprobs are those of
  the merged policy of their version."""
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  # the test judges (the random model is never right: the rule judge's scores would all be 0,
  # and so every advantage: nothing would train)
  for key, value in {"serve.port": 0, "serve.judge": "none", "serve.trainer_process": True,
                     "serve.weights_poll_s": 0.2, "actor.lora.rank": 4, "actor.lora.alpha": 8.0,
                     "weights.keep": 100,
                     # a swap re-prefills the live sequences: a prompt prefilled at version v and
                     # decoded after a swap to v+1 would otherwise attend over v's cache, and its
                     # first tokens (tagged v+1) would be no forward of v+1 alone
                     "rollout.continuation": "reprefill"}.items():
    config_lib.override(config, key, value)
  rt = ServeRuntime(config, str(tmp_path))

  def judged(cond):
    def judge_then_check():
      rows = rt.store.pending_judgement()
      rt.store.set_judgements([(r["id"], "judged", float(r["id"] % 2)) for r in rows])
      return cond()
    return judge_then_check

  rt.start()
  try:
    users = SimulatedUsers(rt.config, rt.url)
    _wait(judged(lambda: rt.engine.version >= 2), users)  # trained there, merged here
    _wait(judged(lambda: len(_served_at_one_trained_version(rt.store)) >= 4), users)
  finally:
    rt.stop()
  lora_run.check_versions_are_adapters(config, tmp_path / "weights")
  rows = _served_at_one_trained_version(rt.store)[:8]
  assert {r["temperature"] for r in rows} == {config.rollout.temperature}
  lora_run.check_merged_policy_logprobs(
      config, tmp_path / "weights", [dict(r, tokens=r["completion_tokens"]) for r in rows],
      config.rollout.temperature)


def _served_at_one_trained_version(store):
  return [r for r in store.first(100000)
          if r["versions"] and r["versions"][0] >= 1 and r["temperature"] > 0]
