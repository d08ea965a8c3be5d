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
        continuation=r.continuation, eos_token_ids=tuple(tokenizer.eos_token_ids),
        steps_per_call=r.steps_per_call, decode_attention=r.decode_attention,
        decode_matmul=r.decode_matmul, decode_layers=r.decode_layers)
  if r.backend == "vllm":  # optional: needs vLLM (make install-vllm), raises a clear error without
    from areal_jax.vllm_rollout.factory import build as build_vllm

    return build_vllm(config, model, tokenizer, sampler_mesh)
  raise ValueError(f"rollout.backend={r.backend!r} is not one of ('jax', 'vllm')")
