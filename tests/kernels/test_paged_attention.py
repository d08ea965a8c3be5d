"""Decode attention over a paged KV cache (``kernels.paged_attention``): the pages gathered for the
dense read, and JAX's paged TPU and GPU kernels reading them in place (interpret mode on CPU),
against a float64 NumPy reference, with pages shared between rows, a layer other than the first,
and the pool's K/V heads split over a tensor axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import sharding
from areal_jax.kernels import attention

K, L, M, PAGE, D, G = 2, 3, 9, 8, 16, 3  # M: 8 pages + the trash page


def _case():
  rng = np.random.default_rng(1)
  pools = [rng.normal(size=(K, L, M, PAGE, D)).astype(np.float32) for _ in range(2)]
  q = rng.normal(size=(3, K, G, D)).astype(np.float32) * D**-0.5
  # rows 0 and 1 share their first page (a group's prompt), row 2 has its own; unused entries
  # point at the trash page, whose values would dominate if they were read
  table = np.asarray([[0, 1, 2, 8], [0, 3, 8, 8], [4, 5, 6, 7]], np.int32)
  pools[0][:, :, 8] += 100.0
  pos = np.asarray([20, 12, 31], np.int32)
  return q, pools, table, pos


def _reference(q, pools, table, pos, layer):
  out = np.zeros(q.shape)
  for b in range(q.shape[0]):
    k, v = (p[:, layer, table[b]].reshape(K, -1, D)[:, :pos[b] + 1].astype(np.float64)
            for p in pools)
    s = np.einsum("kgd,ktd->kgt", q[b], k)
    w = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum("kgt,ktd->kgd", w / w.sum(-1, keepdims=True), v)
  return out


@pytest.mark.parametrize("impl,dtype", [("dense", jnp.float32), ("xla", jnp.float32),
                                        ("pallas_gpu", jnp.float32), ("pallas_tpu", jnp.bfloat16)])
@pytest.mark.parametrize("split", [False, True])
def test_every_form_reads_each_rows_pages(impl, dtype, split):
  q, pools, table, pos = _case()
  k, v = (jnp.asarray(p, dtype) for p in pools)
  mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2]) if split else None
  if split:
    k, v = (jax.device_put(x, NamedSharding(mesh, P("tensor"))) for x in (k, v))

  def fn(q, k, v, table, pos):
    if mesh is None:
      return attention.decode_attention_paged(q, k, v, 1, table, pos, 32, impl)
    with sharding.use(mesh):
      return attention.decode_attention_paged(q, k, v, 1, table, pos, 32, impl)

  out = jax.jit(fn)(jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(pos))
  ref = _reference(q, [np.asarray(x.astype(jnp.float32)) for x in (k, v)], table, pos, 1)
  np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6)


@pytest.mark.parametrize("env,value,t", [
    ("AREAL_JAX_PALLAS_GPU_BLOCK_PAGES", "3", 72), ("AREAL_JAX_PALLAS_GPU_BLOCK_PAGES", "4", 72),
    ("AREAL_JAX_PALLAS_GPU_PAGED", "parts=4", 72), ("AREAL_JAX_PALLAS_GPU_PAGED", "parts=2", 72),
    ("AREAL_JAX_PALLAS_GPU_PAGED", "bound=1", 32),
    ("AREAL_JAX_PALLAS_GPU_PAGED", "bound=1,parts=3,block_pages=2,warps=4,stages=3", 40)])
def test_the_gpu_kernel_reads_alike_however_it_is_launched(env, value, t, monkeypatch):
  """The Pallas GPU kernel's launch (``choice.pallas_gpu_tuning``): rows of 9 table entries (the
  entries past each row's pages point at the trash page) read 3 pages a block for 3 and 4 (the
  most that divides a part); cut into 4 or 2 parts (the table padded to 12 or 10 entries); only
  the pages up to the kv bound (4 pages at a bound of 32; at 40, 5 pages in 3 parts of 2, padded
  to 6). The reference's output."""
  monkeypatch.setenv(env, value)
  q, pools, table, pos = _case()
  table = np.concatenate([table, np.full((3, 5), 8, np.int32)], axis=1)  # 9 entries a row
  k, v = (jnp.asarray(p) for p in pools)
  out = jax.jit(lambda *a: attention.decode_attention_paged(*a[:3], 1, *a[3:], t, "pallas_gpu"))(
      jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(pos))
  np.testing.assert_allclose(np.asarray(out), _reference(q, pools, table, pos, 1), atol=2e-6)


@pytest.mark.parametrize("env,value,match", [
    ("AREAL_JAX_PALLAS_GPU_BLOCK_PAGES", "0", "AREAL_JAX_PALLAS_GPU_BLOCK_PAGES='0'"),
    ("AREAL_JAX_PALLAS_GPU_PAGED", "pages=2", "'pages=2' is not NAME=INTEGER"),
    ("AREAL_JAX_PALLAS_GPU_PAGED", "warps=0", "warps=0: expected >= 1")])
def test_a_bad_gpu_kernel_launch_is_named(env, value, match, monkeypatch):
  monkeypatch.setenv(env, value)
  q, pools, table, pos = _case()
  with pytest.raises(ValueError, match=match):
    attention.decode_attention_paged(jnp.asarray(q), *(jnp.asarray(p) for p in pools), 1,
                                     jnp.asarray(table), jnp.asarray(pos), 32, "pallas_gpu")
