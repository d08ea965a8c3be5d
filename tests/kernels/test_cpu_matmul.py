"""The CPU packed-weight matmul: exact against NumPy at awkward shapes, and the sampler's engine packs
its weights on one CPU device only, with the same tokens and logprobs as XLA's matmuls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import sharding
from areal_jax.kernels import cpu_matmul
from areal_jax.models import ModelConfig, Transformer
from areal_jax.sampler import sampling
from areal_jax.sampler.engine import DecodeEngine, EngineConfig

pytestmark = pytest.mark.skipif(not cpu_matmul._has_avx512(), reason="the kernel needs AVX-512")

TINY = ModelConfig(vocab_size=120, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                   d_ff=96)


@pytest.fixture(autouse=True, scope="module")
def _registered():
  """Builds and registers the kernel in this process before any test calls it directly (under
  pytest-xdist a worker may run these tests without the one below; the engine always asks
  ``enabled()`` first)."""
  cpu_matmul.available()


def test_kernel_builds():
  assert cpu_matmul.available(), "the machine has AVX-512 and g++: the kernel must build"


@pytest.mark.parametrize("m,k,n", [(64, 576, 1536), (64, 1536, 576), (1, 7, 12), (5, 40, 24),
                                   (16, 32, 16), (37, 100, 20), (130, 48, 96), (200, 33, 8)])
def test_matmul_matches_numpy(m, k, n):
  """Row counts around the 16-row vectors and 64-row blocks, inner sizes off the 16-float
  transposes, output groups of 6 and of 4 columns, chunks of fewer than 96 columns."""
  rng = np.random.default_rng(m * k + n)
  x = rng.normal(size=(m, k)).astype(np.float32)
  w = rng.normal(size=(k, n)).astype(np.float32)
  wp = cpu_matmul.pack(jnp.asarray(w))
  assert wp.shape == (n // (6 if n % 6 == 0 else 4), k, 6 if n % 6 == 0 else 4)
  y = jax.jit(cpu_matmul.matmul)(jnp.asarray(x[None]), wp)[0]
  np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_transposed_pack_and_rows():
  """A ``[V, E]`` embedding packed as the LM head's weight: ``x @ E.T`` and its rows."""
  rng = np.random.default_rng(0)
  e = rng.normal(size=(120, 48)).astype(np.float32)
  x = rng.normal(size=(3, 48)).astype(np.float32)
  wp = cpu_matmul.pack(jnp.asarray(e), transpose_w=True)
  np.testing.assert_allclose(np.asarray(cpu_matmul.matmul(jnp.asarray(x), wp)), x @ e.T, atol=1e-4)
  tokens = jnp.asarray([[0, 5, 119], [6, 7, 60]])
  np.testing.assert_array_equal(np.asarray(cpu_matmul.take_rows(wp, tokens)), e[np.asarray(tokens)])


def test_packable_marks_matmul_weights():
  tied = nnx.to_pure_dict(nnx.state(Transformer(TINY, nnx.Rngs(0)), nnx.Param))
  which = cpu_matmul.packable(tied)
  assert which["embed"] and which["layers"][0]["attn"]["q"] and which["layers"][1]["mlp"]["down"]
  assert not which["final_norm"]["scale"] and not which["layers"][0]["attn_norm"]["scale"]
  untied = nnx.to_pure_dict(nnx.state(
      Transformer(dataclasses.replace(TINY, tie_embeddings=False), nnx.Rngs(0)), nnx.Param))
  which = cpu_matmul.packable(untied)
  assert which["lm_head"] and not which["embed"]


def _greedy_and_logprobs(eng, prompt, steps=12):
  state = eng.init_state()
  keys = np.stack([np.asarray(sampling.slot_key(3, i)) for i in range(2)])
  state = eng.insert(state, eng.prefill(eng.params, prompt[:-1]), [0, 1], token=[prompt[-1]] * 2,
                     pos=[len(prompt) - 1] * 2, end=[eng.config.max_len] * 2, keys=keys,
                     temperature=0.8, top_k=0, top_p=1.0, greedy=False, stop_ids=[])
  toks, lps = [], []
  for _ in range(steps):
    state, (t, lp, _) = eng.generate(eng.params, state, eng.kv_bucket(eng.config.max_len))
    toks.append(np.asarray(t)[0, :2])
    lps.append(np.asarray(lp)[0, :2])
  return np.stack(toks), np.stack(lps)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.slow
def test_engine_packs_on_one_cpu_device_with_the_same_samples(tie):
  model = Transformer(dataclasses.replace(TINY, tie_embeddings=tie), nnx.Rngs(1))
  config = EngineConfig(num_slots=2, max_len=32, prefill_buckets=(8,))
  packed = DecodeEngine(model, config)
  assert packed.params["layers"][0]["mlp"]["gate"].ndim == 3
  assert packed.params["embed" if tie else "lm_head"].ndim == 3
  with cpu_matmul.disabled():
    plain = DecodeEngine(model, config)
  two = DecodeEngine(model, config, sharding.make_mesh({"data": 2}, jax.devices()[:2]))
  for eng in (plain, two):
    assert eng.params["layers"][0]["mlp"]["gate"].ndim == 2
  prompt = [3, 14, 15, 92, 65, 35]
  toks, lps = _greedy_and_logprobs(packed, prompt)
  ref_toks, ref_lps = _greedy_and_logprobs(plain, prompt)
  np.testing.assert_array_equal(toks, ref_toks)
  np.testing.assert_allclose(lps, ref_lps, atol=1e-5)
  # q/k/v and gate/up fused (forced on CPU), then packed: the same samples
  fused = DecodeEngine(model, dataclasses.replace(config, decode_projections="fused"))
  assert fused.params["layers"][0]["attn"]["qkv"].ndim == 3
  toks, lps = _greedy_and_logprobs(fused, prompt)
  np.testing.assert_array_equal(toks, ref_toks)
  np.testing.assert_allclose(lps, ref_lps, atol=1e-5)
  # A weight swap packs the new version.
  other = nnx.to_pure_dict(nnx.state(Transformer(model.cfg, nnx.Rngs(2)), nnx.Param))
  swapped = packed.put_params(other)
  np.testing.assert_array_equal(
      np.asarray(swapped["layers"][1]["attn"]["o"]),
      np.asarray(cpu_matmul.pack(jnp.asarray(other["layers"][1]["attn"]["o"]))))
