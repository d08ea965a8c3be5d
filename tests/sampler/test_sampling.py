"""Per-slot sampling: logprob convention, greedy, top-k, top-p, seeds, distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.sampler import sampling


_sample = jax.jit(sampling.sample, static_argnames=("select_by_mask", "truncate"))


def _run(logits_SxV, temperature=1.0, top_k=0, top_p=1.0, greedy=False, seed=0, pos=0,
         select_by_mask=False, truncate=None):
  """``sampling.sample`` compiled; each parameter a scalar for every slot or a per-slot list
  (made on the host: no op compiled for them)."""
  s = logits_SxV.shape[0]
  keys = sampling.slot_keys(seed, s)
  full = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (s,))  # noqa: E731
  return _sample(logits_SxV, keys, full(pos, np.int32), full(temperature, np.float32),
                 full(top_k, np.int32), full(top_p, np.float32), full(greedy, np.bool_),
                 select_by_mask=select_by_mask, truncate=truncate)


def test_logprob_is_temperature_scaled_softmax_before_truncation():
  logits = jax.random.normal(jax.random.key(0), (16, 50)) * 3
  for kwargs in ({"temperature": 0.7}, {"temperature": 1.3, "top_k": 5}, {"top_p": 0.5},
                 {"greedy": True, "temperature": 0.9}):
    tok, lp = _run(logits, **kwargs)
    ref = jax.nn.log_softmax(logits / kwargs.get("temperature", 1.0), axis=-1)
    np.testing.assert_allclose(lp, ref[jnp.arange(16), tok], atol=1e-5)


def test_greedy_and_degenerate_truncation_pick_argmax():
  logits = jax.random.normal(jax.random.key(1), (32, 100))
  argmax = np.asarray(jnp.argmax(logits, -1))
  np.testing.assert_array_equal(_run(logits, greedy=True)[0], argmax)
  np.testing.assert_array_equal(_run(logits, top_k=1)[0], argmax)
  np.testing.assert_array_equal(_run(logits, top_p=1e-6)[0], argmax)
  tied = jnp.zeros((3, 100)).at[0, [7, 40]].set(5.0).at[1, [99, 3]].set(2.0)  # row 2: all tied
  np.testing.assert_array_equal(_run(tied, greedy=True)[0], [7, 3, 0])  # the first maximum


def test_top_k_and_top_p_stay_inside_their_sets():
  logits = jnp.tile(jax.random.normal(jax.random.key(2), (1, 40)) * 2, (512, 1))
  order = np.argsort(-np.asarray(logits[0]))
  tok, _ = _run(logits, top_k=4)
  assert set(np.asarray(tok)) <= set(order[:4]) and len(set(np.asarray(tok))) == 4
  probs = np.asarray(jax.nn.softmax(logits[0]))[order]
  n_keep = int(np.searchsorted(np.cumsum(probs), 0.6) + 1)
  tok, _ = _run(logits, top_p=0.6)
  assert set(np.asarray(tok)) <= set(order[:n_keep])


def test_frequencies_follow_the_scaled_distribution():
  logits = jnp.tile(jnp.array([[2.0, 1.0, 0.0, -1.0, 0.5]]), (4096, 1))
  tok, _ = _run(logits, temperature=0.8, seed=3)
  freq = np.bincount(np.asarray(tok), minlength=5) / 4096
  expected = np.asarray(jax.nn.softmax(logits[0] / 0.8))
  np.testing.assert_allclose(freq, expected, atol=0.03)


def test_draws_depend_on_seed_index_and_position_only():
  logits = jnp.zeros((64, 1000))
  a, _ = _run(logits, seed=1, pos=5)
  b, _ = _run(logits, seed=1, pos=5)
  c, _ = _run(logits, seed=1, pos=6)
  d, _ = _run(logits, seed=2, pos=5)
  np.testing.assert_array_equal(a, b)
  assert (np.asarray(a) != np.asarray(c)).mean() > 0.9
  assert (np.asarray(a) != np.asarray(d)).mean() > 0.9
  assert len(set(np.asarray(a))) > 50  # different indices of one request differ
  np.testing.assert_array_equal(sampling.slot_keys(4, 3)[2], sampling.slot_key(4, 2))


def test_blocks_taken_by_mask_draw_the_same_tokens_and_logprobs():
  """``select_by_mask`` (a TPU's form: each slot's block of the vocabulary by a masked sum, not a
  gather) draws bit for bit what the gather does: several blocks (768 = 3 x 256), ties, -inf
  entries, the maximum in a later block, greedy, top-k, top-p and temperatures."""
  logits = jax.random.normal(jax.random.key(7), (64, 768)) * 4
  logits = logits.at[0].set(1.0).at[1, 600].set(50.0).at[2, :300].set(-jnp.inf)
  logits = logits.at[3, [10, 700]].set(30.0).at[4].set(-0.0)
  for kwargs in ({}, {"greedy": True}, {"temperature": 0.6, "top_k": 7},
                 {"temperature": 1.4, "top_p": 0.8}, {"top_k": 1}):
    for seed, pos in ((0, 0), (3, 17), (11, 500)):
      ref = _run(logits, seed=seed, pos=pos, **kwargs)
      got = _run(logits, seed=seed, pos=pos, select_by_mask=True, **kwargs)
      np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]), err_msg=str(kwargs))
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]), err_msg=str(kwargs))
  assert _run(logits, greedy=True, select_by_mask=True)[0][1] == 600


def test_truncation_known_to_the_caller_draws_what_the_branch_draws():
  """``truncate`` given (a program without a branch: the GPU engine's, which knows it on the
  host) draws the tokens and logprobs the in-program branch draws, for slots that truncate
  (top-k, top-p, mixed with slots that do not, greedy ones) and slots that do not; True where
  no slot truncates keeps every token (the same tokens, logprobs to float32 rounding)."""
  logits = jax.random.normal(jax.random.key(8), (32, 768)) * 3
  mixed = {"top_k": [0, 5, 0, 0] * 8, "top_p": [1.0, 1.0, 0.7, 1.0] * 8,
           "greedy": [False] * 3 + [True] + [False] * 28, "temperature": 0.9}
  plain = {"greedy": [True, False] * 16, "top_k": [3, 0] * 16}  # greedy slots' top-k is ignored
  assert sampling.truncates(*(np.asarray(mixed[k]) for k in ("top_k", "top_p", "greedy"))).any()
  assert not sampling.truncates(np.asarray(plain["top_k"]), np.ones(32),
                                np.asarray(plain["greedy"])).any()
  for kwargs, truncate in ((mixed, True), (plain, False)):
    for seed, pos in ((0, 0), (5, 40)):
      ref = _run(logits, seed=seed, pos=pos, **kwargs)
      got = _run(logits, seed=seed, pos=pos, truncate=truncate, **kwargs)
      np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]), err_msg=str(kwargs))
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]), err_msg=str(kwargs))
  ref = _run(logits, seed=2, pos=3, **plain)
  kept = _run(logits, seed=2, pos=3, truncate=True, **plain)
  np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(ref[0]))
  np.testing.assert_allclose(np.asarray(kept[1]), np.asarray(ref[1]), rtol=1e-6)
  # and the program given the answer has no branch left
  args = (logits, sampling.slot_keys(0, 32), jnp.zeros(32, jnp.int32), jnp.ones(32),
          jnp.zeros(32, jnp.int32), jnp.ones(32), jnp.zeros(32, jnp.bool_))
  text = lambda t: jax.jit(sampling.sample, static_argnames="truncate").lower(
      *args, truncate=t).as_text()
  assert "stablehlo.case" in text(None)
  assert "stablehlo.case" not in text(True) and "stablehlo.case" not in text(False)
  assert "stablehlo.sort" in text(True) and "stablehlo.sort" not in text(False)
