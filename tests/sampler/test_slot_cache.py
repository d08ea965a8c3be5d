"""The slot cache's three layouts hold the same thing: prefix writes, moves and prefix rows on the
stacked cache and on the heads-major per-layer one equal the positions-first per-layer ones in
their order; padding slots (index = slot count) are dropped."""

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import ModelConfig, decode_scan
from areal_jax.sampler import slot_cache
from areal_jax.sampler.slot_cache import HEADS, ROWS, STACKED

CFG = ModelConfig(n_layers=3, n_kv_heads=2, head_dim=4)


_stack = decode_scan.stack_cache  # [rows, T, Hkv, D] per layer -> [layers, rows, Hkv, T, D]


def _heads(per_layer):  # [rows, T, Hkv, D] per layer -> [rows, Hkv, T, D] per layer
  return [{n: jnp.swapaxes(x, 1, 2) for n, x in layer.items()} for layer in per_layer]


def test_layouts_agree():
  rng = np.random.RandomState(0)
  per_layer = [{n: jnp.asarray(rng.randn(5, 8, 2, 4), jnp.float32) for n in ("k", "v")}
               for _ in range(3)]
  stacked, heads = _stack(per_layer), _heads(per_layer)
  prefix = [{n: jnp.asarray(rng.randn(1, 3, 2, 4), jnp.float32) for n in ("k", "v")}
            for _ in range(3)]
  assert (slot_cache.prefix_len(prefix, ROWS) == slot_cache.prefix_len(_stack(prefix), STACKED)
          == slot_cache.prefix_len(_heads(prefix), HEADS) == 3)
  slots_N = jnp.asarray([1, 4, 5, 5], jnp.int32)  # 5 = padding: dropped
  a = slot_cache.write_prefix(per_layer, prefix, slots_N, 3, ROWS)
  b = slot_cache.write_prefix(stacked, _stack(prefix), slots_N, 3, STACKED)
  c = slot_cache.write_prefix(heads, _heads(prefix), slots_N, 3, HEADS)
  jax.tree.map(np.testing.assert_array_equal, _stack(a), b)
  jax.tree.map(np.testing.assert_array_equal, _heads(a), c)
  prefix_k = _stack(prefix)["k"][:, 0]
  np.testing.assert_array_equal(b["k"][:, 4, :, :3], prefix_k)
  np.testing.assert_array_equal(b["k"][:, 0], stacked["k"][:, 0])  # untouched slot
  src, dst = jnp.asarray([4, 5], jnp.int32), jnp.asarray([0, 5], jnp.int32)
  a, b, c = (slot_cache.move(x, src, dst, layout) for x, layout in
             ((a, ROWS), (b, STACKED), (c, HEADS)))
  jax.tree.map(np.testing.assert_array_equal, _stack(a), b)
  jax.tree.map(np.testing.assert_array_equal, _heads(a), c)
  np.testing.assert_array_equal(b["k"][:, 0, :, :3], prefix_k)
  jax.tree.map(np.testing.assert_array_equal, _stack(slot_cache.row(a, 0, ROWS)),
               slot_cache.row(b, 0, STACKED))
  jax.tree.map(np.testing.assert_array_equal, _heads(slot_cache.row(a, 0, ROWS)),
               slot_cache.row(c, 0, HEADS))
  assert slot_cache.make(CFG, 5, 8, jnp.float32, STACKED)["k"].shape == (3, 5, 2, 8, 4)
  assert [x["k"].shape for x in slot_cache.make(CFG, 5, 8, jnp.float32, ROWS)] == [(5, 8, 2, 4)] * 3
  assert [x["k"].shape for x in slot_cache.make(CFG, 5, 8, jnp.float32, HEADS)] == [(5, 2, 8, 4)] * 3
