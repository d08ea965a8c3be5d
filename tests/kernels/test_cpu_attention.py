"""The CPU decode-attention kernel: built, chosen on CPU, equal to dense attention, per shard under a
mesh, and a clean fallback to XLA's form when it cannot be built."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import sharding
from areal_jax.kernels import cpu_attention
from areal_jax.models import transformer


def _inputs(b, rows, t, kv, g, d, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, 1, kv * g, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(rows, t, kv, d)), jnp.float32) for _ in range(2))
  return q, k, v


@jax.jit(static_argnames="kv_len")  # (one program, not the reference's ops one by one)
def _dense(q, k, v, pos, kv_len):
  """Each row attends to positions 0..min(pos, kv_len - 1) of its own cache row."""
  b = q.shape[0]
  last = jnp.minimum(pos, kv_len - 1)
  mask = (jnp.arange(kv_len)[None, :] <= last[:, None])[:, None]
  return transformer.attention(q, k[:b, :kv_len], v[:b, :kv_len], mask)


def _decode(kv_len):
  return jax.jit(lambda q, k, v, pos: transformer.decode_attention(q, k, v, pos, kv_len))


def test_kernel_is_built_and_used_on_cpu():
  assert cpu_attention.available(), "the machine has g++: the kernel must build"
  q, k, v = _inputs(4, 4, 16, 2, 2, 64)
  hlo = _decode(16).lower(q, k, v, jnp.zeros(4, jnp.int32)).compile().as_text()
  assert cpu_attention.TARGET in hlo


@pytest.mark.parametrize("kv,g,d", [(3, 3, 64), (2, 1, 128), (2, 2, 8), (1, 4, 24)],
                         ids=["smollm2-heads", "d128-no-groups", "tiny-odd-d8", "mqa-d24"])
def test_kernel_equals_dense_attention(kv, g, d):
  """Vector paths (head sizes 64 and 128) and the plain one (others); rows at position 0, mid-way,
  at the last position kept and past ``kv_len`` (clamped); more cache rows than queries."""
  b, rows, t, kv_len = 6, 9, 40, 33
  q, k, v = _inputs(b, rows, t, kv, g, d)
  pos = jnp.asarray([0, 5, 32, 17, 39, 1], jnp.int32)
  out = _decode(kv_len)(q, k, v, pos)
  np.testing.assert_allclose(out, _dense(q, k, v, pos, kv_len), atol=2e-6, rtol=1e-5)


def test_kernel_under_a_mesh_runs_per_shard():
  """Slots over the data axis and heads over the tensor axis: the kernel runs on each device's
  block (no cache gather) and equals the single-device result."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  b, t, kv, g, d = 8, 24, 2, 3, 64
  q, k, v = _inputs(b, b, t, kv, g, d, seed=1)
  pos = jnp.asarray([0, 23, 7, 12, 3, 19, 22, 1], jnp.int32)
  expected = _dense(q, k, v, pos, t)
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  cache = P("data", None, "tensor", None)
  args = (put(q, P("data", None, "tensor", None)), put(k, cache), put(v, cache), put(pos, P("data")))
  with sharding.use(mesh):
    fn = _decode(t)
    hlo = fn.lower(*args).compile().as_text()
    out = fn(*args)
  assert cpu_attention.TARGET in hlo
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  np.testing.assert_allclose(out, expected, atol=2e-6, rtol=1e-5)


def test_fewer_queries_than_sharded_cache_rows_use_xla():
  """A decode over the first rows of a cache split over devices has no per-shard blocks: XLA's
  form takes it, with the same result."""
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  q, k, v = _inputs(4, 8, 16, 2, 2, 64, seed=2)
  pos = jnp.asarray([3, 0, 15, 9], jnp.int32)
  mesh = sharding.make_mesh({"data": 8})
  k, v = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v))
  with sharding.use(mesh):
    assert not cpu_attention.usable(q.reshape(4, 2, 2, 64), k)
    fn = _decode(16)
    hlo = fn.lower(q, k, v, pos).compile().as_text()
    out = fn(q, k, v, pos)
  assert cpu_attention.TARGET not in hlo
  np.testing.assert_allclose(out, _dense(q, k, v, pos, 16), atol=2e-6, rtol=1e-5)


def test_no_kernel_for_other_dtypes_or_when_switched_off(monkeypatch):
  q, k, _ = _inputs(2, 2, 8, 1, 2, 64)
  q = q.reshape(2, 1, 2, 64)
  assert cpu_attention.usable(q, k)
  assert not cpu_attention.usable(q, k.astype(jnp.bfloat16))
  with cpu_attention.disabled():  # for every thread (engines trace on their own)
    assert not cpu_attention.usable(q, k)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cpu_attention.usable(q, k)))
    thread.start()
    thread.join()
    assert seen == [False]
  assert cpu_attention.usable(q, k)
  monkeypatch.setenv("AREAL_JAX_CPU_KERNELS", "0")
  assert not cpu_attention.available.__wrapped__()


def test_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.setenv("CXX", "no-such-compiler-xyz")
  with pytest.warns(UserWarning, match="no-such-compiler-xyz"):
    assert not cpu_attention.available.__wrapped__()
  assert not list(tmp_path.rglob("*.so"))
