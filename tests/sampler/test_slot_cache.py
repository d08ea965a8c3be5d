"""The slot cache's two layouts hold the same thing: prefix writes, moves and prefix rows on the
stacked cache equal the per-layer ones stacked; padding slots (index = slot count) are dropped."""

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import ModelConfig, decode_scan
from areal_jax.sampler import slot_cache

CFG = ModelConfig(n_layers=3, n_kv_heads=2, head_dim=4)


_stack = decode_scan.stack_cache  # [rows, T, Hkv, D] per layer -> [layers, rows, Hkv, T, D]


def test_layouts_agree():
  rng = np.random.RandomState(0)
  per_layer = [{n: jnp.asarray(rng.randn(5, 8, 2, 4), jnp.float32) for n in ("k", "v")}
               for _ in range(3)]
  stacked = _stack(per_layer)
  prefix = [{n: jnp.asarray(rng.randn(1, 3, 2, 4), jnp.float32) for n in ("k", "v")}
            for _ in range(3)]
  assert slot_cache.prefix_len(prefix, False) == slot_cache.prefix_len(_stack(prefix), True) == 3
  slots_N = jnp.asarray([1, 4, 5, 5], jnp.int32)  # 5 = padding: dropped
  a = slot_cache.write_prefix(per_layer, prefix, slots_N, 3, False)
  b = slot_cache.write_prefix(stacked, _stack(prefix), slots_N, 3, True)
  jax.tree.map(np.testing.assert_array_equal, _stack(a), b)
  prefix_k = _stack(prefix)["k"][:, 0]
  np.testing.assert_array_equal(b["k"][:, 4, :, :3], prefix_k)
  np.testing.assert_array_equal(b["k"][:, 0], stacked["k"][:, 0])  # untouched slot
  src, dst = jnp.asarray([4, 5], jnp.int32), jnp.asarray([0, 5], jnp.int32)
  a, b = slot_cache.move(a, src, dst, False), slot_cache.move(b, src, dst, True)
  jax.tree.map(np.testing.assert_array_equal, _stack(a), b)
  np.testing.assert_array_equal(b["k"][:, 0, :, :3], prefix_k)
  jax.tree.map(np.testing.assert_array_equal, _stack(slot_cache.row(a, 0, False)),
               slot_cache.row(b, 0, True))
  assert slot_cache.make(CFG, 5, 8, jnp.float32, True)["k"].shape == (3, 5, 2, 8, 4)
  assert len(slot_cache.make(CFG, 5, 8, jnp.float32, False)) == 3
