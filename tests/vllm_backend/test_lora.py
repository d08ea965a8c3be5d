"""LoRA through vLLM's own LoRA support (in-process engine, real vLLM on CPU).

The learner publishes adapters only; the engine writes each version as a PEFT directory and runs
every request with it. Parity: behaviour logprobs equal our teacher-forced logprobs of the *merged*
model (base + scale * a @ b) within 1e-3, and differ from the base model's; a second version
replaces the first; what is written per version is a small fraction of the full weights.
"""

import os
import time

import jax
import numpy as np
import pytest

pytest.importorskip("vllm")

from areal_jax.models import lora  # noqa: E402
from areal_jax.rollout_api import GroupRequest, SamplingParams  # noqa: E402
from areal_jax.vllm_rollout import VllmInProcessEngine  # noqa: E402
from areal_jax.vllm_rollout.inprocess import vllm_lora_rank  # noqa: E402

from vllm_helpers import collect, pure, teacher_forced  # noqa: E402

pytestmark = pytest.mark.vllm
TOL = 1e-3
LCFG = lora.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"))


def adapters(base, seed):
  """Random adapters with a non-zero ``b`` (a fresh adapter would leave the model unchanged)."""
  ad = lora.init_adapters(base, LCFG, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(ad)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
                                      for x, k in zip(leaves, keys)])


def dir_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def wait_version(engine, version, timeout=120):
  deadline = time.time() + timeout
  while engine.version != version:
    assert time.time() < deadline, f"version {version} was not applied"
    time.sleep(0.01)


def test_vllm_lora_rank_is_the_smallest_that_holds_the_adapters():
  assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 300)] == [1, 8, 8, 16, 16, 320]
  with pytest.raises(ValueError, match="actor.lora.rank=600"):
    vllm_lora_rank(600)


def test_adapters_run_through_vllm_lora(policies, tokenizer, tmp_path):
  model = policies[0]
  base = pure(model)
  engine = VllmInProcessEngine(model, tokenizer, workdir=str(tmp_path), num_slots=4,
                               max_model_len=128, lora=LCFG)
  engine.start()
  try:
    for version, seed in ((1, 0), (2, 1)):
      ad = adapters(base, seed)
      engine.update_params(ad, version)
      wait_version(engine, version)
      engine.submit(GroupRequest(version, tokenizer.encode("2 + 3 ="), 2,
                                 SamplingParams(temperature=0.8, max_new_tokens=16)))
      merged = lora.merged_model(model, ad, LCFG)
      for s in collect(engine, 2):
        assert s.finish_reason in ("eos", "length") and s.versions == [version] * len(s.tokens)
        np.testing.assert_allclose(s.logprobs, teacher_forced(merged, s, 0.8), atol=TOL)
        assert np.max(np.abs(np.asarray(s.logprobs) - teacher_forced(model, s, 0.8))) > 10 * TOL
      written = engine.weights.path(version)
      assert engine.weights.is_adapter_dir(written)
      assert dir_bytes(written) < 0.2 * dir_bytes(engine.weights.path(0))
  finally:
    engine.close()


def test_a_lora_config_builds_the_native_engine(policies, tokenizer, tmp_path):
  """``rollout.backend="vllm"`` with ``actor.lora.rank > 0``: the in-process engine applies the
  adapters itself (no host-side merge wrapper)."""
  from areal_jax import config as config_lib
  from areal_jax.runtime import engines

  c = config_lib.base_config()
  c.rollout.backend = "vllm"
  c.actor.lora.rank = 4
  c.rollout.num_slots = 2
  c.rollout.max_prompt_len = 64
  c.rollout.max_new_tokens = 16
  c.weights.path = str(tmp_path)
  engine = engines.build(c, policies[0], tokenizer, None)
  try:
    assert isinstance(engine, VllmInProcessEngine) and engine.lora.rank == 4
  finally:
    engine.close()
