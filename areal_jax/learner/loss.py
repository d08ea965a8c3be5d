"""Token logprobs and the decoupled PPO / GRPO objective (REFERENCE section 3). Pure jnp.

Alignment: position t of a row scores token t+1, so every per-token array of the learner is
aligned to the *scoring* position; the last position of a row scores nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits_BxLxV, tokens_BxL, temperature: float):
  """``(logp_BxL, entropy_BxL)`` of ``softmax(logits / T)``; position t scores token t+1."""
  logits = logits_BxLxV[:, :-1].astype(jnp.float32) / temperature
  lse_BxL = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, tokens_BxL[:, 1:, None], axis=-1)[..., 0]
  probs = jnp.exp(logits - lse_BxL[..., None])
  entropy = lse_BxL - jnp.sum(probs * logits, axis=-1)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))
  return pad(target - lse_BxL), pad(entropy)


def _seq_mean(x_BxL, mask_BxL, seq_BxL, num_seqs: int):
  """Per-token broadcast of the masked mean of ``x`` over each sequence (``seq`` ids, -1 = none)."""
  ids = jnp.where(seq_BxL >= 0, seq_BxL, num_seqs).reshape(-1)
  tot = jax.ops.segment_sum((x_BxL * mask_BxL).reshape(-1), ids, num_seqs + 1)
  cnt = jax.ops.segment_sum(mask_BxL.reshape(-1), ids, num_seqs + 1)
  return (tot / jnp.maximum(cnt, 1.0))[ids].reshape(x_BxL.shape)


def ppo_loss(logp, old_logp, behav_logp, adv, mask, seq, n_tokens, opts, num_seqs: int,
             ref_logp=None):
  """Sum over tokens of the (decoupled) PPO loss divided by ``n_tokens`` (the global token count).

  ``old_logp`` is the proximal policy (decoupled) or the old policy (standard PPO); ``behav_logp``
  is only used by the decoupled loss. Returns ``(loss, metric sums)``; metric sums are divided by
  ``n_tokens`` too, so micro-batches add up to minibatch means.
  """
  mask = mask.astype(jnp.float32)
  old_logp = jax.lax.stop_gradient(old_logp)
  log_ratio = logp - old_logp
  if opts.seq_level_ratio:  # GSPO: geometric mean of the token ratios of the sequence
    log_ratio = _seq_mean(log_ratio, mask, seq, num_seqs)
  ratio = jnp.exp(log_ratio)
  eps_low = opts.eps_clip
  eps_high = opts.eps_clip_high or opts.eps_clip
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  l1, l2 = -adv * ratio, -adv * clipped
  per_tok = jnp.maximum(l1, l2)
  if opts.dual_clip:
    per_tok = jnp.where(adv < 0, jnp.minimum(per_tok, opts.dual_clip * jnp.abs(adv)), per_tok)
  clip_hit = (l2 > l1).astype(jnp.float32)
  weight = jnp.ones_like(per_tok)
  cap_masked = jnp.zeros_like(per_tok)
  if opts.use_decoupled_loss:
    log_w = jax.lax.stop_gradient(old_logp - behav_logp)
    if opts.behav_imp_weight_level == "sequence":
      log_w = _seq_mean(log_w, mask, seq, num_seqs)
    weight = jnp.exp(log_w)
    cap = opts.behav_imp_weight_cap
    if cap:
      if opts.behav_imp_weight_mode == "mask":
        cap_masked = (weight > cap).astype(jnp.float32)
        weight = weight * (1.0 - cap_masked)
      else:
        weight = jnp.clip(weight, 0.0, cap)
  loss_tok = weight * per_tok
  if opts.kl_coef and ref_logp is not None:
    d = jax.lax.stop_gradient(ref_logp) - logp
    loss_tok = loss_tok + opts.kl_coef * (jnp.exp(d) - d - 1.0)
  denom = jnp.maximum(n_tokens, 1.0)
  loss = jnp.sum(mask * loss_tok) / denom
  lr = logp - old_logp
  w_raw = jnp.exp(jax.lax.stop_gradient(old_logp - behav_logp))
  metrics = dict(
      loss=loss, clip_frac=jnp.sum(mask * clip_hit) / denom,
      behav_weight_mean=jnp.sum(mask * w_raw) / denom,
      behav_weight_max=jnp.max(jnp.where(mask > 0, w_raw, 0.0)),
      cap_masked_frac=jnp.sum(mask * cap_masked) / denom,
      approx_kl=jnp.sum(mask * jax.lax.stop_gradient(jnp.exp(lr) - 1.0 - lr)) / denom)
  return loss, metrics
