"""The attention forms and RoPE (``models/attention_forms.py``): exact rotary tables, blocked
causal attention and XLA's decode loop against the dense form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels import choice, cpu_attention
from areal_jax.models import attention_forms


def test_rope_tables_are_the_exact_cosines_and_sines():
  """The product with the identity that makes XLA keep the tables in a buffer (on CPU) changes no
  bit."""

  def direct(positions_BxL):
    inv_freq = 1.0 / (1e5 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))
    angles_BxLxF = positions_BxL[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles_BxLxF), jnp.sin(angles_BxLxF)

  positions_BxL = jnp.asarray([[0, 1, 7, 4095], [3, 100, 2000, 65535]], jnp.int32)
  cos, sin = jax.jit(attention_forms.rope_tables, static_argnums=(1, 2))(positions_BxL, 64, 1e5)
  want_cos, want_sin = jax.jit(direct)(positions_BxL)
  assert cos.shape == sin.shape == (2, 4, 32)
  np.testing.assert_array_equal(cos, want_cos)
  np.testing.assert_array_equal(sin, want_sin)
  # traced for a GPU (or a TPU) the tables are left to XLA: the same values, no product
  assert choice.rope_tables_materialized()  # (this CPU)
  with choice.lowering_for("gpu"):
    assert not choice.rope_tables_materialized()
    fn = jax.jit(lambda p: attention_forms.rope_tables(p, 64, 1e5))  # (a fresh trace)
    assert "dot_general" not in str(fn.trace(positions_BxL).jaxpr)
    cos, sin = fn(positions_BxL)
  np.testing.assert_array_equal(cos, want_cos)
  np.testing.assert_array_equal(sin, want_sin)


@pytest.mark.parametrize("max_blocks", [16, 2], ids=["blocks-of-4", "at-most-2-blocks"])
@pytest.mark.slow
def test_causal_attention_equals_dense_attention(max_blocks, monkeypatch):
  """Blocked causal attention (blocks of 4, a ragged last block; or capped at 2 blocks, of 8) =
  the dense form, values and gradients, on every position that attends to something (packed
  segments, padding at the end)."""
  monkeypatch.setattr(attention_forms, "CAUSAL_BLOCKS", max_blocks)
  rng = np.random.RandomState(0)
  b, l, h, kv, d = 2, 11, 4, 2, 8
  q, k, v = (jnp.asarray(rng.randn(b, l, n, d), jnp.float32) for n in (h, kv, kv))
  seg = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 2, [1] * 11])
  mask = jnp.tril(jnp.ones((l, l), bool))[None] & (seg[:, :, None] == seg[:, None, :]) \
      & (seg[:, None, :] > 0)
  w = jnp.asarray(rng.randn(b, l, h, d), jnp.float32) * (seg > 0)[:, :, None, None]

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * w)

  dense = lambda q, k, v: attention_forms.attention(q, k, v, mask)
  blocked = lambda q, k, v: attention_forms.causal_attention(q, k, v, mask, block=4)
  # values and gradients of each form as one program (op by op, each op would compile alone)
  both = jax.jit(lambda fn, q, k, v: (fn(q, k, v), jax.grad(loss, (1, 2, 3))(fn, q, k, v)),
                 static_argnums=0)
  (out_blocked, grads_blocked), (out_dense, grads_dense) = (both(blocked, q, k, v),
                                                            both(dense, q, k, v))
  real = np.asarray(seg > 0)
  np.testing.assert_allclose(np.asarray(out_blocked)[real], np.asarray(out_dense)[real], atol=1e-6)
  for g_blocked, g_dense in zip(grads_blocked, grads_dense):
    np.testing.assert_allclose(g_blocked, g_dense, atol=1e-5)


@pytest.mark.parametrize("group", [64, 4, 3], ids=["one-group", "groups", "ragged-groups"])
def test_decode_attention_equals_dense_attention(group):
  """XLA's decode loop (chunks of 5 over 23 positions: the last chunk overlaps) = dense attention
  over each row's positions 0..pos, rows at very different positions, sorted into groups or not;
  cache rows beyond the queries' rows are ignored. (The CPU kernel: test_cpu_attention.py.)"""
  rng = np.random.RandomState(1)
  b, t, h, kv, d = 10, 23, 4, 2, 8
  q = jnp.asarray(rng.randn(b, 1, h, d), jnp.float32)
  k, v = (jnp.asarray(rng.randn(b + 2, t, kv, d), jnp.float32) for _ in range(2))
  fn = jax.jit(lambda q, k, v, pos: attention_forms.decode_attention(q, k, v, pos, t, chunk=5,
                                                                  group=group))
  # spread positions (the groups skip chunks), then alike ones (one loop is as good)
  positions = ([22, 0, 3, 17, 9, 1, 22, 4, 12, 6], [20, 21, 19, 22, 20, 21, 22, 20, 19, 21])
  @jax.jit
  def dense(q, k, v, pos):
    mask = (jnp.arange(t)[None, :] <= pos[:, None])[:, None]  # [B, 1, T]
    return attention_forms.attention(q, k[:b], v[:b], mask)

  with cpu_attention.disabled():  # traced here: XLA's form
    assert cpu_attention.TARGET not in fn.lower(q, k, v, jnp.zeros(b, jnp.int32)).as_text()
    for pos in positions:
      pos = jnp.asarray(pos, jnp.int32)
      np.testing.assert_allclose(fn(q, k, v, pos), dense(q, k, v, pos), atol=1e-5)
