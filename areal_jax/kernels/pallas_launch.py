"""How the Pallas GPU kernels of a decode step are launched: the paged attention kernel's
``PagedTuning`` and the fused norms' ``NormTuning``, from the environment or from the launch an
engine resolved when it was built (the ``launching`` and ``fusing_norms`` contexts its trace runs
in).

``kernels.choice`` re-exports every name here; callers import them from there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

from areal_jax.kernels import pallas_attention, pallas_norm_matmul

BLOCK_PAGES_ENV = "AREAL_JAX_PALLAS_GPU_BLOCK_PAGES"
PAGED_TUNING_ENV = "AREAL_JAX_PALLAS_GPU_PAGED"
NORM_MATMUL_ENV = "AREAL_JAX_DECODE_NORM_MATMUL"


def pallas_gpu_tuning(spec: str | None = None) -> pallas_attention.PagedTuning:
  """How the Pallas GPU paged-attention kernel is launched (``pallas_attention.PagedTuning``): its
  defaults (1 page a block; on an H100 the kernel read a layer's keys and values at the
  Qwen2.5-1.5B shape at ~55% of the read probe's bandwidth, ``bench/results/h100-2026-11-27-8a1f9a5``),
  or the fields asked for (``bench/paged_kernel.py`` times them). ``writes=1`` runs a paged decode
  step's cache writes and attention as one kernel of our own instead (``pallas_paged_step``: 8
  kernels a layer against 13 at the SmolLM2 shape); not the default: an engine times it against
  JAX's kernel before it decodes (``decode_launch.launch_stages``).
  ``$AREAL_JAX_PALLAS_GPU_PAGED`` sets fields (``block_pages=2,parts=4,warps=4,stages=3,bound=1,
  writes=1,dot=1``), ``$AREAL_JAX_PALLAS_GPU_BLOCK_PAGES`` the pages a block alone; read when a
  program is traced, or the launch of the ``launching`` context it is traced in (an engine's,
  resolved when it was built). ``spec``: fields in that syntax instead of the environment's."""
  if spec is None and (held := _LAUNCH.get()) is not None:
    return held
  fields, source = {}, f"${PAGED_TUNING_ENV}"
  if spec is None:
    block = os.environ.get(BLOCK_PAGES_ENV, "")
    if block and (not block.isdigit() or int(block) < 1):
      raise ValueError(f"${BLOCK_PAGES_ENV}={block!r}: expected a positive integer")
    if block:
      fields["block_pages"] = int(block)
    spec = os.environ.get(PAGED_TUNING_ENV, "")
  else:
    source = "the Pallas GPU kernel's launch"
  return _launch(pallas_attention.PagedTuning, spec, source, fields,
                 flags=("bound", "writes", "dot"))


def _launch(cls, spec: str, source: str, fields: dict | None = None, flags=(), on: bool = False):
  """A kernel's launch ``cls`` from ``spec``'s ``NAME=INTEGER`` items over ``fields``
  (``flags``: the boolean fields; ``on``: a bare ``1`` item is allowed and sets nothing); a bad
  item or value is named with ``source``."""
  fields = dict(fields or {})
  names = [f.name for f in dataclasses.fields(cls)]
  for item in filter(None, (x.strip() for x in spec.split(","))):
    if on and item == "1":
      continue
    name, _, value = item.partition("=")
    if name not in names or not value.isdigit():
      raise ValueError(f"{source}={spec!r}: {item!r} is not {'1 or ' * on}NAME=INTEGER with "
                       f"NAME one of {names}")
    fields[name] = bool(int(value)) if name in flags else int(value)
  try:
    return cls(**fields)
  except ValueError as e:
    raise ValueError(f"{source}={spec!r}: {e}") from None


_LAUNCH: contextvars.ContextVar[pallas_attention.PagedTuning | None] = contextvars.ContextVar(
    "launch", default=None)


@contextlib.contextmanager
def launching(tuning: pallas_attention.PagedTuning | None):
  """Inside it (an engine's trace of its decode program), ``pallas_gpu_tuning()`` is ``tuning``
  (None: read from the environment)."""
  token = _LAUNCH.set(tuning)
  try:
    yield
  finally:
    _LAUNCH.reset(token)


def norm_matmuls(platform: str, one_device: bool, spec: str | None = None,
                 no_triton: str | None = None) -> pallas_norm_matmul.NormTuning | None:
  """How a decode program runs each RMSNorm with the matmul after it (``pallas_norm_matmul``: the
  norm and the q/k/v projection as one Pallas GPU kernel, the norm, the gate/up projection and
  SwiGLU as another; 3 kernels a layer fewer), or None: as written (a norm kernel, a GEMM, a
  SwiGLU kernel). Off unless asked: an engine times it before it decodes
  (``decode_launch.launch_stages``; slower than cuBLAS's GEMMs on an H200,
  ``bench/results/h200-2026-11-30-2b4ab86``). ``$AREAL_JAX_DECODE_NORM_MATMUL`` (``spec``: the same
  syntax instead): ``1``, or the launch's fields (``block_n=32,warps=8,stages=3``); ``0`` or
  unset: off. Taken on a GPU, and on a CPU in Pallas interpret mode (tests), by an engine over one
  device (the kernel is not split over a mesh); read when an engine is built. Asked on GPUs that
  cannot run it (``no_triton``: ``triton_unusable``'s reason), it raises ValueError."""
  spec = os.environ.get(NORM_MATMUL_ENV, "") if spec is None else spec
  if spec.strip() in ("", "0") or not one_device or platform not in ("gpu", "cpu"):
    return None
  if no_triton:
    raise ValueError(f"${NORM_MATMUL_ENV}={spec!r} cannot run here: {no_triton} (unset it)")
  return _launch(pallas_norm_matmul.NormTuning, spec, f"${NORM_MATMUL_ENV}", on=True)


_NORM_MATMULS: contextvars.ContextVar[pallas_norm_matmul.NormTuning | None] = (
    contextvars.ContextVar("norm_matmuls", default=None))


@contextlib.contextmanager
def fusing_norms(tuning: pallas_norm_matmul.NormTuning | None):
  """Inside it (an engine's trace of its decode program), the model runs its norms with the
  matmuls after them as ``tuning`` says (``norm_matmuls``; None: as written)."""
  token = _NORM_MATMULS.set(tuning)
  try:
    yield
  finally:
    _NORM_MATMULS.reset(token)


def fused_norms() -> pallas_norm_matmul.NormTuning | None:
  """The tuning of the ``fusing_norms`` context the model is traced in, or None."""
  return _NORM_MATMULS.get()
