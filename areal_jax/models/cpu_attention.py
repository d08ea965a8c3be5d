"""Decode attention on the CPU as a small C++ kernel (``cpu_attention.cc``) called through the XLA FFI.

Why: XLA:CPU's loops over a KV cache read it at a few GB/s, far below memory bandwidth, and decode
attention is a read of the whole cache per step. On a 2-core Xeon, at 64 slots and 128 positions,
SmolLM2-135M's 30 layers of decode attention took ~100 ms of a ~210 ms step through XLA.

How: on first use the kernel is compiled with the system's C++ compiler (``$CXX``, else ``g++``)
against ``jax.ffi.include_dir()`` into ``$XDG_CACHE_HOME/areal_jax`` (``~/.cache/areal_jax``), keyed
by the source, the flags, the jaxlib version and the CPU, then registered as an FFI target. It
compiles with ``-march=native``, so the cached build is only reused on the same kind of CPU.

Where it runs: ``decode_attention`` (models/transformer.py) lowers to the kernel on CPU through
``lax.platform_dependent`` and to its XLA form on other platforms. The kernel is skipped (the XLA
form is used) when it cannot be built (a warning names the reason), for caches that are not float32,
when ``AREAL_JAX_CPU_KERNELS=0`` and when traced inside ``disabled()``. Under a device mesh it runs
per shard through ``shard_map``: slots over ``cache_batch``, heads over ``cache_heads``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import PartitionSpec as P

from areal_jax import sharding

TARGET = "areal_decode_attention"
_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_attention.cc")
_OFF = [False]  # process-wide: engines may trace on their own threads
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-w")


def _cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "areal_jax")


def _cpu_id() -> str:
  """The CPU's model and features (x86 and Arm field names), what ``-march=native`` depends on."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name = line.split(":", 1)[0].strip()
        if name in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
          fields.setdefault(name, line)
  except OSError:
    pass
  return platform.machine() + "".join(sorted(fields.values()))


def _build() -> str:
  """Compiles the kernel (once per source, flags, jaxlib and CPU); returns the library's path."""
  cxx = os.environ.get("CXX") or "g++"
  if shutil.which(cxx) is None:
    raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(source + repr((cxx, _FLAGS, jaxlib.__version__, _cpu_id())).encode())
  path = os.path.join(_cache_dir(), f"cpu_attention_{key.hexdigest()[:16]}.so")
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", _SOURCE, "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: concurrent builders each publish a whole library
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (builds it on the first call)."""
  if os.environ.get("AREAL_JAX_CPU_KERNELS", "1") == "0":
    return False
  try:
    lib = ctypes.CDLL(_build())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.DecodeAttention), platform="cpu")
  except (RuntimeError, OSError) as e:
    warnings.warn(f"CPU decode-attention kernel unavailable, using XLA's form instead: {e}")
    return False
  return True


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
