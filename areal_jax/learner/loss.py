"""Token logprobs and the decoupled PPO / GRPO objective (docs/concepts/decoupled-ppo.md). Pure jnp.

Alignment: position t of a row scores token t+1, so every per-token array of the learner (mask,
advantage, behaviour / proximal logprobs) is indexed by the *scoring* position; the last position
of a row scores nothing.

Per scored token, with ratio r = exp(logp - old_logp) and advantage A:
  l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))      (dual clip: min(l, c |A|) when A < 0)
  w = exp(old_logp - behav_logp)   (decoupled loss only; capped by masking or clamping; no gradient)
  loss = sum(mask * w * l) / n_tokens
``old_logp`` is the proximal policy for the decoupled loss, the old policy otherwise. ``n_tokens``
is the number of scored tokens in the whole minibatch (all micro-batches and shards), counted
before any cap-masking, so micro-batch losses add up to the minibatch token mean.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

METRIC_SUMS = ("loss", "pg_loss", "kl_loss", "clip_frac", "dual_clip_frac", "behav_weight_mean",
               "cap_masked_frac", "approx_kl", "entropy")
METRIC_MAXES = ("behav_weight_max",)


def token_logprobs(logits_BxLxV, tokens_BxL, temperature: float):
  """``(logp_BxL, entropy_BxL)`` of ``softmax(logits / T)``; position t scores token t+1.

  The last position (which scores nothing) gets 0 for both. Both carry exact gradients.
  """
  next_BxL = jnp.roll(tokens_BxL, -1, axis=1)
  logp_BxL, entropy_BxL = logprob_entropy(logits_BxLxV, next_BxL, temperature)
  last = jnp.arange(tokens_BxL.shape[1]) == tokens_BxL.shape[1] - 1
  return jnp.where(last, 0.0, logp_BxL), jnp.where(last, 0.0, entropy_BxL)


def logprob_entropy(logits_BxLxV, next_BxL, temperature: float):
  """``(logp, entropy)`` of ``next_BxL`` under ``softmax(logits / T)`` at every position."""
  return _logprob_entropy(logits_BxLxV.astype(jnp.float32), next_BxL, float(temperature))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logprob_entropy(logits_BxLxV, next_BxL, temperature: float):
  return _logprob_entropy_fwd(logits_BxLxV, next_BxL, temperature)[0]


def _logprob_entropy_fwd(logits_BxLxV, next_BxL, temperature):
  # One pass of exp over the vocabulary, shared by both sums. (Written with exp(z - lse) inside
  # each sum, XLA:CPU fuses the exp into a library reduction that ran ~30x slower than this.)
  z = logits_BxLxV / temperature
  m_BxL = jnp.max(z, axis=-1)
  e = jnp.exp(z - m_BxL[..., None])
  s_BxL = jnp.sum(e, axis=-1)
  lse_BxL = m_BxL + jnp.log(s_BxL)
  mean_z_BxL = jnp.sum(e * z, axis=-1) / s_BxL
  target_BxL = jnp.take_along_axis(z, next_BxL[..., None], axis=-1)[..., 0]
  entropy_BxL = lse_BxL - mean_z_BxL
  return (target_BxL - lse_BxL, entropy_BxL), (logits_BxLxV, next_BxL, lse_BxL, mean_z_BxL)


def _logprob_entropy_bwd(temperature, res, g):
  """d logp / dz = onehot - p;  d entropy / dz = p (E_p[z] - z);  z = logits / T."""
  logits_BxLxV, next_BxL, lse_BxL, mean_z_BxL = res
  g_logp_BxL, g_ent_BxL = g
  z = logits_BxLxV / temperature
  p = jnp.exp(z - lse_BxL[..., None])
  onehot = jnp.arange(z.shape[-1]) == next_BxL[..., None]
  dz = (jnp.where(onehot, g_logp_BxL[..., None], 0.0) - p * g_logp_BxL[..., None]
        + g_ent_BxL[..., None] * p * (mean_z_BxL[..., None] - z))
  return dz / temperature, None


_logprob_entropy.defvjp(_logprob_entropy_fwd, _logprob_entropy_bwd)


def seq_mean(x_BxL, mask_BxL, segment_ids_BxL):
  """Per-token broadcast of the masked mean of ``x`` over its sequence.

  A sequence is one segment of one row (segment ids are only unique within a row).
  """
  b, l = x_BxL.shape
  ids = (jnp.arange(b)[:, None] * l + segment_ids_BxL).reshape(-1)
  tot = jax.ops.segment_sum((x_BxL * mask_BxL).reshape(-1), ids, b * l)
  cnt = jax.ops.segment_sum(mask_BxL.reshape(-1), ids, b * l)
  return (tot / jnp.maximum(cnt, 1.0))[ids].reshape(b, l)


def ppo_loss(logp, old_logp, behav_logp, adv, mask, segment_ids, n_tokens, opts, ref_logp=None):
  """The (decoupled) PPO loss of one micro-batch, divided by the minibatch's ``n_tokens``.

  All arrays are ``[B, L]`` and aligned to the scoring position; ``opts`` is the ``actor`` config.
  Only ``logp`` carries a gradient. ``ref_logp`` (a frozen reference model) adds the k3 KL
  penalty ``kl_coef * (exp(ref - logp) - (ref - logp) - 1)`` per token when ``kl_coef > 0``.
  Returns ``(loss, metrics)``: every metric in ``METRIC_SUMS`` is a sum divided by ``n_tokens`` (so
  micro-batches add up to minibatch means); ``behav_weight_max`` is a max.
  """
  on = mask > 0
  maskf = on.astype(jnp.float32)
  old_logp = jax.lax.stop_gradient(old_logp)
  behav_logp = jax.lax.stop_gradient(behav_logp)
  # Zero outside the mask, so padding can never produce an inf (or a NaN gradient).
  log_ratio = jnp.where(on, logp - old_logp, 0.0)
  if opts.seq_level_ratio:  # GSPO: the geometric mean of the token ratios of the sequence
    log_ratio = seq_mean(log_ratio, maskf, segment_ids)
  ratio = jnp.exp(log_ratio)
  eps_low = opts.eps_clip
  eps_high = opts.eps_clip_high if opts.eps_clip_high else opts.eps_clip
  surr1 = -adv * ratio
  surr2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_tok = jnp.maximum(surr1, surr2)
  clipped = surr2 > surr1
  dual = jnp.zeros_like(clipped)
  if opts.dual_clip:
    bound = opts.dual_clip * jnp.abs(adv)
    dual = (adv < 0) & (per_tok > bound)
    per_tok = jnp.where(dual, bound, per_tok)

  log_w_raw = jnp.where(on, old_logp - behav_logp, 0.0)
  weight = jnp.ones_like(per_tok)
  cap_masked = jnp.zeros_like(on)
  if opts.use_decoupled_loss:
    log_w = log_w_raw
    if opts.behav_imp_weight_level == "sequence":
      log_w = seq_mean(log_w, maskf, segment_ids)
    weight = jnp.exp(log_w)
    cap = opts.behav_imp_weight_cap
    if cap:
      if opts.behav_imp_weight_mode == "mask":
        cap_masked = on & (weight > cap)
        weight = jnp.where(cap_masked, 0.0, weight)
      else:
        weight = jnp.minimum(weight, cap)
  pg_tok = weight * per_tok

  kl_tok = jnp.zeros_like(pg_tok)
  if opts.kl_coef and ref_logp is not None:
    d = jnp.where(on, jax.lax.stop_gradient(ref_logp) - logp, 0.0)
    kl_tok = opts.kl_coef * (jnp.exp(d) - d - 1.0)

  denom = jnp.maximum(n_tokens, 1.0)
  tsum = lambda x: jnp.sum(jnp.where(on, x, 0.0)) / denom
  pg_loss, kl_loss = tsum(pg_tok), tsum(kl_tok)
  loss = pg_loss + kl_loss
  lr = jax.lax.stop_gradient(jnp.where(on, logp - old_logp, 0.0))
  w_raw = jnp.exp(log_w_raw)
  metrics = dict(
      loss=loss, pg_loss=pg_loss, kl_loss=kl_loss,
      clip_frac=tsum(clipped.astype(jnp.float32)), dual_clip_frac=tsum(dual.astype(jnp.float32)),
      behav_weight_mean=tsum(w_raw), behav_weight_max=jnp.max(jnp.where(on, w_raw, 0.0)),
      cap_masked_frac=tsum(cap_masked.astype(jnp.float32)),
      approx_kl=tsum(jnp.exp(lr) - 1.0 - lr))  # k3 estimate of KL(old || new)
  return loss, metrics
