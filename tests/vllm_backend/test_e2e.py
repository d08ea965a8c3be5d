"""End to end: the asynchronous loop on the tiny preset with the vLLM backend (eta = 1) completes,
every trained sample respects the staleness bound, and partial rollouts mix versions (the vLLM
server in a SIGKILLed Ray worker: test_e2e_ray.py, a module of its own so that xdist's loadfile
runs the two on different workers).

The tiny preset's model (head_dim 16) is below what vLLM's CPU attention supports, so the run uses
the same tiny architecture with head_dim 32, written as a Hugging Face directory (model.source)."""

import glob
import json
import os
import pathlib

import pytest

pytest.importorskip("vllm")
learner = pytest.importorskip("areal_jax.learner")
if not hasattr(learner, "Learner"):
  pytest.skip("the learner has not landed yet", allow_module_level=True)

from flax import nnx  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import models  # noqa: E402
from areal_jax.runtime import metrics as metrics_lib  # noqa: E402

from vllm_helpers import tiny_hd32_config  # noqa: E402

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
