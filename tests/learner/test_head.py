"""The chunked LM head: logprobs, entropy and every gradient equal the full-logits computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.learner import head, loss as loss_lib
from areal_jax.models.transformer import linear


def test_chunk_len():
  assert head.chunk_len(96, 4, 0) == 96
  assert head.chunk_len(96, 4, 128) == 32
  assert head.chunk_len(96, 4, 100) == 24  # largest divisor of 96 <= 25
  assert head.chunk_len(96, 200, 100) == 1
  assert head.chunk_len(96, 1, 10**6) == 96


@pytest.mark.parametrize("transpose_w,chunk", [(True, 24), (False, 40), (True, 1)])
def test_chunked_equals_full_with_gradients(transpose_w, chunk):
  b, l, e, v, t = 2, 24, 16, 50, 0.7
  k = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(k[0], (b, l, e))
  w = jax.random.normal(k[1], (v, e) if transpose_w else (e, v)) * 0.3
  tokens = jax.random.randint(k[2], (b, l), 0, v)
  g_logp, g_ent = jax.random.normal(k[3], (2, b, l))

  def full(h, w):
    return loss_lib.token_logprobs(linear(h, w, transpose_w, jnp.float32), tokens, t)

  def chunked(h, w):
    return head.token_logprobs(h, w, transpose_w, tokens, t, chunk)

  obj = lambda f: lambda h, w: jnp.sum(f(h, w)[0] * g_logp) + jnp.sum(f(h, w)[1] * g_ent)
  ref, out = jax.jit(full)(h, w), jax.jit(chunked)(h, w)
  assert head.chunk_len(l, b, chunk) < l  # the chunked path really runs
  for a, r in zip(out, ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
  gref = jax.jit(jax.grad(obj(full), argnums=(0, 1)))(h, w)
  gout = jax.jit(jax.grad(obj(chunked), argnums=(0, 1)))(h, w)
  for a, r in zip(gout, gref):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)
