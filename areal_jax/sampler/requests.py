"""A group request checked against the sampler it is submitted to (the JAX sampler's service or a
vLLM engine), before it waits for slots: each problem named (the engine emits it as that
request's ``"error"`` samples)."""

from __future__ import annotations

from areal_jax.rollout_api import GroupRequest, SamplingParams


def validate(r: GroupRequest, *, max_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
             num_slots: int | None = None, max_stop_ids: int | None = None,
             room: str | None = None) -> tuple[int, ...]:
  """The request's stop ids (its EOS ids unless it ignores them, then its own stop ids); raises
  ``ValueError`` naming what is wrong with it. ``num_slots`` / ``max_stop_ids``: the sampler's
  limits on samples per group and stop ids (None: none); ``room``: what ``max_len`` is called in
  the message (default: a cache of that many positions)."""
  p: SamplingParams = r.params
  prompt = r.prompt_tokens
  if not prompt:
    raise ValueError("empty prompt")
  if len(prompt) >= max_len:
    raise ValueError(f"prompt of {len(prompt)} tokens leaves no room "
                     + (room or f"in a cache of {max_len} positions"))
  if any(not 0 <= int(t) < vocab_size for t in prompt):
    raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
  if num_slots is None and r.n < 1:
    raise ValueError(f"n={r.n} must be >= 1")
  if num_slots is not None and not 1 <= r.n <= num_slots:
    raise ValueError(f"n={r.n} must be between 1 and the slot count {num_slots}")
  if not p.greedy and not p.temperature > 0:
    raise ValueError(f"temperature={p.temperature} must be > 0 (or set greedy=True)")
  if not 0 < p.top_p <= 1:
    raise ValueError(f"top_p={p.top_p} must lie in (0, 1]")
  if p.top_k < 0:
    raise ValueError(f"top_k={p.top_k} must be >= 0 (0 disables it)")
  if p.max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={p.max_new_tokens} must be >= 1")
  eos = () if p.ignore_eos else eos_token_ids
  stop_ids = tuple(dict.fromkeys([*eos, *(int(t) for t in p.stop_token_ids)]))
  if max_stop_ids is not None and len(stop_ids) > max_stop_ids:
    raise ValueError(f"{len(stop_ids)} EOS + stop ids exceed max_stop_ids={max_stop_ids}")
  if any(not 0 <= t < vocab_size for t in stop_ids):
    raise ValueError("stop token ids must be valid vocabulary ids")
  return stop_ids
