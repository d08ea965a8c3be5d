"""The PPO / GRPO loss and token logprobs against an independent NumPy reference.

The reference computes the loss and its gradient with respect to the policy logprobs in closed form
(no autodiff), for every combination of the objective's options.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from areal_jax.learner import loss as loss_lib

B, L = 3, 12


def make_opts(**kw):
  base = dict(eps_clip=0.2, eps_clip_high=0.0, dual_clip=0.0, use_decoupled_loss=True,
              behav_imp_weight_cap=0.0, behav_imp_weight_mode="mask",
              behav_imp_weight_level="token", seq_level_ratio=False, kl_coef=0.0)
  base.update(kw)
  return ml_collections.ConfigDict(base)


def random_batch(seed):
  """Rows of 1-3 sequences each; mask marks scoring positions of completion tokens."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, L), np.int32)
  mask = np.zeros((B, L), np.float32)
  adv = np.zeros((B, L), np.float32)
  for r in range(B):
    off, k = 0, 1
    while off < L - 3:
      n = int(rng.integers(3, 7))
      n = min(n, L - off)
      p = int(rng.integers(1, n))  # prompt length
      seg[r, off:off + n] = k
      mask[r, off + p - 1:off + n - 1] = 1.0
      adv[r, off:off + n] = rng.normal()
      off, k = off + n, k + 1
      if rng.random() < 0.3:
        break
  logp = rng.normal(-2.0, 1.0, (B, L)).astype(np.float32)
  old = (logp + rng.normal(0.0, 0.3, (B, L))).astype(np.float32)
  behav = (old + rng.normal(0.0, 0.5, (B, L))).astype(np.float32)
  ref = (logp + rng.normal(0.0, 0.4, (B, L))).astype(np.float32)
  n_tokens = float(mask.sum()) + 3.0  # the global minibatch has more tokens than this micro-batch
  return dict(logp=logp, old=old, behav=behav, adv=adv * mask, mask=mask, seg=seg, ref=ref,
              n_tokens=n_tokens)


def reference(d, o):
  """NumPy loss, d loss / d logp, and metric sums, written out token by token."""
  logp, old, behav = d["logp"].astype(np.float64), d["old"].astype(np.float64), d["behav"]
  adv, mask, seg, n = d["adv"].astype(np.float64), d["mask"], d["seg"], d["n_tokens"]
  el, eh = o.eps_clip, (o.eps_clip_high or o.eps_clip)
  loss, grad = 0.0, np.zeros_like(logp)
  m = dict(clip=0.0, dual=0.0, wsum=0.0, wmax=0.0, capped=0.0, kl=0.0)
  for r in range(B):
    for s in set(seg[r][mask[r] > 0].tolist()):
      toks = [t for t in range(L) if seg[r, t] == s and mask[r, t] > 0]
      log_ratio_seq = np.mean([logp[r, t] - old[r, t] for t in toks])
      log_w_seq = np.mean([old[r, t] - behav[r, t] for t in toks])
      # dL/d(ratio) per token, then chained to logp.
      dl_dratio = {}
      for t in toks:
        lr = log_ratio_seq if o.seq_level_ratio else logp[r, t] - old[r, t]
        ratio, a = np.exp(lr), adv[r, t]
        s1, s2 = -a * ratio, -a * np.clip(ratio, 1 - el, 1 + eh)
        per, d_per = (s1, -a) if s1 >= s2 else (s2, 0.0)
        m["clip"] += float(s2 > s1)
        if o.dual_clip and a < 0 and per > o.dual_clip * abs(a):
          per, d_per = o.dual_clip * abs(a), 0.0
          m["dual"] += 1.0
        w, capped = 1.0, 0.0
        w_raw = np.exp(old[r, t] - behav[r, t])
        m["wsum"] += w_raw
        m["wmax"] = max(m["wmax"], w_raw)
        if o.use_decoupled_loss:
          w = np.exp(log_w_seq) if o.behav_imp_weight_level == "sequence" else w_raw
          if o.behav_imp_weight_cap and w > o.behav_imp_weight_cap:
            if o.behav_imp_weight_mode == "mask":
              w, capped = 0.0, 1.0
            else:
              w = o.behav_imp_weight_cap
        m["capped"] += capped
        loss += w * per / n
        dl_dratio[t] = (w * d_per / n, ratio)
        if o.kl_coef:
          dk = d["ref"][r, t] - logp[r, t]
          loss += o.kl_coef * (np.exp(dk) - dk - 1) / n
          grad[r, t] += o.kl_coef * (1 - np.exp(dk)) / n
        x = logp[r, t] - old[r, t]
        m["kl"] += np.exp(x) - 1 - x
      for t in toks:
        if o.seq_level_ratio:  # every token's ratio depends on every logp of the sequence
          grad[r, t] += sum(g * ratio for g, ratio in dl_dratio.values()) / len(toks)
        else:
          g, ratio = dl_dratio[t]
          grad[r, t] += g * ratio
  return loss, grad, m


def option_grid():
  caps = [dict(use_decoupled_loss=False)]
  for level in ("token", "sequence"):
    caps.append(dict(behav_imp_weight_level=level))
    for mode in ("mask", "clamp"):
      caps.append(dict(behav_imp_weight_cap=1.5, behav_imp_weight_mode=mode,
                       behav_imp_weight_level=level))
  for cap, gspo, dual, high, kl in itertools.product(caps, (False, True), (0.0, 1.3), (0.0, 0.28),
                                                     (0.0, 0.1)):
    yield dict(cap, seq_level_ratio=gspo, dual_clip=dual, eps_clip_high=high, kl_coef=kl)


GRID = list(option_grid())


@pytest.mark.parametrize("kw", GRID, ids=[",".join(f"{k}={v}" for k, v in g.items()) for g in GRID])
def test_loss_and_gradient_match_numpy(kw):
  opts = make_opts(**kw)
  for seed in (GRID.index(kw) % 3,):
    d = random_batch(seed)
    want_loss, want_grad, want_m = reference(d, opts)

    def f(logp):
      return loss_lib.ppo_loss(logp, d["old"], d["behav"], d["adv"], d["mask"], d["seg"],
                               jnp.float32(d["n_tokens"]), opts, ref_logp=d["ref"])

    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"]))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)
    n = d["n_tokens"]
    np.testing.assert_allclose(float(m["clip_frac"]), want_m["clip"] / n, atol=1e-6)
    np.testing.assert_allclose(float(m["dual_clip_frac"]), want_m["dual"] / n, atol=1e-6)
    np.testing.assert_allclose(float(m["behav_weight_mean"]), want_m["wsum"] / n, rtol=1e-5)
    np.testing.assert_allclose(float(m["behav_weight_max"]), want_m["wmax"], rtol=1e-5)
    np.testing.assert_allclose(float(m["cap_masked_frac"]), want_m["capped"] / n, atol=1e-6)
    np.testing.assert_allclose(float(m["approx_kl"]), want_m["kl"] / n, rtol=1e-4, atol=1e-7)


def test_grid_exercises_every_branch():
  """The random inputs hit clipping on both sides, the dual clip and the cap."""
  d = random_batch(0)
  on = d["mask"] > 0
  ratio = np.exp(d["logp"] - d["old"])[on]
  w = np.exp(d["old"] - d["behav"])[on]
  adv = d["adv"][on]
  assert np.any(ratio > 1.28) and np.any(ratio < 0.8)
  assert np.any((adv < 0) & (ratio > 1.3))
  assert np.any(w > 1.5) and np.any(w < 1.5)


def test_decoupled_weight_applies_without_cap():
  """No cap configured still weights by pi_prox / pi_behav (the weight is part of the objective)."""
  d = random_batch(1)
  args = (d["logp"], d["old"], d["behav"], d["adv"], d["mask"], d["seg"], d["n_tokens"])
  on, _ = loss_lib.ppo_loss(*args, make_opts(behav_imp_weight_cap=0.0))
  off, _ = loss_lib.ppo_loss(*args, make_opts(use_decoupled_loss=False))
  assert abs(float(on) - float(off)) > 1e-4


def test_padding_garbage_does_not_leak():
  """Huge or NaN values outside the mask change neither the loss nor its gradient."""
  d = random_batch(2)
  opts = make_opts(behav_imp_weight_cap=2.0, seq_level_ratio=True, kl_coef=0.1)
  args = lambda d: (d["old"], d["behav"], d["adv"], d["mask"], d["seg"], d["n_tokens"], opts)

  def f(d, logp):
    return loss_lib.ppo_loss(logp, *args(d), ref_logp=d["ref"])[0]

  base = jax.value_and_grad(lambda x: f(d, x))(jnp.asarray(d["logp"]))
  bad = dict(d)
  off = d["mask"] == 0
  for k, v in (("old", -1e30), ("behav", np.nan), ("ref", 1e30)):
    bad[k] = np.where(off, v, d[k]).astype(np.float32)
  logp_bad = np.where(off, 80.0, d["logp"]).astype(np.float32)
  got = jax.value_and_grad(lambda x: f(bad, x))(jnp.asarray(logp_bad))
  np.testing.assert_allclose(float(got[0]), float(base[0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(base[1]), rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_alignment_and_gradient(temperature):
  """Position t scores token t+1 under softmax(logits / T); the gradient is (onehot - p) / T."""
  rng = np.random.default_rng(0)
  v = 7
  logits = rng.normal(0, 2, (2, 5, v)).astype(np.float32)
  tokens = rng.integers(0, v, (2, 5)).astype(np.int32)
  logp, ent = loss_lib.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), temperature)
  z = logits.astype(np.float64) / temperature
  logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  p = np.exp(logsm)
  want = np.zeros((2, 5))
  want[:, :-1] = np.take_along_axis(logsm[:, :-1], tokens[:, 1:, None], -1)[..., 0]
  want_ent = np.zeros((2, 5))
  want_ent[:, :-1] = -(p * logsm).sum(-1)[:, :-1]
  np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda x: loss_lib.token_logprobs(x, jnp.asarray(tokens), temperature)[0][0, 2])(
      jnp.asarray(logits))
  want_g = np.zeros_like(logits, np.float64)
  want_g[0, 2] = -p[0, 2] / temperature
  want_g[0, 2, tokens[0, 3]] += 1.0 / temperature
  np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-5, atol=1e-6)
  # the entropy's gradient too: dH/dz = p (E_p[z] - z), z = logits / T
  g_ent = jax.grad(lambda x: loss_lib.token_logprobs(x, jnp.asarray(tokens), temperature)[1][1, 3])(
      jnp.asarray(logits))
  want_ent_g = np.zeros_like(logits, np.float64)
  want_ent_g[1, 3] = p[1, 3] * ((p[1, 3] * z[1, 3]).sum() - z[1, 3]) / temperature
  np.testing.assert_allclose(np.asarray(g_ent), want_ent_g, rtol=1e-5, atol=1e-6)


def test_seq_mean_stays_inside_a_row_segment():
  x = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
  mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
  seg = jnp.asarray([[1, 1, 2, 0], [1, 1, 1, 2]])  # segment 1 of row 0 and of row 1 differ
  got = np.asarray(loss_lib.seq_mean(x, mask, seg))
  np.testing.assert_allclose(got[0, :3], [1.5, 1.5, 3.0])
  np.testing.assert_allclose(got[1], [5.5, 5.5, 5.5, 8.0])
