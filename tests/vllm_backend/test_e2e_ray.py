"""End to end: a vLLM server inside a Ray rollout worker that is SIGKILLed mid-run (the tiny
preset's architecture with head_dim 32, as in test_e2e.py, whose run config it shares)."""

import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")

from areal_jax.runtime import metrics as metrics_lib  # noqa: E402
from areal_jax.vllm_rollout import lifeline  # noqa: E402

from test_e2e import _config  # noqa: E402  (this directory is on sys.path: conftest.py)
from vllm_helpers import STOP_WAIT_S, group_gone  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _ppid(pid: int) -> int:
  with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def _read_pid(path) -> int:
  with open(path, encoding="utf-8") as f:
    return int(f.read())


def test_vllm_server_in_a_ray_worker_that_is_sigkilled(tmp_path, monkeypatch):
  """rollout.backend="vllm" (a server) inside a Ray rollout worker. The worker, the process that
  started the server, is SIGKILLed after the first step, so no exit handler of its runs: the
  server, leading a process group of its own, stops with every process of that group within
  STOP_WAIT_S of the kill (the lifeline sees its owner gone; before the lifeline such servers ran
  on, holding their port and memory). Ray restarts the worker, which starts a server of its own,
  and the run finishes within the staleness bound. When the run ends, Ray SIGKILLs the worker's
  direct children, the lifeline among them: the server, guarding itself, stops too. No server is
  left."""
  from areal_jax.runtime import trainer

  monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # no second kill by Ray's own monitor
  steps, eta = 4, 1
  c = _config(tmp_path, steps, eta, **{
      "rollout.vllm.mode": "server", "rollout.vllm.workdir": str(tmp_path / "vllm"),
      "runtime.mode": "ray", "rollout.workers": 1, "rollout.max_new_tokens": 64})
  workdir, pid_file = tmp_path / "run", tmp_path / "vllm" / "server.pid"
  killed = {}

  def killer():  # once step 1 is trained: SIGKILL the worker (the server's lifeline's parent)
    deadline = time.time() + 600
    while time.time() < deadline:
      if (workdir / "metrics.jsonl").exists() and \
          (workdir / "metrics.jsonl").read_text().count("\n") >= 1:
        server = _read_pid(pid_file)
        killed.update(server=server, worker=_ppid(_ppid(server)),
                      leads=server in (lifeline.group_members(server) or ()))
        os.kill(killed["worker"], signal.SIGKILL)
        killed["gone"] = group_gone(server)  # within STOP_WAIT_S of the kill, the run going on
        return
      time.sleep(0.1)

  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  trainer.run(c, str(workdir))
  thread.join(timeout=STOP_WAIT_S + 10)  # (its check of the killed server: STOP_WAIT_S at most)

  assert killed, "step 1 was not trained within 600 s"
  assert killed["leads"], "the vLLM server did not lead a process group of its own"
  assert killed["gone"], f"the killed worker's vLLM server outlived it by {STOP_WAIT_S} s"
  restarted = _read_pid(pid_file)
  assert restarted != killed["server"]  # the restarted worker started a server of its own
  assert group_gone(restarted), "the vLLM server outlived the run"
  rows = metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert all(r["staleness_max"] <= eta for r in rows)
