"""Logical-axis sharding helpers."""

import jax

from areal_jax import sharding


def test_num_shards_follows_the_active_mesh_and_rules():
  assert sharding.num_shards("cache_batch", 8) == 1  # no mesh active
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
  with sharding.use(mesh):
    assert sharding.num_shards("cache_batch", 8) == 4  # data x fsdp
    assert sharding.num_shards("cache_batch", 6) == 1  # not divisible: replicated
    assert sharding.num_shards("cache_heads", 4) == 2
    assert sharding.num_shards("length", 8) == 1
