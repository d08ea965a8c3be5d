"""Platforms: which one a program is traced for, and which kernels its devices can run.

CUDA and ROCm are both ``"gpu"`` here. Pallas kernels run compiled on GPU and TPU and in Pallas
interpret mode on a CPU backend (tests). ``lowering_for(platform)`` traces them compiled for
``platform`` from any backend, for programs lowered for another platform (``lower``): on a CPU
machine that checks that the kernels lower as a GPU or TPU would compile them (Mosaic's and
Triton's constraints on block shapes are checked there, not in interpret mode).

``kernels.choice`` re-exports every name here; callers import them from there.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

from jax.sharding import Mesh

from areal_jax import sharding

_LOWERING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowering_for",
                                                                           default=None)


def platform_of(mesh: Mesh | None) -> str:
  """``"cpu"``, ``"gpu"`` or ``"tpu"`` (CUDA and ROCm are both ``"gpu"``) of a mesh's devices, or of
  the default backend without a mesh (the platform of ``lowering_for`` inside it)."""
  import jax  # noqa: PLC0415 (kept local: the module is imported by the model layer)

  if mesh is not None:
    name = mesh.devices.flat[0].platform
  else:
    name = _LOWERING_FOR.get() or jax.default_backend()
  return _family(name)


def _family(name: str) -> str:
  """A platform's name as the choices here know it: CUDA and ROCm are both ``"gpu"``."""
  return "gpu" if name in ("cuda", "rocm", "gpu") else name


TRITON_MIN_CAPABILITY = (8, 0)  # the NVIDIA GPUs XLA compiles Pallas's Triton kernels for


def triton_unusable(devices) -> str | None:
  """Why Pallas's GPU kernels (Triton: ``pallas_gpu``, ``pallas_paged_step``,
  ``pallas_norm_matmul``) cannot run on ``devices``, or None where they can. XLA compiles Triton
  kernels for NVIDIA GPUs of compute capability 8.0 (Ampere) and newer only: on a T4 (7.5, Colab's
  free GPU) or a V100 (7.0) the first call of a program holding one fails ("Triton support is only
  enabled for Ampere GPUs", jax-ml/jax#26799). There the decode step runs without them: its
  cache as rows read by the dense attention (``kv_pages``, ``attention``). CPU devices (interpret
  mode) and ROCm's (whose capability is not a number) are not held back."""
  old = sorted({f"{getattr(d, 'device_kind', 'GPU')} (compute capability {cap[0]}.{cap[1]})"
                for d in devices if _family(getattr(d, "platform", "")) == "gpu"
                and (cap := _capability(d)) is not None and cap < TRITON_MIN_CAPABILITY})
  if not old:
    return None
  return (f"Pallas's GPU kernels (Triton) need an NVIDIA GPU of compute capability "
          f"{TRITON_MIN_CAPABILITY[0]}.{TRITON_MIN_CAPABILITY[1]} or newer; these devices are "
          f"{', '.join(old)}")


MOSAIC_MIN_TPU = 4  # the TPU generations whose Mosaic compiles the flash kernel's bf16 matmuls


def mosaic_unusable(devices) -> str | None:
  """Why JAX's Pallas TPU flash kernel (``causal_attention``) cannot run on ``devices``, or None
  where it can: libtpu 0.0.42 compiles it for TPU v4, v5e, v5p and v6e chips, while for a TPU v3
  (Kaggle's TPU v3-8) Mosaic refuses its matmuls ("Unsupported matmul RHS type on target:
  vector<128x128xbf16>"): TPUs before v4 keep the dense attention."""
  old = sorted({d.device_kind for d in devices if _family(getattr(d, "platform", "")) == "tpu"
                and (gen := _tpu_generation(getattr(d, "device_kind", ""))) is not None
                and gen < MOSAIC_MIN_TPU})
  if not old:
    return None
  return (f"JAX's Pallas TPU flash kernel needs a TPU v{MOSAIC_MIN_TPU} or newer (Mosaic refuses "
          f"its bfloat16 matmuls on older chips); these devices are {', '.join(old)}")


def _tpu_generation(kind: str) -> int | None:
  """The generation of a TPU's ``device_kind`` ("TPU v3" -> 3, "TPU v5 lite" -> 5, "TPU7x" -> 7),
  or None."""
  m = re.match(r"TPU\s*v?(\d+)", kind)
  return int(m[1]) if m else None


def _capability(device) -> tuple[int, int] | None:
  """A CUDA device's compute capability as ``(major, minor)``, or None (no such attribute, or not
  a number: ROCm's ``gfx90a``)."""
  major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
  return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None


@contextlib.contextmanager
def lowering_for(platform: str):
  """Inside it, Pallas kernels are traced compiled for ``platform`` (``"gpu"``/``"cuda"`` or
  ``"tpu"``), not interpreted, whatever the default backend (see the module docstring). A function
  jitted and traced outside it keeps that trace (jit caches by arguments): lower fresh ones."""
  token = _LOWERING_FOR.set(platform)
  try:
    yield
  finally:
    _LOWERING_FOR.reset(token)


GPU_TARGET_KIND = "NVIDIA H100 80GB HBM3"  # the GPU `lower` compiles Pallas kernels for by default


def lower(fn, args, platform: str, device_kind: str | None = None):
  """``fn.trace(*args).lower(lowering_platforms=(platform,))`` (``fn`` jitted; inside
  ``lowering_for(platform)``) from any backend. JAX's Pallas Triton lowering reads the GPU it
  compiles a kernel for off the default device: on a machine without a GPU, JAX 0.10 takes
  compute capability 9.0 (an H100's), JAX 0.11 raises unless an abstract GPU device is in effect.
  That abstract device must also be the one of every mesh the program's values live on, so a
  program built over this CPU's devices (an engine's, in tests) could not be lowered with it:
  here the Triton lowering is told ``device_kind`` (an H100 by default) instead, around the trace
  and the lowering only (under JAX 0.10, which has no such question, ``device_kind`` is unused)."""
  import jax  # noqa: PLC0415

  if _family(platform) != "gpu" or _family(jax.default_backend()) == "gpu":
    return fn.trace(*args).lower(lowering_platforms=(platform,))
  with _triton_device_kind(device_kind or GPU_TARGET_KIND):
    return fn.trace(*args).lower(lowering_platforms=(platform,))


@contextlib.contextmanager
def _triton_device_kind(kind: str):
  try:
    from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 (JAX >= 0.11)
  except ImportError:
    gpu_info = None
  if gpu_info is None or not hasattr(gpu_info, "get_device_kind"):
    yield
    return
  saved = gpu_info.get_device_kind
  gpu_info.get_device_kind = lambda: kind
  try:
    yield
  finally:
    gpu_info.get_device_kind = saved


def interpret_here() -> bool:
  """Whether Pallas kernels of the program being traced run in interpret mode: its devices (the
  active ``sharding.use`` mesh's, else the default backend's) are CPUs, and it is not lowered for
  another platform (``lowering_for``)."""
  import jax  # noqa: PLC0415

  if _LOWERING_FOR.get() is not None:
    return _family(_LOWERING_FOR.get()) == "cpu"
  ctx = sharding.current()
  name = ctx[0].devices.flat[0].platform if ctx is not None else jax.default_backend()
  return _family(name) == "cpu"
