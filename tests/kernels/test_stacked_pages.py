"""JAX's paged-attention kernels (TPU and GPU, interpret mode on CPU) over the scanned decode's
stacked cache read in place as pages (``stacked_pages``): against a float64 NumPy reference on the
cache's values, per layer, with more cache rows than queries, on one device and split over a
data x tensor mesh, the whole stack handed to the kernel (no slice); and where they cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import sharding
from areal_jax.kernels import (attention, choice, pallas_attention, pallas_tpu_attention,
                               stacked_pages)
from areal_jax.models import decode_scan

L, R, K, G, T, D = 3, 4, 2, 3, 64, 16


def _case(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(3, K, G, D)).astype(np.float32) * D**-0.5  # rows [0, 3) of 4
  k, v = (rng.normal(size=(L, R, K, T, D)).astype(np.float32) for _ in range(2))
  k[:, :, :, 40:] += 100.0  # positions past every row's length would dominate if they were read
  pos = np.asarray([0, 17, 39], np.int32)
  return q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), pos


def _reference(q, k, v, pos, layer):
  k, v = (np.asarray(x.astype(jnp.float32), np.float64)[layer] for x in (k, v))
  out = np.zeros(q.shape, np.float64)
  for i in range(q.shape[0]):
    s = np.einsum("kgd,ktd->kgt", q[i], k[i, :, :pos[i] + 1])
    p = np.exp(s - s.max(-1, keepdims=True))
    out[i] = np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), v[i, :, :pos[i] + 1])
  return out


def _stacked(mesh=None, impl="pallas_tpu", t=T):
  def fn(q, k, v, pos, layer):
    if mesh is None:
      return attention.decode_attention_stacked(q, k, v, layer, pos, t, impl,
                                                cache_axes=decode_scan.CACHE_AXES)
    with sharding.use(mesh):
      return attention.decode_attention_stacked(q, k, v, layer, pos, t, impl,
                                                cache_axes=decode_scan.CACHE_AXES)
  return jax.jit(fn)


# the TPU kernel over a bfloat16 cache (it loads K/V as bfloat16); the GPU one over a float32
# cache (it computes in the cache's dtype: over a bfloat16 one it rounds queries and
# probabilities to bfloat16 as the dense read does)
KERNELS = {"pallas_tpu": (pallas_tpu_attention, "paged_attention", jnp.bfloat16),
           "pallas_gpu": (pallas_attention.pallas_paged, "paged_attention", jnp.float32)}


@pytest.mark.parametrize("impl", sorted(KERNELS))
@pytest.mark.parametrize("split", [False, True])
def test_kernel_equals_the_reference_on_every_layer(impl, split, monkeypatch):
  calls = []
  module, name, dtype = KERNELS[impl]
  kernel = getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw))
  q, k, v, pos = _case()
  k, v = k.astype(dtype), v.astype(dtype)
  mesh = None
  if split:  # rows over data, K/V heads over tensor: each device runs the kernel on its part
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "data", "tensor"))) for x in (k, v))
  fn = _stacked(mesh, impl)
  for layer in range(L):
    out = fn(jnp.asarray(q), k, v, jnp.asarray(pos), layer)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, pos, layer), atol=2e-6)
  # the whole stack (this device's part of it) as one pool of pages: no slice of the cache
  rows, heads = (R // 2, K // 2) if split else (R, K)
  assert calls == [(1, L * rows * heads * T // 64, 64, D)]


@pytest.mark.parametrize("launch", ["", "bound=1", "bound=1,parts=3,block_pages=2,warps=4"])
def test_the_gpu_kernel_reads_the_stack_alike_however_it_is_launched(launch, monkeypatch):
  """``$AREAL_JAX_PALLAS_GPU_PAGED`` reaches the stacked cache's kernel too: 48 positions (3 pages
  of 16 a sequence) read to the kv bound 32 (2 pages), the second padded to 3 parts; the
  reference's output."""
  monkeypatch.setenv("AREAL_JAX_PALLAS_GPU_PAGED", launch)
  calls = []
  kernel = pallas_attention.pallas_paged.paged_attention
  monkeypatch.setattr(pallas_attention.pallas_paged, "paged_attention",
                      lambda *a, **kw: calls.append((a[3].shape[1], kw)) or kernel(*a, **kw))
  q, k, v, _ = _case()
  k, v = (x[:, :, :, :48].astype(jnp.float32) for x in (k, v))
  pos = np.asarray([0, 17, 31], np.int32)
  out = _stacked(None, "pallas_gpu", 32)(jnp.asarray(q), k, v, jnp.asarray(pos), 1)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, pos, 1), atol=2e-6)
  (entries, kw), = calls
  expected = {"": (3, 1, 8), "bound=1": (2, 2, 8),
              "bound=1,parts=3,block_pages=2,warps=4": (3, 3, 4)}[launch]
  assert (entries, kw["k_splits"], kw["num_warps"]) == expected


def test_pages_and_where_the_kernel_cannot_run():
  assert [stacked_pages.page_size(t) for t in (64, 1536, 48, 40, 512)] == [64, 128, 16,
                                                                                    None, 128]
  assert pallas_tpu_attention.unusable("scan", jnp.bfloat16, 512) is None
  for args, what in ((("unrolled", jnp.bfloat16, 512), "decode_layers='scan'"),
                     (("scan", jnp.float32, 512), "cache_dtype='bfloat16'"),
                     (("scan", jnp.bfloat16, 40), "multiple of 16")):
    assert what in pallas_tpu_attention.unusable(*args)
    with pytest.raises(ValueError, match="'pallas_tpu' cannot run here"):
      choice.check_attention("pallas_tpu", *args, 128)
  choice.check_attention("dense", "unrolled", jnp.float32, 40, 64)  # the other forms have no such needs


def test_gpu_positions_that_do_not_split_into_pages_take_the_layers_slice():
  """max_len 40 (no page of 16 divides it): the GPU kernel's mqa on the layer's slice instead."""
  q, k, v, _ = _case()
  k, v = (x[:, :, :, :40].astype(jnp.float32) for x in (k, v))
  pos = np.asarray([0, 17, 31], np.int32)  # within the kv bound 32 (it splits for mqa)
  assert not pallas_attention.stacked_usable(40)
  out = _stacked(None, "pallas_gpu", 32)(jnp.asarray(q), k, v, jnp.asarray(pos), 2)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, pos, 2), atol=2e-6)


def test_float32_cache_takes_the_dense_read_not_the_kernel(monkeypatch):
  """The kernel would round a float32 cache to bfloat16: that cache is read densely instead."""
  monkeypatch.setattr(pallas_tpu_attention, "paged_attention", None)  # would fail if called
  q, k, v, pos = _case()
  k, v = k.astype(jnp.float32), v.astype(jnp.float32)
  out = _stacked()(jnp.asarray(q), k, v, jnp.asarray(pos), 1)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, pos, 1), atol=1e-5)
