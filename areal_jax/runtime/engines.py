"""Builds the rollout engine named by ``rollout.backend`` on the sampler mesh."""

from __future__ import annotations

from areal_jax.rollout_api import RolloutEngine


def build(config, model, tokenizer, sampler_mesh) -> RolloutEngine:
  r = config.rollout
  if r.backend == "jax":
    from areal_jax.sampler.service import JaxRolloutEngine

    return JaxRolloutEngine(
        model, mesh=sampler_mesh, num_slots=r.num_slots,
        max_len=max(r.prefill_buckets) + r.max_new_tokens, prefill_buckets=tuple(r.prefill_buckets),
        continuation=r.continuation, eos_token_ids=tuple(tokenizer.eos_token_ids))
  raise ValueError(f"rollout.backend={r.backend!r}: only 'jax' is available in this version "
                   "(the vLLM backend is tracked as its own issue)")
