"""The one place that picks the platform kernels (the sampler's decode, whole rows' attention).

A request other than ``"auto"`` (an engine's config) wins; else ``$AREAL_JAX_DECODE_ATTENTION`` /
``$AREAL_JAX_DECODE_MATMUL`` / ``$AREAL_JAX_DECODE_LAYERS`` / ``$AREAL_JAX_DECODE_PROJECTIONS``
when set; else the platform's default, as below. The runs quoted are in ``bench/results/``.

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
    missing); Pallas TPU interpret mode on a CPU device (tests). Not the TPU default: it has not
    been measured on a TPU yet, so TPU keeps the dense read.

Decode matmuls (``MATMUL``): ``"cpu_packed"`` (weights packed once per version for the C++ kernel,
``cpu_matmul``: one CPU device, float32, AVX-512), ``"xla"`` (XLA's own matmuls; on a GPU it
autotunes its Triton GEMMs against the vendor library's per program at compile time) or ``"blas"``
(GPU only: XLA with its Triton GEMM emitter and its autotuning off for the sampler's programs,
``compiler_options``: every matmul a call of the vendor library, cuBLAS or hipBLASLt, whose own
heuristics pick each GEMM's algorithm). ``"blas"`` is the GPU default, for compile time: XLA's
autotuning of one decode program at the Qwen2.5-1.5B shape takes minutes (on an H200, jax 0.11.2),
``"blas"`` compiles it in seconds and ran that shape's step as fast (5.08 against 5.10 ms on an
H100, ``bench/results/h100-2026-11-27-8a1f9a5``; XLA's GEMMs were faster at the SmolLM2 shape). So
where ``"blas"`` is the default, a GPU engine also times XLA's GEMMs for its decode program before
its first decode (``launch_stages``, ``Launch.matmul``).

Decode layers (``LAYERS``): ``"scan"`` (the layers in one ``lax.scan`` over a stacked view of the
weights and a stacked cache, ``models/decode_scan``: compile time flat in depth) or ``"unrolled"``
(``Transformer.extend``, one traced body per layer, per-layer caches). ``"scan"`` needs XLA matmuls
(the CPU kernel's packed weights are per layer); a paged KV cache runs with either
(``decode_scan.extend_unrolled``: the per-layer weights over the pools). The default is
``"unrolled"`` everywhere (``"scan"`` for the Pallas TPU kernel without pages): in a scan, XLA:GPU
copies each layer's slice of the stacked weights and its keys and values into buffers of their own
every layer of every step (5.4 GB a step at the Qwen2.5-1.5B shape, compiled for an H100, against
0.6 MB unrolled: ``bench/results/cpu-aot-h100-2026-11-27``), and XLA:TPU relays them out the same
way (5.2 GB against 0.3 GB for a TPU v5e: ``bench/results/cpu-aot-tpu-v5e-2026-11-27``); the
unrolled step also ran faster on an H100 (``bench/results/h100-2026-11-27-8a1f9a5``). A TPU's
per-layer cache is held positions first and written by one scatter a layer
(``heads_major_per_layer``, ``scatter_cache_writes``). The price of unrolling: the decode
program's compile time grows with depth (~0.1 s a layer for an H100, ~0.25 s for a TPU v5e, where
the scan's stays flat: ``bench/results/cpu-aot-depth-2026-11-27``), once per (kv bucket, width)
program an engine uses; ``decode_layers="scan"`` keeps it flat for very deep models, at the copies
above.

Decode projections (``PROJECTIONS``): ``"fused"`` (the engine holds q, k, v as one weight and gate,
up as one, ``transformer.fuse_projections``: three matmuls a layer fewer, each of the rest reading
the same bytes as the ones it replaces) or ``"separate"`` (the model's own layout). ``"auto"``:
fused on GPU and TPU wherever the mesh's tensor axis divides the KV heads (fused weights then split
over it in whole KV heads, as the separate ones do), separate on CPU. Why on GPU: XLA's GPU
compiler merges sibling matmuls that share an input (its ``DotMerger`` pass, operands up to
``--xla_gpu_dot_merger_threshold_mb``, 32 MB by default) into one against a concatenation of
their weights made inside the program, so each execution copies those weights (~1.7 GB a step at
the Qwen2.5-1.5B shape next to the 5 GB it must read; separate 6.47 against fused 5.05 ms a step
on an H100, ``bench/results/h100-2026-11-27-8a1f9a5``). Weights fused once per version leave nothing
to merge. XLA:CPU does not merge them and the two layouts measured the same there, so the CPU
keeps the model's.

Decode norms (``norm_matmuls``): with fused projections, each RMSNorm of a decode step can run in
one Pallas GPU kernel with the matmul after it (``pallas_norm_matmul``; the model asks
``fused_norms`` inside the engine's ``fusing_norms``). Off unless ``$AREAL_JAX_DECODE_NORM_MATMUL``
asks or the engine's timing keeps it.

Decode launches timed (``rollout.decode_tuning``): on a GPU, launches that are off by default
are timed against the engine's own before it decodes (``kernels.decode_launch``: ``Launch``,
``launch_stages``); CPU and TPU keep the engine's own launch.

Top-k / top-p (``truncation_on_host``): on GPU the engine picks, on the host, a decode program
with the vocabulary's sort or one without it, so no step holds a conditional (each a wait for the
host there); on CPU and TPU one program decides it in the step.

``"auto"`` in short: on CPU the C++ kernels when they build (else XLA's forms) and the layers
unrolled; on GPU a paged KV cache where the service keeps page tables (``kv_pages`` -1, the
default of ``rollout.kv_pages``) read in place by ``"pallas_gpu"``, ``"dense"`` over a cache of
rows, ``"blas"`` matmuls and the layers unrolled (on GPUs older than Ampere, a T4 or a V100, which
cannot run Pallas's Triton kernels, ``triton_unusable``: rows and ``"dense"``); on TPU
``"dense"``, ``"xla"`` matmuls and the layers unrolled. The Pallas kernel reads the pages in place
at any kv bound and each row only up to its own length, where the dense read reads every row up to
the bucket above the furthest slot, and at some bounds XLA pads each layer's cache for cuBLAS by a
copy every step (``bench/results/h100-2026-11-27-8a1f9a5``).

Causal attention of whole rows (``CAUSAL``, ``causal_attention``): a training step's over packed
rows and a prefill's. ``"auto"``: on GPU and TPU the flash kernels JAX ships (``"pallas_gpu"``,
``"pallas_tpu"``), which never hold a row's ``L x L`` scores; on CPU (and on GPUs without Triton,
TPUs before v4, or head sizes Mosaic refuses: ``mosaic_unusable``) ``"dense"``, the model's masked
form. Chosen for memory, not speed: compiled for TPU v5e chips, the default recipe's train step
with 16k new tokens needs 29.66 GiB a chip with the dense form against 16.85 GiB with the kernel
(``bench/results/plan-flash-2026-11-29-df89801``); their run time on an accelerator is not measured
yet. ``actor.attention`` and ``rollout.prefill_attention`` request one
(``$AREAL_JAX_CAUSAL_ATTENTION`` where they say auto); the platform is that of the program being
traced (``platform_here``: the mesh in use).

Attention across a context-parallel mesh (``CONTEXT``, ``context_attention``): when the learner
mesh's ``context`` axis splits each row's positions (``kernels.context_attention``). ``"auto"``:
on every platform ``"ulysses"`` (positions exchanged for heads by an all-to-all, then the whole-row
attention above: the flash kernel on GPU and TPU) where the query heads divide over tensor x
context, else ``"ring"`` (keys and values passed around the context axis, each block merged by
online softmax in XLA ops). Ulysses is preferred because it keeps the platform's flash kernel and
moves each layer's queries, keys and values once, where the ring moves the keys and values
``context - 1`` times; the ring is the fallback for head counts Ulysses cannot split. Both are
exact (``tests/learner/test_context_parallel.py``). Timed on 8 CPU devices sharing 2 cores, Ulysses
took less time than the ring (a gradient over rows of 1024 at context 2: 2.4 against 8.7 s;
``bench/results/context-parallel-cpu-2026-12-05-e7f3134``); on accelerators neither is measured yet.
``actor.context_attention`` requests one.

Platforms and lowering for another one: ``kernels.platforms``; how the decode state is held per
platform: ``kernels.decode_layouts``; the Pallas GPU kernels' launch settings:
``kernels.pallas_launch``; the launches timed: ``kernels.decode_launch``. Every name of those
modules is importable from here.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from jax.sharding import Mesh

from areal_jax import sharding
from areal_jax.kernels import (causal_attention as causal_kernels, context_attention as
                               context_kernels, cpu_attention, cpu_matmul, pallas_attention,
                               pallas_tpu_attention)
# re-exported: callers import these from here
from areal_jax.kernels.decode_launch import (  # noqa: F401
    AUTOTUNE_LEVEL, COMMAND_BUFFERS, DECODE_TUNING, GRAPHS, Launch, graphs_to_time, launch_stages)
from areal_jax.kernels.decode_layouts import (  # noqa: F401
    _MATMULS, HELD_LAYOUTS, HELD_LAYOUTS_ENV, QUERY_ROWS_ENV, heads_major_per_layer, held_layouts,
    matmuls, query_rows, scatter_cache_writes, vocab_major_logits)
from areal_jax.kernels.pallas_launch import (  # noqa: F401
    _LAUNCH, _NORM_MATMULS, BLOCK_PAGES_ENV, NORM_MATMUL_ENV, PAGED_TUNING_ENV, _launch,
    fused_norms, fusing_norms, launching, norm_matmuls, pallas_gpu_tuning)
from areal_jax.kernels.platforms import (  # noqa: F401
    _LOWERING_FOR, GPU_TARGET_KIND, MOSAIC_MIN_TPU, TRITON_MIN_CAPABILITY, _capability, _family,
    _tpu_generation, _triton_device_kind, interpret_here, lower, lowering_for, mosaic_unusable,
    platform_of, triton_unusable)

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
CONTEXT = context_kernels.IMPLS
PAGED_ENV = "AREAL_JAX_PAGED_CACHE"
TRUNCATION_ENV = "AREAL_JAX_TRUNCATION_ON_HOST"
PALLAS_GPU_PAGE = 16  # positions a page of the Pallas GPU kernel is a multiple of (its blocks)
_PLATFORMS = {"cpu": ("cpu", "xla", "dense", "pallas_gpu", "pallas_tpu"),
              "gpu": ("xla", "dense", "pallas_gpu"), "tpu": ("xla", "dense", "pallas_tpu")}


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
  CPU, interpreted). They are chosen there for memory, as a step's dense scores grow with the
  square of its rows' length (their run time on an accelerator is not measured yet)."""
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


def context_attention(requested: str, n_heads: int, length: int) -> str:
  """The attention across a context-parallel mesh (``CONTEXT``) for rows of ``length`` positions
  and ``n_heads`` query heads under the active ``sharding.use`` mesh: ``"ulysses"`` where the heads
  divide over tensor x context, else ``"ring"`` (see the module docstring; the same rule on every
  platform). A requested ``"ulysses"`` the heads cannot take is refused, naming why."""
  fits = context_kernels.ulysses_fits(n_heads, length)
  if requested == "auto":
    return "ulysses" if fits else "ring"
  if requested not in CONTEXT:
    raise ValueError(f"actor.context_attention={requested!r} is not one of {('auto',) + CONTEXT}")
  if requested == "ulysses" and not fits:
    mesh = sharding.current()[0]
    raise ValueError(f"actor.context_attention='ulysses' needs the {n_heads} query heads divisible "
                     f"by mesh.learner.tensor x mesh.learner.context (mesh {dict(mesh.shape)}); "
                     "use 'ring' or 'auto'")
  return requested


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
  is not: ``sampler.pages.check``) and a page is a multiple of 16 positions (the kernel's block):
  the kernel over pages ran a Qwen2.5-1.5B-shape step in 3.99 ms on an H100 against the dense
  read over rows' 4.97 ms (``bench/results/h100-2026-11-27-8a1f9a5``; over rows the kernel ran as the
  dense read, and the dense read over pages slower). The pool is a row's memory per slot and a
  page more: with that page a slot never waits for pages (``sampler.paging``'s page of headroom
  per live sample, at most a row's pages each), so the service admits whenever a cache of rows
  would and never preempts; it also gives a group's samples their prompt's pages once. CPU and TPU keep rows (paging there: not measured faster),
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


def matmul_open(matmul_impl: str, requested: str) -> bool:
  """Whether an engine's decode matmuls ``matmul_impl`` are the GPU default ``"blas"`` that
  neither ``requested`` (``rollout.decode_matmul``) nor ``$AREAL_JAX_DECODE_MATMUL`` names: XLA's
  own are then timed against them (``launch_stages``)."""
  return matmul_impl == "blas" and _requested(requested, MATMUL_ENV, MATMUL,
                                               "decode_matmul") == "auto"


def truncation_on_host(platform: str) -> bool:
  """Whether the sampler's engine decides on the host whether a decode call's slots truncate
  (top-k / top-p: ``sampling.sample``'s ``truncate``, from its own copy of the slots' parameters),
  compiling a program for each answer, rather than in the step (a ``lax.cond``, one program). On
  GPU: XLA's GPU runtime runs a conditional by copying its predicate to the host and waiting for
  it, so every step of a multi-step call the host waited for the device to finish the step's
  forward before it launched the rest and the next step, the device idle meanwhile (the only such
  wait in the step: the loop over the steps has a known trip count; in an H100's profile the
  device sat idle at each step's start, ``bench/results/cpu-aot-h100-2026-11-29-220bbd8``). A TPU
  runs its conditionals on the device and a CPU's are the host's anyway: both keep one program
  (the second would cost its compile time). ``$AREAL_JAX_TRUNCATION_ON_HOST`` (``1`` / ``0``) forces
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
