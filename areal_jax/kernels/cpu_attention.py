"""Decode attention on the CPU as a small C++ kernel (``cpu_attention.cc``) called through the XLA FFI.

Why: XLA:CPU's loops over a KV cache read it at a few GB/s, far below memory bandwidth, and decode
attention is a read of the whole cache per step. On a 2-core Xeon, at 64 slots and 128 positions,
SmolLM2-135M's 30 layers of decode attention took ~100 ms of a ~210 ms step through XLA.

How: built on first use and registered as an FFI target (``cpu_ffi``).

Where it runs: ``attention.decode_attention`` calls it when ``choice.attention`` picked ``"cpu"``
(the default on CPU devices when it builds). The kernel is skipped (XLA's chunked form is used)
when it cannot be built (a warning names the reason), for caches that are not float32,
when ``AREAL_JAX_CPU_KERNELS=0`` and when traced inside ``disabled()``. Under a device mesh it runs
per shard through ``shard_map``: slots over ``cache_batch``, heads over ``cache_heads``.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from areal_jax import sharding
from areal_jax.kernels import cpu_ffi

TARGET = "areal_decode_attention"
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_attention.cc")
_OFF = [False]  # process-wide: engines may trace on their own threads


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (builds it on the first call)."""
  return cpu_ffi.register(SOURCE, "DecodeAttention", TARGET, "decode-attention")


@contextlib.contextmanager
def disabled():
  """Functions traced while the block is open, by any thread, use XLA's form (for side-by-side
  measurements and tests)."""
  before, _OFF[0] = _OFF[0], True
  try:
    yield
  finally:
    _OFF[0] = before


def is_disabled() -> bool:
  """Whether a ``disabled()`` block is open (part of the key of cached compiled functions)."""
  return _OFF[0]


def _kernel(q_BxHxD, k_RxTxKxD, v_RxTxKxD, pos_B, kv_len: int):
  out = jax.ShapeDtypeStruct(q_BxHxD.shape, jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(q_BxHxD, k_RxTxKxD, v_RxTxKxD, pos_B, kv_len=kv_len)


def usable(q_BxKxGxD, k_RxTxKxD) -> bool:
  """Whether ``decode_attention`` can take this call: the kernel is available, the cache is float32
  and, when slots are split over devices, the queries cover the whole cache (one block per shard)."""
  b, r = q_BxKxGxD.shape[0], k_RxTxKxD.shape[0]
  if _OFF[0] or k_RxTxKxD.dtype != jnp.float32 or not available():
    return False
  return b == r or sharding.num_shards("cache_batch", r) == 1


def decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, kv_len: int):
  """The kernel's ``decode_attention`` (queries pre-scaled, float32); per shard under a mesh."""
  b, kv, g, d = q_BxKxGxD.shape
  q_BxHxD = q_BxKxGxD.reshape(b, kv * g, d).astype(jnp.float32)
  call = functools.partial(_kernel, kv_len=kv_len)
  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    cache = sharding.spec(("cache_batch", None, "cache_heads", None), k_RxTxKxD.shape, mesh, rules)
    # the queries' rows split like the cache's (``usable``: unsplit unless they cover all of it)
    q_spec, pos_spec = P(cache[0], cache[2], None), P(cache[0])
    call = jax.shard_map(call, mesh=mesh, in_specs=(q_spec, cache, cache, pos_spec),
                         out_specs=q_spec, check_vma=False)
  return call(q_BxHxD, k_RxTxKxD, v_RxTxKxD, pos_B.astype(jnp.int32)).reshape(b, kv, g, d)
