"""End to end: the asynchronous loop on the tiny preset with the vLLM backend (eta = 1) completes,
every trained sample respects the staleness bound, and partial rollouts mix versions.

The tiny preset's model (head_dim 16) is below what vLLM's CPU attention supports, so the run uses
the same tiny architecture with head_dim 32, written as a Hugging Face directory (model.source)."""

import glob
import json
import os
import pathlib
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")
learner = pytest.importorskip("areal_jax.learner")
if not hasattr(learner, "Learner"):
  pytest.skip("the learner has not landed yet", allow_module_level=True)

from flax import nnx  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import models  # noqa: E402
from areal_jax.runtime import metrics as metrics_lib  # noqa: E402

from vllm_helpers import group_gone, tiny_hd32_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(tmp_path, steps, eta, **overrides):
  """The tiny preset with vLLM on the tiny model (head_dim 32) and arithmetic prompts."""
  tokenizer = models.byte_tokenizer()
  model_dir = models.save_hf(models.Transformer(tiny_hd32_config(tokenizer), nnx.Rngs(0)),
                             tokenizer, str(tmp_path / "tiny_hd32"))
  c = config_lib.load(f"{ROOT}/configs/gsm8k.py:tiny")
  for key, value in {"model.source": model_dir, "rollout.backend": "vllm",
                     "rollout.max_head_offpolicyness": eta, "train.total_steps": steps,
                     "train.dump_trajectories": True, "task.name": "arithmetic",
                     "rollout.max_prompt_len": 384, "rollout.prefill_buckets": (128, 256, 384),
                     "rollout.num_slots": 4, "weights.path": str(tmp_path / "weights"),
                     **overrides}.items():
    config_lib.override(c, key, value)
  return c


def test_async_run_with_vllm_respects_the_staleness_bound(tmp_path):
  from areal_jax.runtime import trainer

  steps, eta, batch, n = 4, 1, 4, 4
  # Generation is the bottleneck, as in real RL (short arithmetic prompts, long generations of a
  # random model on few slots), so weight updates land mid-sequence.
  c = _config(tmp_path, steps, eta, **{"rollout.max_new_tokens": 256})
  workdir = tmp_path / "run"
  trainer.run(c, str(workdir))

  rows = metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert all(r["staleness_max"] <= eta for r in rows)
  samples = []
  for path in sorted(glob.glob(os.path.join(workdir, "trajectories", "step_*.jsonl"))):
    with open(path) as f:
      samples += [json.loads(line) for line in f]
  assert len(samples) == steps * batch * n
  for s in samples:
    assert s["staleness"] == s["trained_at_version"] - min(s["versions"])
    assert 0 <= s["staleness"] <= eta, s
    assert s["versions"] == sorted(s["versions"])
    assert len(s["tokens"]) == len(s["logprobs"]) == len(s["versions"]) >= 1
  assert any(len(set(s["versions"])) > 1 for s in samples), "no partial rollout crossed an update"


def _ppid(pid: int) -> int:
  with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def _read_pid(path) -> int:
  with open(path, encoding="utf-8") as f:
    return int(f.read())


def test_vllm_server_in_a_ray_worker_that_is_sigkilled(tmp_path, monkeypatch):
  """rollout.backend="vllm" (a server) inside a Ray rollout worker. The worker is SIGKILLed after
  the first step: its server stops with it (the lifeline sees its owner gone), Ray restarts the
  worker, which starts a server of its own, and the run finishes within the staleness bound. When
  the run ends, Ray SIGKILLs the worker's direct children, the lifeline among them: the server,
  guarding itself, stops too. No server is left."""
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
        killed.update(server=server, worker=_ppid(_ppid(server)))
        os.kill(killed["worker"], signal.SIGKILL)
        return
      time.sleep(0.1)

  thread = threading.Thread(target=killer, daemon=True)
  thread.start()
  trainer.run(c, str(workdir))
  thread.join(timeout=5)

  assert killed, "step 1 was not trained within 600 s"
  assert group_gone(killed["server"]), "the killed worker's vLLM server outlived it"
  restarted = _read_pid(pid_file)
  assert restarted != killed["server"]  # the restarted worker started a server of its own
  assert group_gone(restarted), "the vLLM server outlived the run"
  rows = metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert all(r["staleness_max"] <= eta for r in rows)
