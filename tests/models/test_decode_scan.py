"""Layers in a scan (``decode_scan``): the same logits and cache as the unrolled
``Transformer.extend``, and a compiled program whose size does not grow with depth."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import decode_scan, init_cache
from areal_jax.models.transformer import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64)


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("impl", ["xla", "dense", "pallas_gpu"])
@pytest.mark.slow
def test_scanned_extend_equals_unrolled(arch, impl):
  """Prefill then three decode steps (slots at different positions, a cache with spare rows):
  logits and every cache entry equal the unrolled model's."""
  cfg = dataclasses.replace(CFG, arch=arch, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                            tie_embeddings=arch == "llama")
  model = Transformer(cfg, nnx.Rngs(1))
  if cfg.qkv_bias:  # nonzero biases
    for layer in model.layers:
      layer.attn.k_bias[...] = jnp.linspace(-0.5, 0.5, layer.attn.k_bias.shape[0])
  if cfg.qk_norm:  # non-trivial per-layer norm scales
    for i, layer in enumerate(model.layers):
      layer.attn.k_norm.scale[...] = jnp.linspace(0.5, 1.5 + i, cfg.head_dim)
  graph, stacked = decode_scan.graphs(cfg), decode_scan.stack_layers(_params(model))
  scanned = jax.jit(lambda p, t, s, c, kv: decode_scan.extend(graph, p, t, s, c, 32, impl)
                    if t.shape[1] == 1 else decode_scan.extend(graph, p, t, s, c, 16))
  unrolled = nnx.jit(lambda m, t, s, c: m.extend(t, s, c, 32 if t.shape[1] == 1 else 16, impl))
  rng = np.random.RandomState(0)
  prompt = jnp.asarray(rng.randint(0, cfg.vocab_size, (3, 16)), jnp.int32)
  cache_s, cache_u = decode_scan.init_cache(cfg, 4, 32), init_cache(cfg, 4, 32)
  start = jnp.zeros((3,), jnp.int32)
  # prefill writes rows [0, 3) of a 4-row cache: the unrolled path needs as many rows as tokens
  lg_s, cache_s = scanned(stacked, prompt, start, cache_s, 0)
  lg_u, cache_u3 = unrolled(model, prompt, start, init_cache(cfg, 3, 32))
  cache_u = [{n: cu[n].at[:3].set(c3[n]) for n in ("k", "v")} for cu, c3 in zip(cache_u, cache_u3)]
  np.testing.assert_allclose(lg_s, lg_u, atol=1e-5)
  pos = jnp.asarray([15, 9, 4], jnp.int32)  # rows continue at different positions
  for step in range(3):
    tok = jnp.asarray(rng.randint(0, cfg.vocab_size, (3, 1)), jnp.int32)
    lg_s, cache_s = scanned(stacked, tok, pos + step, cache_s, 0)
    lg_u, cache_u = unrolled(model, tok, pos + step, cache_u)
    np.testing.assert_allclose(lg_s, lg_u, atol=1e-5)
  for n, stacked_u in decode_scan.stack_cache(cache_u).items():
    np.testing.assert_allclose(cache_s[n], stacked_u, atol=1e-5)


def test_stacking_and_shardings():
  model = Transformer(CFG, nnx.Rngs(0))
  params = _params(model)
  stacked = decode_scan.stack_layers(params)
  assert stacked["layers"]["mlp"]["up"].shape == (3, 32, 64)
  np.testing.assert_array_equal(stacked["layers"]["attn"]["q"][2], params["layers"][2]["attn"]["q"])
  assert stacked["embed"] is params["embed"]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
  shard = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  sh = {"embed": shard(), "layers": {i: {"w": shard(None, "tensor")} for i in range(3)}}
  spec = decode_scan.stacked_shardings(sh)["layers"]["w"].spec
  assert spec == jax.sharding.PartitionSpec(None, None, "tensor")


def _decode_hlo(n_layers: int, scan: bool) -> str:
  """HLO text of a jitted one-token decode step of an ``n_layers`` model (before optimization)."""
  cfg = dataclasses.replace(CFG, n_layers=n_layers)
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  params = _params(model)
  tok, pos = jnp.zeros((4, 1), jnp.int32), jnp.zeros((4,), jnp.int32)
  if scan:
    graph = decode_scan.graphs(cfg)
    cache = jax.eval_shape(lambda: decode_scan.init_cache(cfg, 4, 64))
    fn = jax.jit(lambda p, c: decode_scan.extend(graph, p, tok, pos, c, 64, "dense"))
    return fn.lower(jax.eval_shape(decode_scan.stack_layers, params), cache).as_text()
  graphdef = nnx.graphdef(model)
  cache = jax.eval_shape(lambda: init_cache(cfg, 4, 64))
  fn = jax.jit(lambda p, c: nnx.merge(graphdef, p).extend(tok, pos, c, 64, "dense"))
  return fn.lower(params, cache).as_text()


def test_compiled_decode_is_flat_in_depth():
  """2 vs 8 layers: the scanned step's program grows by a few percent (shapes only), the unrolled
  one about 4x (one body per layer)."""
  scan_ratio = len(_decode_hlo(8, True)) / len(_decode_hlo(2, True))
  unrolled_ratio = len(_decode_hlo(8, False)) / len(_decode_hlo(2, False))
  assert scan_ratio < 1.1, scan_ratio
  assert unrolled_ratio > 2.5, unrolled_ratio
