"""Every decode attention form (the CPU kernel, XLA's chunked loops, the dense read, the Pallas GPU
kernel in interpret mode) against a NumPy reference: one query per row over positions 0..pos."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels import attention, choice, pallas_attention


def _reference(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B):
  b = q_BxKxGxD.shape[0]
  out = np.zeros(q_BxKxGxD.shape, np.float64)
  for i in range(b):
    k, v = k_RxTxKxD[i, :pos_B[i] + 1], v_RxTxKxD[i, :pos_B[i] + 1]  # [P, K, D]
    s = np.einsum("kgd,pkd->kgp", q_BxKxGxD[i], k)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[i] = np.einsum("kgp,pkd->kgd", p / p.sum(-1, keepdims=True), v)
  return out


@pytest.mark.parametrize("impl", choice.ATTENTION)
def test_every_form_equals_the_reference(impl):
  rng = np.random.default_rng(0)
  b, rows, t, kv, g, d = 5, 8, 64, 2, 3, 16  # more cache rows than queries: rows [0, b) are read
  q = rng.normal(size=(b, kv, g, d)).astype(np.float32) * d**-0.5
  k, v = (rng.normal(size=(rows, t, kv, d)).astype(np.float32) for _ in range(2))
  k[:, 40:] += 100.0  # positions past every row's length would dominate if they were read
  pos = np.asarray([0, 39, 17, 3, 39], np.int32)
  fn = jax.jit(lambda q, k, v, pos: attention.decode_attention(q, k, v, pos, 48, impl))
  out = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos))
  assert out.shape == q.shape and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, pos), atol=1e-5, rtol=1e-5)


def test_pallas_runs_the_kernel_where_the_bound_splits_and_dense_elsewhere(monkeypatch):
  assert pallas_attention._split(512) == (16, 32) and pallas_attention._split(48) == (1, 16)
  assert pallas_attention._split(40) is None  # no split into pieces of 16 positions
  calls = []
  gqa = pallas_attention.pallas_decode.gqa
  monkeypatch.setattr(pallas_attention.pallas_decode, "gqa",
                      lambda *a, **kw: calls.append(kw) or gqa(*a, **kw))
  q, k = jnp.zeros((2, 1, 2, 16)), jnp.zeros((2, 40, 1, 16))
  for t in (40, 32):
    jax.jit(lambda q, k: attention.decode_attention(q, k, k, jnp.zeros(2, jnp.int32), t,
                                                    "pallas_gpu")).lower(q, k)
  assert [c["k_splits"] for c in calls] == [2] and calls[0]["interpret"]  # t=32 only


@pytest.mark.parametrize("form", ["rows", "heads_major", "paged"])
def test_query_groups_padded_for_the_gpu_library_give_the_same_attention(form):
  """Inside ``choice.matmuls("blas")`` the dense read pads each head's 3 queries to 8 (zero
  queries, their rows dropped) over a 16-bit cache: the same outputs as without the padding, for
  the positions-first, heads-major and paged caches; outside it, or over a float32 cache, no
  padding (``choice.query_rows``)."""
  rng = np.random.default_rng(1)
  b, t, kv, g, d = 4, 32, 2, 3, 16
  q = jnp.asarray(rng.normal(size=(b, kv, g, d)).astype(np.float32) * d**-0.5)
  k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray([0, 31, 9, 20], jnp.int32)
  if form == "rows":
    run = lambda: attention.decode_attention(q, k, v, pos, t, "dense")  # noqa: E731
  elif form == "heads_major":
    k_h, v_h = (jnp.swapaxes(x, 1, 2) for x in (k, v))
    run = lambda: attention.decode_attention_heads_major(q, k_h, v_h, pos, t, "dense")  # noqa: E731
  else:  # one layer's pool of 4 pages of 8 positions per row, the trash page last: [K, 1, M, P, D]
    pool_k, pool_v = (jnp.concatenate([jnp.moveaxis(x.reshape(b * 4, 8, kv, d), 2, 0)[:, None],
                                       jnp.zeros((kv, 1, 1, 8, d), x.dtype)], axis=2)
                      for x in (k, v))
    table = jnp.arange(b * 4, dtype=jnp.int32).reshape(b, 4)
    run = lambda: attention.decode_attention_paged(  # noqa: E731
        q, pool_k, pool_v, 0, table, pos, t, "dense")
  seen = []
  pad = jnp.pad
  def spy(x, widths, *a, **kw):
    seen.append((x.shape, widths))
    return pad(x, widths, *a, **kw)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(jnp, "pad", spy)
    plain = jax.jit(lambda: run())()  # (a new function each: traced under the context here)
    assert not seen and choice.query_rows(jnp.bfloat16) == 1
    with choice.matmuls("blas"):
      assert choice.query_rows(jnp.bfloat16) == 8 and choice.query_rows(jnp.float32) == 1
      padded = jax.jit(lambda: run())()
    assert seen == [((b, kv, g, d), ((0, 0), (0, 0), (0, 5), (0, 0)))]
    with choice.matmuls("xla"):
      assert choice.query_rows(jnp.bfloat16) == 1
    mp.setenv(choice.QUERY_ROWS_ENV, "4")  # forced (a benchmark's A/B), whatever the matmuls
    assert choice.query_rows(jnp.float32) == 4
    mp.setenv(choice.QUERY_ROWS_ENV, "0")
    with pytest.raises(ValueError, match="AREAL_JAX_DECODE_QUERY_ROWS='0'"):
      choice.query_rows(jnp.bfloat16)
  assert padded.shape == plain.shape == (b, kv, g, d)
  np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), atol=1e-6, rtol=1e-6)
  ref = _reference(np.asarray(q), np.asarray(k, np.float32), np.asarray(v, np.float32),
                   np.asarray(pos))
  np.testing.assert_allclose(np.asarray(padded), ref, atol=2e-2)  # (bfloat16 operands)
