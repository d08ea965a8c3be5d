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
