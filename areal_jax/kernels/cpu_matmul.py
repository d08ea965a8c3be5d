"""Matmuls against packed weights on the CPU: a small C++ kernel (``cpu_matmul.cc``) called through
the XLA FFI, for the sampler's decode steps.

Why: a decode step multiplies a few dozen rows by every weight of the model, read from memory once
per step. XLA:CPU's library matmuls reach ~210 GFLOP/s on 64 rows (SmolLM2-135M's shapes, weights
from memory) on a 2-core Xeon that does ~360 on large matmuls. The kernel reads each weight front
to back exactly once per block of 64 rows, prefetched ahead, broadcasting it against rows of x held
in registers: ~290 GFLOP/s on the same chain (``bench/decode_matmul.py`` compares the two). It needs
the weight packed as ``wp[G, I, NR]`` with ``wp[g, i, j] = W[i, g * NR + j]`` (NR = 6, or 4 when the
output size is not a multiple of 6).

Who packs: the sampler's engine, once per weight version (``put_params``), when its mesh is one CPU
device, the model computes in float32 and the kernel is available (``enabled``). Then
``transformer.linear`` sees a packed (3-D) weight and calls ``matmul``, and a tied embedding, packed
as the LM head's weight, is looked up with ``take_rows``. Nothing trains through packed weights (no
gradient is defined). The kernel needs AVX-512; elsewhere, with ``AREAL_JAX_CPU_KERNELS=0`` and for
engines made inside ``disabled()``, weights stay as they are and XLA's matmuls run.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from areal_jax.kernels import cpu_ffi

TARGET = "areal_packed_matmul"
SOURCE = os.path.join(os.path.dirname(__file__), "cpu_matmul.cc")
_OFF = [False]


def _has_avx512() -> bool:
  try:
    with open("/proc/cpuinfo") as f:
      return any(line.startswith("flags") and " avx512f" in line for line in f)
  except OSError:
    return False


@functools.cache
def available() -> bool:
  """Whether the kernel is built and registered (builds it on the first call): x86 with AVX-512."""
  return _has_avx512() and cpu_ffi.register(SOURCE, "PackedMatmul", TARGET, "packed-matmul")


@contextlib.contextmanager
def disabled():
  """Engines made while the block is open keep their weights unpacked (XLA's matmuls), for
  side-by-side measurements and tests."""
  before, _OFF[0] = _OFF[0], True
  try:
    yield
  finally:
    _OFF[0] = before


def enabled(mesh: Mesh, compute_dtype) -> bool:
  """Whether an engine on ``mesh`` computing in ``compute_dtype`` packs its weights."""
  return (not _OFF[0] and mesh.size == 1 and mesh.devices.flat[0].platform == "cpu"
          and jnp.dtype(compute_dtype) == jnp.float32 and available())


def _group(n_out: int) -> int | None:
  """Output columns per packed group for an output size; None if it cannot be packed."""
  return 6 if n_out % 6 == 0 else 4 if n_out % 4 == 0 else None


def pack(w, transpose_w: bool = False):
  """``W`` (``[I, O]``, or ``[O, I]`` with ``transpose_w``) as ``[O / NR, I, NR]`` float32."""
  w_OxI = (w if transpose_w else w.T).astype(jnp.float32)
  o, i = w_OxI.shape
  nr = _group(o)
  return w_OxI.reshape(o // nr, nr, i).transpose(0, 2, 1)


def matmul(x_NxI, wp_GxIxR):
  """``x @ W`` over the last axis of ``x`` for a packed ``W``, in float32."""
  g, i, nr = wp_GxIxR.shape
  lead = x_NxI.shape[:-1]
  x_MxI = x_NxI.reshape(-1, i).astype(jnp.float32)
  out = jax.ShapeDtypeStruct((x_MxI.shape[0], g * nr), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x_MxI, wp_GxIxR).reshape(*lead, g * nr)


def take_rows(wp_GxExR, tokens):
  """Rows ``tokens`` of the ``[V, E]`` matrix that ``wp`` holds packed (``pack(., transpose_w=True)``)."""
  nr = wp_GxExR.shape[2]
  return wp_GxExR[tokens // nr, :, tokens % nr]


def packable(params: dict) -> dict:
  """Which leaves of a model's pure parameter dict ``pack_params`` packs: every matmul weight (2-D,
  output size a multiple of 4) and the embedding when it is also the LM head (no ``lm_head``)."""
  def walk(tree, top):
    out = {}
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = walk(value, False)
      elif top and name == "embed":
        out[name] = "lm_head" not in tree and _group(value.shape[0]) is not None
      else:
        out[name] = value.ndim == 2 and _group(value.shape[1]) is not None
    return out
  return walk(params, True)


def pack_params(params: dict, which: dict) -> dict:
  """``params`` with the leaves marked in ``which`` (``packable``) packed."""
  def walk(tree, marks, top):
    return {name: walk(value, marks[name], False) if isinstance(value, dict)
            else pack(value, transpose_w=top and name == "embed") if marks[name] else value
            for name, value in tree.items()}
  return walk(params, which, True)
