"""The one place that picks the platform kernels (the sampler's decode, whole rows' attention).

Decode attention (``ATTENTION``):
  * ``"cpu"``: the C++ kernel (``cpu_attention``), each row read up to its own position. CPU only.
  * ``"xla"``: online softmax over cache chunks in XLA loops, rows grouped by position
    (``xla_attention.chunked``).
  * ``"dense"``: one dense read of the cache up to the static bound, masked per row
    (``xla_attention.dense``): what XLA on GPU and TPU fuses best.
  * ``"pallas_gpu"``: JAX's Pallas GPU kernels (``pallas_attention``): on the scan's stacked cache
    ``jax.experimental.pallas.ops.gpu.paged_attention`` reading it in place as pages
    (``stacked_pages``, when ``max_len`` is a multiple of 16; else ``decode_attention.mqa`` per
    (row, head) on the layer's slice), on a per-layer cache (the layers unrolled: held
    heads-major for it, ``sampler/slot_cache``) ``decode_attention.mqa`` per (row, head) in place;
    over a paged cache's pools the paged kernel, or (``pallas_gpu_tuning``'s ``writes``) our own
    kernel that also writes the step's keys and values (``pallas_paged_step``); each row read up
    to its own length; runs in Pallas interpret mode on a CPU device (tests).
  * ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.paged_attention`` over the scan's stacked
    cache read in place as pages (``pallas_tpu_attention``), each row read up to its own length;
    over a paged cache's pools (the layers unrolled or in a scan); needs the layers in a scan
    without pages, a bfloat16 cache and ``max_len`` a multiple of 16 (the engine says which is
    missing); Pallas TPU interpret mode on a CPU device (tests). Not the TPU default: this
    project had no TPU to measure it on, so TPU keeps the dense read until it is measured.

Decode matmuls (``MATMUL``): ``"cpu_packed"`` (weights packed once per version for the C++ kernel,
``cpu_matmul``: one CPU device, float32, AVX-512), ``"xla"`` (XLA's own matmuls; on a GPU it
autotunes its Triton GEMMs against the vendor library's per program at compile time) or ``"blas"``
(GPU only: XLA with its Triton GEMM emitter and its autotuning off for the sampler's programs,
``compiler_options``: every matmul a call of the vendor library, cuBLAS or hipBLASLt, whose own
heuristics pick each GEMM's algorithm). ``"blas"`` is the GPU default, for compile time: XLA's
autotuning of one decode program at the Qwen2.5-1.5B shape took minutes on an H200 (jax 0.11.2;
with autotuning off, XLA's untuned Triton GEMMs ran that step 6x slower than the autotuned floor).
With ``"blas"`` the scanned decode program compiled in 1.5 s at the SmolLM2 shape on an H100 and
ran 1.89 ms a step (the floor loop with the same options 1.49 ms); at the 1.5B shape, compiled
for an H100 on a 2-core CPU with no GPU (``bench/aot_decode.py``, XLA's passes without
autotuning), the decode program compiles in 5-9 s. On an H100 in session 27
(``bench/results/h100-2026-11-27-s27``, the layers unrolled, rows, dense read): 1.5B shape
``"blas"`` 5.08 ms a step, ``"xla"`` 5.10 ms (its program compiled in 8.4 s, autotuning
included, that time); SmolLM2 shape 1.62-1.75 against 1.38-1.50 ms (XLA's GEMMs faster there).
So where ``"blas"`` is the default (nothing named the matmuls), a GPU engine times XLA's GEMMs
against it for its decode program before its first decode (``launch_stages``, ``Launch.matmul``).

Decode layers (``LAYERS``): ``"scan"`` (the layers in one ``lax.scan`` over a stacked view of the
weights and a stacked cache, ``models/decode_scan``: compile time flat in depth) or ``"unrolled"``
(``Transformer.extend``, one traced body per layer, per-layer caches). ``"scan"`` needs XLA matmuls
(the CPU kernel's packed weights are per layer); a paged KV cache runs with either
(``decode_scan.extend_unrolled``: the per-layer weights over the pools). The GPU default
is ``"unrolled"``, with a paged cache too: XLA:GPU copies each layer's slice of the
stacked weights, and its keys and values, into buffers of their own before the matmuls read them,
every layer of every step. Counted in the programs compiled for an H100 (``bench/aot_decode.py``, 16
steps per call): at the Qwen2.5-1.5B shape (128 slots, context 512, a step must read 4970 MB) the
scanned step copies 5.4-5.5 GB, the unrolled one 0.6 MB with XLA's GEMMs or cuBLAS (89 MB with
cuBLAS before its query groups were padded in the queries, ``query_rows``; 0.35-0.44 GB before the
per-layer cache was held heads-major, ``sampler/slot_cache``: the positions-first one was relaid
out at each call's entry and exit), and the unrolled program compiled in 5-10 s against the
scanned one's 5-16 s (three runs); at the SmolLM2 shape 0.8 GB against 0.1 MB for 459 MB to
read. Measured at the SmolLM2 shape (64 slots, context 128): unrolled 1.70 ms a step against the
scan's 1.89 ms on an H100 (``"blas"``), 1.50 against 1.95 ms on an H200 (XLA's matmuls); at the
1.5B shape on the H200, with XLA's untuned matmuls only, 35.3 against 36.8 ms; at the 1.5B shape
on an H100 with ``"blas"`` (session 27) 5.05 against 5.33 ms. The TPU default is ``"unrolled"``
too (``"scan"`` with a paged cache or the Pallas TPU kernel), its per-layer cache positions
first and written by one scatter a layer (``heads_major_per_layer``, ``scatter_cache_writes``);
compiled for one TPU v5e
chip (libtpu, no TPU: ``bench/results/cpu-aot-tpu-v5e-2026-11-27``) at the 1.5B shape the scanned
step copies 5.2 GB a step (each layer's keys and values, relaid out, at every layer and step), the
unrolled one with per-row writes 0.3 GB but as ~59,000 operations a step (each layer's write a loop
over the slots), the unrolled one as chosen 0.3 GB in ~1,600 operations (half of it the float32
logits relaid out for sampling, a third the MLP and attention weights relaid out at each call's
entry, once per 16 steps); the floor loop 0.4 GB. Its run time on a TPU:
not measured (this project had no TPU). The price of unrolling: the decode program's compile time
grows with depth (compiled on a 2-core CPU at the SmolLM2 shape from 15 to 120 layers: ~0.1 s a
layer for an H100, ~0.25 s for a TPU v5e, the scan's flat at 2-3 s and 10-12 s,
``bench/results/cpu-aot-depth-2026-11-27``), once per (kv bucket, width) program an engine
uses; ``decode_layers="scan"`` keeps it flat for very deep models, at the copies above.

Decode projections (``PROJECTIONS``): ``"fused"`` (the engine holds q, k, v as one weight and gate,
up as one, ``transformer.fuse_projections``: three matmuls a layer fewer, each of the rest reading
the same bytes as the ones it replaces) or ``"separate"`` (the model's own layout). ``"auto"``:
fused on GPU and TPU wherever the mesh's tensor axis divides the KV heads (fused weights then split over
it in whole KV heads, as the separate ones do), separate on CPU. Why on GPU: XLA's GPU compiler
merges sibling matmuls that share an input (its ``DotMerger`` pass, operands up to
``--xla_gpu_dot_merger_threshold_mb``, 32 MB by default) into one against a concatenation of
their weights made inside the program, so each execution copies those weights (with the layers in
a scan, slices of the stacked weights: every layer at every step). For the SmolLM2 shape that
would be ~140 MB written and read again per step next to the 459 MB a step must read; for the
Qwen2.5-1.5B shape ~1.7 GB next to 5 GB (on an H100 at that shape, session 27: separate 6.47
ms a step against fused 5.05 ms, ``"blas"``, the layers unrolled; the floor loop of
``bench/decode_floor.py`` keeps separate weights). Weights fused once per version leave nothing to
merge.
On CPU (XLA:CPU does not merge them, checked in its optimized HLO) the fused and separate decode
steps measured the same (SmolLM2 shape, 64 slots, both the C++ kernels' and XLA's paths), so the
CPU keeps the model's layout.

Decode norms (``norm_matmuls``): with fused projections, each RMSNorm of a decode step can run in
one Pallas GPU kernel with the matmul after it (``pallas_norm_matmul``; the model asks
``fused_norms`` inside the engine's ``fusing_norms``). Off unless ``$AREAL_JAX_DECODE_NORM_MATMUL``
asks: compiled for an H100 it takes 3 kernels a layer off the step, but its run time against
cuBLAS's GEMMs is not measured.

Decode launches timed (``launch_stages``, ``rollout.decode_tuning``): on a GPU the kernels
above that are off by default for want of a measurement (our paged step kernel, ``writes``, with
or without ``dot``; the fused norms), the decode loop in CUDA graphs (XLA's command buffers,
per program) and, where ``"blas"`` is the default, XLA's autotuned GEMMs are offered to the
engine, stage by stage, which times them against the launch kept so far on its own device before
it decodes and keeps the fastest that computes what its own does (``sampler/launch_tuning.py``).
Only what the environment leaves open is offered (a launch forced by
``$AREAL_JAX_PALLAS_GPU_PAGED``, ``$AREAL_JAX_DECODE_NORM_MATMUL``, ``$AREAL_JAX_DECODE_MATMUL``
or command buffers in ``$XLA_FLAGS`` is kept). ``"off"``, CPU and TPU: the engine's own launch
only.

Top-k / top-p (``truncation_on_host``): on GPU the engine picks, on the host, a decode program
with the vocabulary's sort or one without it, so no step holds a conditional (each a wait for the
host there); on CPU and TPU one program decides it in the step.

``"auto"`` picks per platform: on CPU the C++ kernels when they build (else XLA's forms) and the
layers unrolled (the C++ matmul kernel's packed weights are per layer; on XLA's path the scanned
step measured no faster on CPU); on GPU a paged KV cache where the service keeps page tables
(``kv_pages`` -1, the default of ``rollout.kv_pages`` and of the rollout service: ``kv_pages``)
read in place by ``"pallas_gpu"``, ``"dense"`` over a cache of rows, ``"blas"`` matmuls and the
layers unrolled (on GPUs older than Ampere, a T4 or a V100, which cannot run Pallas's Triton
kernels, ``triton_unusable``: rows and ``"dense"``); on TPU ``"dense"``, ``"xla"`` matmuls and the
layers unrolled.
Measured on one H100 (``bench/results/h100-2026-11-27-s27``, 16 steps a call, the layers
unrolled, ``"blas"``): the Pallas kernel over pages 3.99 ms a step at the Qwen2.5-1.5B shape
(128 slots, context 512; the dense read over rows 4.97 ms, the floor loop 4.88 ms) and 1.38 ms
at the SmolLM2 shape (64 slots, context 128; 1.62 and 1.60 ms); over rows (``mqa`` per row and
head) it measured as the dense read. On one H200 with the paged default, ``bench/sampler.py``:
3.77 ms at the 1.5B shape (floor 4.22 ms), 1.48 ms at the SmolLM2 shape (floor 1.56 ms). What
the dense read copies under cuBLAS turns on its kv bound: on the H100 (jax 0.11.2) at the
benchmark's bound of 593 each layer's keys and values were padded to 600 positions by a copy
every step (~30% of the device time at the 1.5B shape); compiled for an H100 with jax 0.10.2
(``bench/aot_decode.py``) the bound 577 copies 0.6 MB a step and 576 (aligned, as the engine's
power-of-two buckets are) 2.9 GB, each layer's whole cache. The Pallas kernel reads the pages in
place at any bound and each row only up to its own length (the dense read: up to the bucket
above the furthest slot).
Pallas kernels run compiled on GPU and TPU and in Pallas interpret mode on a CPU backend (tests);
``lowering_for(platform)`` traces them compiled for ``platform`` from any backend, for programs
lowered for another platform (``lower(jit(f), args, platform)``: ``jit(f).trace(*args).lower(
lowering_platforms=...)``, telling JAX 0.11's Triton lowering which GPU it compiles for): on a CPU
machine that checks that the kernels lower as a GPU or TPU would compile them (Mosaic's and
Triton's constraints on block shapes are checked there, not in interpret mode).

Causal attention of whole rows (``CAUSAL``, ``causal_attention``): a training step's over packed
rows and a prefill's (``causal_attention``'s module). ``"auto"``: on GPU and TPU the flash kernels
JAX ships (``"pallas_gpu"``, ``"pallas_tpu"``), which never hold a row's ``L x L`` scores; on CPU
(and on GPUs without Triton, TPUs before v4, or head sizes Mosaic refuses: ``mosaic_unusable``)
``"dense"``, the model's masked form.
Chosen for memory, not speed: compiled for a TPU v5e chip (libtpu on this CPU machine), the
default recipe's train step at 16k-token sequences needs temporaries the compiler refuses
(23.91 GB of a 15.75 GB chip) with the dense form and 16.85 GiB in all with the kernel
(``bench/results/plan-flash-2026-11-29-s37``). Their run time on an accelerator is not measured
(no device was lent to this project since they were added). ``actor.attention`` and
``rollout.prefill_attention`` request one (``$AREAL_JAX_CAUSAL_ATTENTION`` where they say auto);
the platform is that of the program being traced (``platform_here``: the mesh in use).

A request other than ``"auto"`` (an engine's config) wins; else ``$AREAL_JAX_DECODE_ATTENTION`` /
``$AREAL_JAX_DECODE_MATMUL`` / ``$AREAL_JAX_DECODE_LAYERS`` / ``$AREAL_JAX_DECODE_PROJECTIONS``
when set; else the platform's default.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from typing import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from areal_jax import sharding
from areal_jax.kernels import (causal_attention as causal_kernels, cpu_attention, cpu_matmul,
                               pallas_attention, pallas_norm_matmul, pallas_paged_step,
                               pallas_tpu_attention)

ATTENTION = ("cpu", "xla", "dense", "pallas_gpu", "pallas_tpu")
MATMUL = ("cpu_packed", "xla", "blas")
LAYERS = ("scan", "unrolled")
PROJECTIONS = ("fused", "separate")
ATTENTION_ENV = "AREAL_JAX_DECODE_ATTENTION"
MATMUL_ENV = "AREAL_JAX_DECODE_MATMUL"
LAYERS_ENV = "AREAL_JAX_DECODE_LAYERS"
PROJECTIONS_ENV = "AREAL_JAX_DECODE_PROJECTIONS"
CAUSAL = causal_kernels.IMPLS
CAUSAL_ENV = "AREAL_JAX_CAUSAL_ATTENTION"
HELD_LAYOUTS_ENV = "AREAL_JAX_HELD_LAYOUTS"
QUERY_ROWS_ENV = "AREAL_JAX_DECODE_QUERY_ROWS"
PAGED_ENV = "AREAL_JAX_PAGED_CACHE"
BLOCK_PAGES_ENV = "AREAL_JAX_PALLAS_GPU_BLOCK_PAGES"
PAGED_TUNING_ENV = "AREAL_JAX_PALLAS_GPU_PAGED"
NORM_MATMUL_ENV = "AREAL_JAX_DECODE_NORM_MATMUL"
TRUNCATION_ENV = "AREAL_JAX_TRUNCATION_ON_HOST"
PALLAS_GPU_PAGE = 16  # positions a page of the Pallas GPU kernel is a multiple of (its blocks)
HELD_LAYOUTS = ("compiler", "default")
_PLATFORMS = {"cpu": ("cpu", "xla", "dense", "pallas_gpu", "pallas_tpu"),
              "gpu": ("xla", "dense", "pallas_gpu"), "tpu": ("xla", "dense", "pallas_tpu")}


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
  enabled for Ampere GPUs", jax-ml/jax#26799). There the decode step runs without them: its cache
  as rows read by the dense attention (``kv_pages``, ``attention``). CPU devices (interpret mode)
  and ROCm's (whose capability is not a number) are not held back."""
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
  where it can: compiled by libtpu 0.0.42 on this CPU machine for TPU v4, v5e, v5p and v6e chips
  it compiles, for a TPU v3 (Kaggle's TPU v3-8) Mosaic refuses its matmuls ("Unsupported matmul
  RHS type on target: vector<128x128xbf16>"): TPUs before v4 keep the dense attention."""
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


def rope_tables_materialized() -> bool:
  """Whether ``transformer.rope_tables`` makes its tables a buffer the layers read (a product with
  the identity): on CPU, whose fusion would otherwise re-evaluate the angles' ``cos`` and ``sin``
  in every layer (4.6 against 0.5 ms of a SmolLM2 decode step); not on GPU or TPU, where the
  product is a kernel of its own. Read when a program is traced (the platform of
  ``lowering_for`` inside it)."""
  return platform_of(None) == "cpu"


def interpret() -> bool:
  """Whether Pallas kernels run in interpret mode: on a CPU backend, outside ``lowering_for``."""
  return platform_of(None) == "cpu"


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


def _requested(requested: str, env: str, valid: tuple[str, ...], what: str) -> str:
  value = requested if requested != "auto" else os.environ.get(env, "auto") or "auto"
  if value != "auto" and value not in valid:
    source = f"${env}" if requested == "auto" else what
    raise ValueError(f"{source}={value!r} is not one of {('auto',) + valid}")
  return value


def attention(platform: str, requested: str = "auto", paged: bool = False,
              no_triton: str | None = None) -> str:
  """The decode attention to run on ``platform`` (see the module docstring; ``paged``: over a
  paged KV cache whose pages the Pallas GPU kernel can read, a multiple of ``PALLAS_GPU_PAGE``
  positions; ``no_triton``: ``triton_unusable``'s reason, where the devices cannot run the Pallas
  GPU kernel)."""
  value = _requested(requested, ATTENTION_ENV, ATTENTION, "decode_attention")
  if value == "auto":
    if platform == "cpu":
      return "cpu" if not cpu_attention.is_disabled() and cpu_attention.available() else "xla"
    if platform == "gpu" and paged and not no_triton:
      return "pallas_gpu"
    return "dense" if platform in ("gpu", "tpu") else "xla"
  if value not in _PLATFORMS.get(platform, ("xla", "dense")):
    raise ValueError(f"decode attention {value!r} cannot run on {platform!r} devices "
                     f"(valid there: {_PLATFORMS.get(platform, ('xla', 'dense'))})")
  if value == "pallas_gpu" and no_triton:
    raise ValueError(f"decode attention 'pallas_gpu' cannot run here: {no_triton} (use 'dense')")
  return value


def platform_here() -> str:
  """The platform of the program being traced: ``lowering_for``'s inside it, else that of the
  active ``sharding.use`` mesh (a learner's or an engine's, also when compiled for another
  machine's devices), else the default backend's."""
  ctx = sharding.current()
  if _LOWERING_FOR.get() is None and ctx is not None:
    return platform_of(ctx[0])
  return platform_of(None)


def causal_attention(requested: str = "auto", head_dim: int = 128) -> tuple[str, bool]:
  """``(impl, interpret)``: the causal attention of whole rows (a training step's, a prefill's;
  ``CAUSAL``, ``kernels.causal_attention``) for the program being traced (``platform_here``), and
  whether its Pallas kernel runs in interpret mode (a CPU device). ``"auto"``: the flash kernels
  on GPU and TPU (``"pallas_gpu"`` where Triton runs: ``triton_unusable``; ``"pallas_tpu"`` for
  the head sizes Mosaic takes), else ``"dense"`` (the model's masked form; every kernel runs on
  CPU, interpreted). Their run time on an accelerator is not measured by this project (no device
  was lent to it): they are chosen there for memory, as a step's dense scores grow with the square
  of its rows' length."""
  platform = platform_here()
  value = _requested(requested, CAUSAL_ENV, CAUSAL, "attention")
  ctx = sharding.current()
  devices = list(ctx[0].devices.flat) if ctx is not None else []
  # why the devices cannot run the platform's kernel (GPUs before Ampere, TPUs before v4)
  held_back = {"pallas_gpu": triton_unusable(devices), "pallas_tpu": mosaic_unusable(devices)}
  interpret = interpret_here()
  if value == "auto":
    value = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "dense")
    if value != "dense" and (held_back[value] or causal_kernels.unusable(value, head_dim,
                                                                         not interpret)):
      value = "dense"
    return value, interpret
  valid = {"gpu": ("dense", "pallas_gpu"), "tpu": ("dense", "pallas_tpu")}.get(platform, CAUSAL)
  if value not in valid:
    raise ValueError(f"causal attention {value!r} cannot run on {platform!r} devices (valid "
                     f"there: {valid})")
  why = held_back.get(value) or causal_kernels.unusable(value, head_dim, not interpret)
  if why:
    raise ValueError(f"causal attention {value!r} cannot run here: {why} (use 'dense')")
  return value, interpret


def pallas_gpu_reads(page_size: int) -> bool:
  """Whether the Pallas GPU paged kernel can read pages of ``page_size`` positions (a multiple of
  ``PALLAS_GPU_PAGE``, its blocks)."""
  return page_size % PALLAS_GPU_PAGE == 0


def kv_pages(platform: str, requested: int, attention_requested: str, slots_split: bool,
             num_slots: int, max_len: int, page_size: int, no_triton: str | None = None) -> int:
  """Pages in an engine's paged KV cache pool (0: no paging, a cache row of ``max_len`` per slot):
  ``requested`` when it is >= 0; for -1 (``"auto"``) a pool of ``num_slots`` x (``max_len`` /
  ``page_size`` rounded up, + 1) pages where the platform reads a paged cache fastest, else 0.
  Paged on GPU, where the decode attention is the platform's to pick (it is then the Pallas GPU
  kernel, ``attention``) or is that kernel, the slots are not split over devices (a paged cache
  is not: ``sampler.pages.check``) and a page is a multiple of 16 positions (the kernel's block).
  Measured on one H100 (``bench/results/h100-2026-11-27-s27``, bfloat16, 16 steps a call, the
  layers unrolled): at the Qwen2.5-1.5B shape (128 slots, context 512) the kernel over the pages
  3.99 ms a step against the dense read over rows 4.97 ms (the floor loop 4.88 ms); at the
  SmolLM2 shape (64 slots, context 128) 1.38 against 1.62 ms (floor 1.60 ms). Over rows the kernel
  measured as the dense read (4.99, 1.60 ms), the dense read over pages slower (5.24 ms).
  The pool is a row's memory per slot and a page more: with that page a slot never waits for
  pages (``sampler.paging``'s page of headroom per live sample, at most a row's pages each), so
  the service admits whenever a cache of rows would and never preempts; it also gives a group's
  samples their prompt's pages once. CPU and TPU keep rows (paging there: not measured faster),
  and so do GPUs that cannot run the kernel (``no_triton``: ``triton_unusable``'s reason).
  ``$AREAL_JAX_PAGED_CACHE`` (``1``/``0``) forces the ``"auto"`` choice either way where the
  slots are not split (tests run the GPU's choice on CPU)."""
  if requested >= 0:
    return requested
  forced = os.environ.get(PAGED_ENV, "")
  if forced not in ("", "0", "1"):
    raise ValueError(f"${PAGED_ENV}={forced!r}: expected 0 or 1")
  attention_value = _requested(attention_requested, ATTENTION_ENV, ATTENTION, "decode_attention")
  wanted = (forced == "1" if forced else platform == "gpu"
            and attention_value in ("auto", "pallas_gpu") and pallas_gpu_reads(page_size)
            and not no_triton)
  if not wanted or slots_split:
    return 0
  return num_slots * (-(-max_len // page_size) + 1)


def pallas_gpu_tuning(spec: str | None = None) -> pallas_attention.PagedTuning:
  """How the Pallas GPU paged-attention kernel is launched (``pallas_attention.PagedTuning``): its
  defaults, as measured on the H100 (1 page a block: the kernel 61 us a layer at the
  Qwen2.5-1.5B shape, ~55% of the read probe's bandwidth for its keys and values,
  ``bench/results/h100-2026-11-27-s27``); the others are not measured yet (``bench/paged_kernel.py``
  times them). ``writes=1`` runs a paged decode step's cache writes and attention as one kernel
  of our own instead (``pallas_paged_step``: 8 kernels a layer against 13 at the SmolLM2 shape,
  compiled for an H100 without one; its run time not measured yet, so it is not the default).
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


def check_attention(impl: str, layers: str, cache_dtype, max_len: int, head_dim: int,
                    paged: bool = False) -> None:
  """Raises ValueError when an engine's decode attention cannot run with its layers (``LAYERS``),
  cache dtype, positions per slot and head size (the Pallas TPU kernel's needs; its head size
  only where it is compiled, not interpreted); over a paged cache (``paged``) the kernel reads the
  pages whatever the layers."""
  if impl == "pallas_tpu" and (why := pallas_tpu_attention.unusable(
      "scan" if paged else layers, cache_dtype, max_len, head_dim, compiled=not interpret())):
    raise ValueError(f"decode attention 'pallas_tpu' cannot run here: {why}")


def reads_to_bound(impl: str, layers: str, max_len: int, paged: bool = False) -> bool:
  """Whether decode attention ``impl`` reads every row up to the static kv bound (so a step's cost
  follows the kv bucket and several buckets pay): the dense read, and the Pallas GPU kernel where
  it splits the bound into parts (a per-layer cache, or positions that do not split into pages);
  over a paged cache every form but the Pallas kernels (which read the pages in place) gathers
  the pages up to it. The others read each row up to its own position."""
  if paged:
    return impl not in ("pallas_gpu", "pallas_tpu")
  if impl == "pallas_gpu":
    return layers != "scan" or not pallas_attention.stacked_usable(max_len)
  return impl == "dense"


def matmul(mesh: Mesh, compute_dtype, requested: str = "auto") -> str:
  """The decode matmuls of an engine on ``mesh`` computing in ``compute_dtype``."""
  value = _requested(requested, MATMUL_ENV, MATMUL, "decode_matmul")
  packable = cpu_matmul.enabled(mesh, compute_dtype)
  platform = platform_of(mesh)
  if value == "auto":
    return "cpu_packed" if packable else "blas" if platform == "gpu" else "xla"
  if value == "cpu_packed" and not packable:
    raise ValueError("decode matmul 'cpu_packed' needs one CPU device with AVX-512, float32 compute "
                     f"(model dtype {jnp.dtype(compute_dtype).name}) and the kernel built")
  if value == "blas" and platform != "gpu":
    raise ValueError(f"decode matmul 'blas' (the GPU vendor library's GEMMs) cannot run on "
                     f"{platform!r} devices; use 'xla' or 'auto' there")
  return value


def compiler_options(matmul_impl: str) -> dict[str, bool] | None:
  """XLA options for the sampler's programs that run matmuls (prefill, generate, continuation),
  given to ``jax.jit(compiler_options=...)``: per program, so the learner's and everyone else's
  programs keep the process's flags."""
  if matmul_impl != "blas":
    return None
  # Triton GEMMs off, and no autotuning: the library's own heuristics pick each GEMM's algorithm
  return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


def heads_major_per_layer(attention_impl: str, platform: str) -> bool:
  """Whether the unrolled layers' per-layer cache is held heads before positions for
  ``attention_impl`` on ``platform``: the forms that read that layout in place (the dense read, the
  Pallas GPU kernel's ``mqa``); compiled for a GPU the positions-first cache is copied into
  heads-major order on entering each decode call and back on leaving it
  (``bench/aot_cache_layout.py``). The CPU and chunked forms read positions first; so does a TPU:
  compiled for a TPU v5e chip, the positions-first cache written by one scatter a layer
  (:func:`scatter_cache_writes`) is neither copied nor looped over, the heads-major one written so
  is copied (354 MB a step at the Qwen2.5-1.5B shape)."""
  return attention_impl in ("dense", "pallas_gpu") and platform != "tpu"


def scatter_cache_writes(platform: str) -> bool:
  """Whether a decode step over every slot writes each layer's new keys and values with one
  scatter (``Transformer.extend``'s ``scatter_writes``) rather than a per-row update (a ``vmap`` of
  ``dynamic_update_slice``): on TPU, whose compiler turns the per-row update into a loop over the
  rows (compiled for a TPU v5e chip at the Qwen2.5-1.5B shape: ~57,600 operations a step against
  285 with the scatter, ``bench/aot_cache_layout.py``). CPU and GPU keep the per-row update (on a
  GPU the compiled step shows no loop for it: 481 operations a step at that shape)."""
  return platform == "tpu"


def vocab_major_logits(platform: str) -> bool:
  """Whether the sampler's decode programs produce the logits with the vocabulary axis major
  (``ModelConfig.vocab_major_logits``: the LM head as head weight x activations) and take each
  slot's block of the vocabulary by a masked sum rather than a gather (``sampling.sample``'s
  ``select_by_mask``): on TPU, whose compiler otherwise relays out the float32 logits twice a
  step, once for the reductions over the vocabulary and once for the gather (compiled for a TPU
  v5e chip at the Qwen2.5-1.5B shape, 128 slots: 2 x 78 MB copied a step; with both, neither,
  ``bench/aot_decode.py``). CPU and GPU keep the gather and the activations x head form (their
  compiled steps copy neither)."""
  return platform == "tpu"


def held_layouts(platform: str) -> str:
  """Whether the sampler holds its weights and decode state in the layouts its widest decode
  program picks (``"compiler"``: compiled once with ``Layout.AUTO``, then every program takes and
  returns them so) or in the default ones (``"default"``): the compiler's on TPU, whose compiler
  otherwise relays them out on entering and leaving each decode call (compiled for a TPU v5e chip,
  ``bench/aot_decode.py --held-layouts default,compiler``: at the Qwen2.5-1.5B shape the gate_up
  and qkv weights, 145 -> 38 MB copied a step; at the SmolLM2 shape, head size 64, each layer's cache, 104 -> 21
  MB); the default ones on CPU and GPU (their compiled steps copy neither: the layouts there are
  the default ones). ``$AREAL_JAX_HELD_LAYOUTS`` forces either (tests run the compiler's on CPU,
  where it picks the default ones)."""
  value = os.environ.get(HELD_LAYOUTS_ENV, "") or ("compiler" if platform == "tpu" else "default")
  if value not in HELD_LAYOUTS:
    raise ValueError(f"${HELD_LAYOUTS_ENV}={value!r}: expected one of {HELD_LAYOUTS}")
  return value


def layers(platform: str, matmul_impl: str, requested: str = "auto", paged: bool = False,
           attention_impl: str = "") -> str:
  """How a decode step runs the layers (``LAYERS``) on ``platform`` with ``matmul_impl`` matmuls
  (``paged``: over a paged KV cache; the ``attention_impl`` ``"pallas_tpu"`` without one reads
  the scan's stacked cache, so it needs the scan)."""
  value = _requested(requested, LAYERS_ENV, LAYERS, "decode_layers")
  if value == "auto":
    if platform == "cpu" or matmul_impl == "cpu_packed":
      return "unrolled"
    return "scan" if attention_impl == "pallas_tpu" and not paged else "unrolled"
  if value == "scan" and matmul_impl == "cpu_packed":
    raise ValueError("decode_layers 'scan' needs XLA matmuls (decode_matmul='xla'): the CPU "
                     "kernel's packed weights are per layer")
  return value


def projections(mesh: Mesh, cfg, requested: str = "auto") -> str:
  """Whether an engine on ``mesh`` holds ``cfg``'s model with fused projections (``PROJECTIONS``).
  A model already built fused (``cfg.fused_projections``) stays fused."""
  value = _requested(requested, PROJECTIONS_ENV, PROJECTIONS, "decode_projections")
  if cfg.fused_projections:
    if value == "separate":
      raise ValueError("decode_projections 'separate' needs a model built with separate "
                       "projections (this one has fused_projections=True)")
    return "fused"
  if value != "auto":
    return value
  whole_heads = cfg.n_kv_heads % mesh.shape.get("tensor", 1) == 0
  return "fused" if whole_heads and platform_of(mesh) in ("gpu", "tpu") else "separate"


_MATMULS: contextvars.ContextVar[str | None] = contextvars.ContextVar("matmuls", default=None)


@contextlib.contextmanager
def matmuls(matmul_impl: str):
  """Inside it (the trace of a program compiled with ``compiler_options(matmul_impl)``), the
  kernels know how that program's matmuls run (``MATMUL``): what ``query_rows`` reads."""
  token = _MATMULS.set(matmul_impl)
  try:
    yield
  finally:
    _MATMULS.reset(token)


def query_rows(cache_dtype) -> int:
  """The multiple the dense decode attention pads each K/V head's group of queries to (zero
  queries, whose rows it drops): 8 for a 16-bit cache inside ``matmuls("blas")``, else 1.
  XLA's GPU compiler pads a 16-bit matmul's dimensions to multiples of 8 for the vendor library's
  GEMMs; with a query group of fewer rows (GQA: SmolLM2's 3, Qwen2.5-1.5B's 6) the probabilities x
  values matmul then gets a padded copy of the probabilities, every layer and step. Padded in the
  queries instead, the padding joins the queries' own fusion (rotary embedding, scale, cast) and
  the softmax writes the probabilities already padded: compiled for an H100 with ``"blas"``
  (``bench/aot_decode.py``, the layers unrolled), at the SmolLM2 shape (64 slots, context 128)
  482 -> 452 launches a step and 35.4 -> 0.1 MB copied; at the Qwen2.5-1.5B shape (128 slots,
  context 512) 481 -> 453 and 88.7 -> 0.6 MB. Its price, the softmax reading and writing the
  padding rows, is by the shapes smaller than the copy it replaces at the 1.5B shape's group of 6
  and ~4% of what a step reads at SmolLM2's group of 3. Not with XLA's own (Triton) GEMMs, which
  take the group as it is (there the padding added 30 launches a step at the SmolLM2 shape), nor
  on TPU (compiled for a v5e chip at the SmolLM2 shape it copied 23.1 MB a step against 20.9 MB
  unpadded) or CPU. Run time on an H100 (SmolLM2 shape, ``"blas"``, session 27): padded 1.75 and
  1.62 ms a step in two processes, unpadded 1.65 ms in a third: no difference beyond that noise.
  ``$AREAL_JAX_DECODE_QUERY_ROWS`` forces the multiple (1: no padding), read when a program is
  traced (set it before the process builds its engines: compiled programs are shared by engines of
  one configuration)."""
  forced = os.environ.get(QUERY_ROWS_ENV, "")
  if forced:
    if not forced.isdigit() or int(forced) < 1:
      raise ValueError(f"${QUERY_ROWS_ENV}={forced!r}: expected a positive integer")
    return int(forced)
  return 8 if _MATMULS.get() == "blas" and jnp.dtype(cache_dtype).itemsize == 2 else 1


def norm_matmuls(platform: str, one_device: bool, spec: str | None = None,
                 no_triton: str | None = None) -> pallas_norm_matmul.NormTuning | None:
  """How a decode program runs each RMSNorm with the matmul after it (``pallas_norm_matmul``: the
  norm and the q/k/v projection as one Pallas GPU kernel, the norm, the gate/up projection and
  SwiGLU as another; 3 kernels a layer fewer), or None: as written (a norm kernel, a GEMM, a
  SwiGLU kernel). Off unless asked: compiled for an H100 without one, its run time is not measured
  yet. ``$AREAL_JAX_DECODE_NORM_MATMUL`` (``spec``: the same syntax instead): ``1``, or the
  launch's fields (``block_n=32,warps=8,stages=3``); ``0`` or unset: off. Taken on a GPU, and on
  a CPU in Pallas interpret mode (tests), by an engine over one device (the kernel is not split
  over a mesh); read when an engine is built. Asked on GPUs that cannot run it (``no_triton``:
  ``triton_unusable``'s reason), it raises ValueError."""
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


DECODE_TUNING = ("auto", "off")
GRAPHS = ("", "while", "unrolled")
# XLA's own default: autotune, with the buffers initialized and reinitialized, results checked
AUTOTUNE_LEVEL = 4
# XLA's GPU command buffers (CUDA graphs) by default, as of jax 0.10-0.11: sequences of these
# thunks outside loops; a launch's ``graphs`` adds the decode call's loop over its steps
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"


@dataclasses.dataclass(frozen=True)
class Launch:
  """How a decode program is launched: ``norms`` (``norm_matmuls``: each RMSNorm with the matmul
  after it, or None), ``paged`` (``pallas_gpu_tuning``), ``graphs`` (``GRAPHS``: on a GPU the
  call's loop over its steps captured in XLA's command buffers too, ``"while"`` as a CUDA graph
  loop node, ``"unrolled"`` unrolled into one graph; ``""``: XLA's defaults) and ``matmul`` (the
  decode program's matmuls, ``MATMUL``; ``""``: the engine's, ``matmul``), ``autotune``: the
  vendor library's GEMMs (``"blas"``) with XLA's autotuning on, which times the library's
  algorithms for each GEMM of the program when it compiles instead of taking its heuristics'
  first (XLA's Triton GEMMs stay off)."""
  norms: pallas_norm_matmul.NormTuning | None
  paged: pallas_attention.PagedTuning
  graphs: str = ""
  matmul: str = ""
  autotune: bool = False

  def compiler_options(self) -> dict:
    """The XLA options ``graphs`` and ``autotune`` add to a decode program's
    (``compiler_options``)."""
    options = {"xla_gpu_autotune_level": AUTOTUNE_LEVEL} if self.autotune else {}
    if not self.graphs:
      return options
    options["xla_gpu_enable_command_buffer"] = COMMAND_BUFFERS + ",WHILE,CONDITIONAL"
    if self.graphs == "unrolled":
      options["xla_gpu_command_buffer_unroll_loops"] = True
    return options

  @property
  def name(self) -> str:
    """The fields that differ from the defaults, as the environment would force them:
    ``$AREAL_JAX_PALLAS_GPU_PAGED``'s, then ``norms`` (``$AREAL_JAX_DECODE_NORM_MATMUL``'s
    fields after a colon where they differ from its defaults), ``graphs``, ``autotune``,
    ``matmul=`` (``$AREAL_JAX_DECODE_MATMUL``'s); ``"default"`` for none."""
    def changed(obj):
      return [f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in dataclasses.fields(obj)
              if (v := getattr(obj, f.name)) != f.default]
    parts = [",".join(changed(self.paged))] if changed(self.paged) else []
    if self.norms is not None:
      parts.append(":".join(["norms", ",".join(changed(self.norms))] if changed(self.norms)
                            else ["norms"]))
    if self.graphs:
      parts.append("graphs" + (":unrolled" if self.graphs == "unrolled" else ""))
    if self.autotune:
      parts.append("autotune")
    if self.matmul:
      parts.append(f"matmul={self.matmul}")
    return "+".join(parts) or "default"


def launch_stages(platform: str, requested: str, *, paged_pallas: bool, one_device: bool,
                  group: int, page_size: int, head_dim: int,
                  norm_dims: tuple[tuple[int, int], ...], no_triton: str | None = None,
                  matmul_open: bool = False, blas: bool = False
                  ) -> list[Callable[[Launch], list[Launch]]]:
  """The stages of launches an engine times before it decodes (``sampler.launch_tuning``): each
  is given the launch kept so far (first the engine's own) and returns it first, then what may
  replace it; the fastest is kept. ``requested`` (``rollout.decode_tuning``): ``"auto"`` on a GPU
  offers, each where its environment variable leaves it open:

  1. our paged step kernel (``writes``, where the engine's decode attention is ``pallas_gpu`` over
     pages, ``paged_pallas``, at a shape it takes), and it with its scores and output as
     tensor-core dots (``dot``, where ``pallas_paged_step.dot_usable``: on an H100 in session 27
     the attention read the 1.5B shape's cache at about half the read probe's bandwidth; on an
     H200 in session 48 the engine kept ``writes=1,dot=1`` at both decode shapes, 1.41x and
     1.33x JAX's kernel's step), then the last of those with Triton's loop unpipelined
     (``stages=1``: JAX's kernel read a layer 1.4-1.7x faster so on that H200,
     ``bench/results/h200-2026-11-30-s48``), reading two pages a step of its loop
     (``block_pages``: their loads issued together, for rows of a few pages whose attention is
     bound by the latency of one page's loads after another; at the SmolLM2 shape on that H200 a
     layer's attention took 18.7 us to read 6.3 MB), and in 4 warps a program (``warps``). On an
     H200 in session 51 (``bench/results/h200-2026-11-30-s51``) none of the three beat
     ``writes=1,dot=1`` at the SmolLM2 shape; at the 1.5B shape ``warps=4`` read a layer in 34.4 us
     against 39.4, and the engine kept it (2.44 against 2.51 ms a step). Four pages a step,
     offered until then, was slower at both shapes (1.02 / 2.85 ms against 0.99 / 2.50);
  2. the fused norms (``norms``: an engine over one device, ``norm_dims`` the ``(inputs,
     outputs)`` of the matmuls after its norms, one of which the kernel takes), with programs of
     16 output columns and with its default's (on H200s, sessions 48 and 51, 1.3-2.6x slower
     than the launch before them at both shapes: never kept there);
  3. the decode call's loop in CUDA graphs (``graphs_to_time``);
  4. where the engine's decode matmuls are the vendor library's (``blas``), the same with XLA's
     autotuning picking each GEMM's algorithm (``autotune``: with ``blas`` XLA takes the
     library's heuristics' first; at the 1.5B shape on an H200 in session 51 those GEMMs read
     the output and down projections' weights at 0.37 of the read probe, q/k/v's at 0.25,
     gate/up's at 0.78, the whole step 0.48; timed there, ``autotune`` ran 2.40 / 2.43 ms a step
     against 2.44 / 2.49, under the 3% ``sampler.launch_tuning`` asks), and
     XLA's own GEMMs, autotuned, for the decode program (``matmul="xla"``), where the engine's
     are ``"blas"`` by default (``matmul_open``: neither ``rollout.decode_matmul`` nor
     ``$AREAL_JAX_DECODE_MATMUL`` names them). Measured on an H100 in session 27 (layers
     unrolled, rows): SmolLM2 shape ``"xla"`` 1.38-1.50 ms a step against ``"blas"`` 1.62-1.75;
     1.5B shape 5.10 against 5.08 ms, its program compiled in 8.4 s with the autotuning. Last,
     as their compiles autotune (XLA's GEMMs: minutes a program at the 1.5B shape on an H200
     with jax 0.11.2): the stages before them are timed whatever it costs.

  1 and 2 need Triton (``no_triton``: why not). ``"off"``, CPU and TPU: none."""
  if requested not in DECODE_TUNING:
    raise ValueError(f"rollout.decode_tuning={requested!r} is not one of {DECODE_TUNING}")
  if requested == "off" or platform != "gpu":
    return []
  stages = []
  if (not no_triton and paged_pallas and pallas_paged_step.usable(group, page_size, head_dim)
      and not os.environ.get(PAGED_TUNING_ENV, "").strip()
      and not os.environ.get(BLOCK_PAGES_ENV, "").strip()):
    dots = pallas_paged_step.dot_usable(page_size, head_dim)

    def paged_step(kept: Launch) -> list[Launch]:
      writes = dataclasses.replace(kept.paged, writes=True)
      offers = [writes] + ([dataclasses.replace(writes, dot=True)] if dots else [])
      # the last, unpipelined, reading two pages a step of its loop, and in 4 warps a program
      last = offers[-1]
      offers += [dataclasses.replace(last, stages=1), dataclasses.replace(last, block_pages=2),
                 dataclasses.replace(last, warps=4)]
      return [kept] + [dataclasses.replace(kept, paged=p) for p in offers]
    stages.append(paged_step)
  if (not no_triton and one_device and os.environ.get(NORM_MATMUL_ENV, "").strip() in ("", "0")
      and any(pallas_norm_matmul.usable(*d) for d in norm_dims)):
    # (programs of 16 output columns: 4x the programs of the default's 64 at a decode step's
    # rows, 60 for SmolLM2's q/k/v, where the default's 15 leave most of a GPU's cores idle)
    stages.append(lambda kept: [kept] + [dataclasses.replace(kept, norms=n) for n in (
        pallas_norm_matmul.NormTuning(block_n=16), pallas_norm_matmul.NormTuning())])
  if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    stages.append(graphs_to_time)
  if blas or matmul_open:
    stages.append(lambda kept: [kept] + ([dataclasses.replace(kept, autotune=True)] if blas else [])
                  + ([dataclasses.replace(kept, matmul="xla")] if matmul_open else []))
  return stages


def matmul_open(matmul_impl: str, requested: str) -> bool:
  """Whether an engine's decode matmuls ``matmul_impl`` are the GPU default ``"blas"`` that
  neither ``requested`` (``rollout.decode_matmul``) nor ``$AREAL_JAX_DECODE_MATMUL`` names: XLA's
  own are then timed against them (``launch_stages``)."""
  return matmul_impl == "blas" and _requested(requested, MATMUL_ENV, MATMUL,
                                               "decode_matmul") == "auto"


def graphs_to_time(kept: Launch) -> list[Launch]:
  """``kept``, then the same with its decode call's loop over the steps in XLA's command buffers
  (CUDA graphs; ``Launch.graphs``). A SmolLM2 decode step is ~390 small kernels on
  an H100 (bound by their launches, session 27); XLA puts runs of them (cuBLAS GEMMs and custom
  calls too, with a CUDA 12.3+ driver) in graphs of their own, but each step of the loop is
  launched by the host. XLA captures a loop only if its whole body converts, and ours writes each
  step's outputs at a slice that depends on the step, which XLA takes in a graph only unrolled
  (``"unrolled"``; and CUDA 12.9+ for that slice's child commands); ``"while"`` is timed too, as
  other XLA versions may differ. The loop's steps in a graph were timed once, with a conditional
  in the step, on an H200 (no change, session 26), never since; a compile without a GPU cannot
  show it (XLA sees no driver and drops these command types:
  ``bench/results/cpu-aot-h100-graphs-2026-11-30-s42``)."""
  if kept.graphs:
    return [kept]
  return [kept] + [dataclasses.replace(kept, graphs=g) for g in GRAPHS[1:]]


def truncation_on_host(platform: str) -> bool:
  """Whether the sampler's engine decides on the host whether a decode call's slots truncate
  (top-k / top-p: ``sampling.sample``'s ``truncate``, from its own copy of the slots' parameters),
  compiling a program for each answer, rather than in the step (a ``lax.cond``, one program). On
  GPU: XLA's GPU runtime runs a conditional by copying its predicate to the host and waiting for
  it, so every step of a multi-step call the host waited for the device to finish the step's
  forward before it launched the rest and the next step, the device idle meanwhile (the only such
  wait in the step: the loop over the steps has a known trip count). In the profile of 16-step
  calls on an H100 (``bench/results/h100-2026-11-27-s27``, Qwen2.5-1.5B shape, paged), the device
  sat idle 0.57 ms a step at each step's start while the host launched that step's CUDA graph
  (under the profiler, which slows launches: the cost without it is not measured). A TPU runs its
  conditionals on the device and a CPU's are the host's anyway: both keep one program (the
  second would cost its compile time). ``$AREAL_JAX_TRUNCATION_ON_HOST`` (``1`` / ``0``) forces
  it; read when an engine is built."""
  forced = os.environ.get(TRUNCATION_ENV, "")
  if forced not in ("", "0", "1"):
    raise ValueError(f"${TRUNCATION_ENV}={forced!r}: expected 1 or 0")
  return forced == "1" if forced else platform == "gpu"


def steps_per_call(platform: str) -> int:
  """Decode steps per jitted call (per host sync) when the config leaves it at 0: 1 on CPU, where
  a step is long against the host's work and every extra step a finished slot idles costs a full
  step; 16 on GPU and TPU, where a step is short enough for the host sync to show."""
  return 1 if platform == "cpu" else 16
