"""Device side of the sampler: fixed decode slots, a KV cache per slot, JetStream-style calls.

JetStream's engine calls, ``prefill``, ``insert``, ``generate`` and ``move``, are in
``decode_calls`` (a mixin of ``DecodeEngine``); this module builds the engine: its kernels per
platform, its weights' and state's placement and layouts, and the cache of compiled programs.

A slot holds the *next token to feed* and its position: a prefill covers ``prompt[:-1]`` and the first
decode step feeds the last prompt token, so every generated token (and its logprob and version)
comes out of ``generate``. Re-prefilling a sequence under new weights is the same: prefill
``prompt + generated[:-1]`` and feed the last generated token.

Layout: the cache is ``[slots, max_len, kv_heads, head_dim]`` per layer (``slot_cache``; heads
before positions, ``[slots, kv_heads, max_len, head_dim]``, under the dense and Pallas GPU decode
attention on a GPU, which read that layout in place: ``cache_layout``; on a TPU each layer's new
keys and values are written by one scatter, ``choice.scatter_cache_writes``), slots
sharded over the mesh's data axis and heads over its tensor axis; per-slot vectors are sharded like
the slots. With ``decode_layers`` ``"scan"`` (the default for the Pallas TPU kernel without a
paged cache, ``kernels.choice.layers``)
the layers run in one ``lax.scan`` (``models/decode_scan``: prefill and decode compile one layer
body whatever the depth): the engine holds the layers' weights stacked ``[n_layers, ...]`` (built
once per weight version in ``put_params``) and the cache stacked ``[n_layers, slots, kv_heads,
max_len, head_dim]`` (heads before positions, so decode attention reads it without a transposed
copy). Paged (``kv_pages > 0``, or -1 where the platform picks paging, ``choice.kv_pages``:
on GPU; slots not split over devices; the layers unrolled, over the per-layer weights with a
static layer index, ``decode_scan.extend_unrolled``, or in a scan): the cache is a pool of
pages ``[kv_heads, n_layers, kv_pages + 1, page_size, head_dim]`` (the last page takes
the writes of inactive slots and unheld positions) and the caller passes each slot's page table
(``sampler.pages``) to ``insert`` and ``generate``; a group's slots may share their prompt's pages,
``move`` leaves the cache alone, and decode attention reads the pages in place (Pallas kernels) or
gathered up to the kv bound (``kernels.paged_attention``).
Kernels: the decode attention, the matmuls' weight layout and the steps per call are picked per
platform of the mesh by ``areal_jax.kernels.choice`` (``decode_attention`` / ``decode_matmul`` /
``steps_per_call`` in the config force them): on CPU the C++ kernels, each slot's cache read only up
to its own position, one step per call; on TPU (and on GPU over rows) one dense read of the
cache up to the kv bucket, on GPU over pages JAX's Pallas paged-attention kernel, 16 steps per
call. One compiled ``generate`` serves every
length; ``kv_buckets`` only add static upper bounds (default: just ``max_len`` where the attention
reads each slot up to its own position; for the dense read, powers of two from 64 up to
``max_len``, so a step reads the cache only up to the furthest slot's bucket).

Weights (``held_weights``): ``put_params`` converts a weight version once into the layout the
programs read: the matmul weights and the embedding in the compute dtype (the learner's float32
master weights are not touched), on GPU and TPU q/k/v and gate/up fused into one weight each
(``decode_projections``, ``kernels.choice.projections``), stacked in scan mode, or packed for the
CPU matmul kernel; on TPU the LM head computed head x activations (vocabulary-major logits,
``choice.vocab_major_logits``). On TPU the weights and the decode state are also held in the
layouts the widest decode program picks for them (``choice.held_layouts``: found by compiling
that program once with ``Layout.AUTO`` when the engine is built, which is then that program's
variant: it is not compiled again; every program takes and returns them in those layouts, so no
call relays them out on entry or exit).
With ``lora`` (a ``models.lora.LoraConfig``) it also accepts LoRA adapters
(what the learner publishes), merged into the base weights once per version, so decoding runs at
full-model speed.

``width_buckets`` (default: powers of two from ``num_slots / 8`` up) are the slot counts a decode
step can run at: a step over w slots costs ~w/num_slots of the per-slot work (the weights are read
once per step whatever the width). Slots split over devices default to the full width only: slots
``[0, w)`` of a split live on the first devices, and XLA gathers the whole cache onto every device
for such a call (seen in the compiled program); data-parallel sampling runs an engine per data
index instead (``replicas``).

Compiled functions are shared by engines of the same model structure, config and mesh; they close
over static structure only (graph definition, shapes, shardings), never over an engine or its
parameters, so a discarded engine's weights are freed.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from areal_jax import program_memory, sharding
from areal_jax.kernels import choice
from areal_jax.models import decode_scan
from areal_jax.models import lora as lora_lib
from areal_jax.models.transformer import ModelConfig, Transformer
from areal_jax.sampler import held_weights, slot_cache, variants
from areal_jax.sampler.decode_calls import TRUNCATES, DecodeCalls, State
from areal_jax.sampler import pages as pages_lib
from areal_jax.sampler import warmup as warmup_lib

log = logging.getLogger(__name__)

_COMPILED: dict[tuple, dict[str, Any]] = {}


def _buckets(requested, max_len: int, smallest: int) -> tuple[int, ...]:
  if requested is None:
    requested, b = [], smallest
    while b < max_len:
      requested.append(b)
      b *= 2
  return tuple(sorted({min(int(b), max_len) for b in requested} | {max_len}))


@dataclasses.dataclass(frozen=True)
class Layers:
  """How an engine's programs run the model's layers over its cache (prefill, generate, the
  continuation's extend): the engine's choices held apart from it, so that compiled functions do
  not keep the engine alive."""

  graph: Any  # decode_scan.Graphs: the layers in a scan over stacked weights; None: unrolled
  graphdef: Any  # the model's (held weights') graph definition
  layout: str  # the cache layout (slot_cache)

  def extend(self, params, pages_BxN=None, scatter_writes: bool = False):
    """``extend(tokens_BxL, start_B, cache, kv_len=None, attention_impl=None, writes_B=None)``
    over ``params`` (``pages_BxN``: a paged cache's page tables; ``scatter_writes``: the per-layer
    caches written by one scatter a layer, ``Transformer.extend``)."""
    if self.graph is not None:
      return functools.partial(decode_scan.extend, self.graph, params, pages_BxN=pages_BxN)
    model = nnx.merge(self.graphdef, params)
    if self.layout == slot_cache.STACKED:  # unrolled over a stacked prefix or a paged cache
      return functools.partial(decode_scan.extend_unrolled, model, pages_BxN=pages_BxN)
    heads_major = self.layout == slot_cache.HEADS

    def extend(*args, writes_B=None, **kwargs):
      del writes_B  # a row cache: inactive slots are never read past their position
      return model.extend(*args, **kwargs, heads_major=heads_major, scatter_writes=scatter_writes)

    return extend


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8
  max_len: int = 512  # cache positions per slot: prompt + generated tokens never exceed it
  prefill_buckets: tuple[int, ...] | None = None  # default: 32, 64, ... up to max_len
  kv_buckets: tuple[int, ...] | None = None  # static read bounds; default: see the module doc
  width_buckets: tuple[int, ...] | None = None  # decode widths (slots); default: S/8, S/4, S/2, S
  steps_per_call: int = 0  # decode steps per generate call (per host sync); 0: per platform
  max_stop_ids: int = 8  # EOS + stop ids per slot
  max_prefill_batch: int = 8  # prompts per prefill call
  # tokens per prefill call (rows x bucket; at least one row): bounds its memory at long buckets
  # (0: no bound)
  max_prefill_tokens: int = 0
  # a prefill's causal attention: kernels.choice.CAUSAL, or "auto" (a flash kernel on GPU and TPU)
  prefill_attention: str = "auto"
  cache_dtype: str | None = None  # default: the model's compute dtype
  decode_attention: str = "auto"  # kernels.choice.ATTENTION, or "auto" (per platform)
  decode_matmul: str = "auto"  # kernels.choice.MATMUL, or "auto"
  decode_layers: str = "auto"  # kernels.choice.LAYERS ("scan" | "unrolled"), or "auto"
  decode_projections: str = "auto"  # kernels.choice.PROJECTIONS ("fused" | "separate"), or "auto"
  # paged cache: pages in the pool (0: a cache row of max_len per slot; -1: per platform,
  # kernels.choice.kv_pages, which then sizes the pool by the slots; the caller keeps page tables)
  kv_pages: int = 0
  page_size: int = 64  # positions per page of the paged cache
  # kernel launches timed on the device before the first decode, the fastest kept
  # (kernels.choice.DECODE_TUNING: "auto", on a GPU; "off": as built; sampler/launch_tuning.py)
  decode_tuning: str = "auto"

  def __post_init__(self):
    if self.num_slots < 1 or self.max_len < 2 or self.steps_per_call < 0 or \
        self.max_prefill_batch < 1 or self.kv_pages < -1 or self.page_size < 1 or \
        self.max_prefill_tokens < 0:
      raise ValueError(f"invalid engine config {self}")
    if self.decode_tuning not in choice.DECODE_TUNING:
      raise ValueError(f"decode_tuning={self.decode_tuning!r} is not one of "
                       f"{choice.DECODE_TUNING}")


class DecodeEngine(DecodeCalls):
  """Jitted prefill / insert / generate over ``num_slots`` slots on ``mesh``."""

  def __init__(self, model: Transformer, config: EngineConfig, mesh: Mesh | None = None,
               lora: lora_lib.LoraConfig | None = None):
    self.model_cfg: ModelConfig = model.cfg
    self.mesh = mesh or sharding.make_mesh({}, jax.devices()[:1])
    # the kernels (and steps per call) for this mesh's platform: ``kernels.choice``
    self.platform = platform = choice.platform_of(self.mesh)
    # GPUs older than Ampere cannot run Pallas's Triton kernels: why, or None
    no_triton = choice.triton_unusable(self.mesh.devices.flat)
    # slots split over devices: sharding.spec names the axes (None: not split)
    slots_split = sharding.spec(("cache_batch",), (config.num_slots,), self.mesh)[0] is not None
    # the paged cache's pool (kv_pages -1: the platform's choice, a pool that follows the slots)
    kv_pages = choice.kv_pages(platform, config.kv_pages, config.decode_attention, slots_split,
                               config.num_slots, config.max_len, config.page_size, no_triton)
    self.pool_follows_slots = config.kv_pages < 0 < kv_pages
    self.attention_impl = choice.attention(  # the Pallas GPU kernel where it reads the pages
        platform, config.decode_attention,
        paged=kv_pages > 0 and choice.pallas_gpu_reads(config.page_size), no_triton=no_triton)
    with sharding.use(self.mesh):  # a prefill's attention (``choice.causal_attention``)
      self.prefill_attention = choice.causal_attention(config.prefill_attention,
                                                       self.model_cfg.head_dim)[0]
    self.matmul_impl = choice.matmul(self.mesh, self.model_cfg.compute_dtype, config.decode_matmul)
    self.layers_impl = choice.layers(platform, self.matmul_impl, config.decode_layers,
                                     paged=kv_pages > 0, attention_impl=self.attention_impl)
    # XLA options of the programs that run the model's matmuls (prefill, generate, continuation)
    self.compiler_options = choice.compiler_options(self.matmul_impl)
    # each RMSNorm with the matmul after it, in the decode programs (``choice.norm_matmuls``), and
    # the Pallas GPU kernel's launch they trace with (``choice.pallas_gpu_tuning``): both resolved
    # here, once, as the engine's launch (``use_launch`` changes it: ``sampler.launch_tuning``)
    self.launch = choice.Launch(
        choice.norm_matmuls(platform, self.mesh.size == 1, no_triton=no_triton),
        choice.pallas_gpu_tuning())
    # whether a generate call's program is picked by whether its slots truncate (top-k / top-p),
    # known on the host, rather than deciding it in every step (``choice.truncation_on_host``)
    self.truncation_on_host = choice.truncation_on_host(platform)
    self.config = config = dataclasses.replace(
        config, steps_per_call=config.steps_per_call or choice.steps_per_call(platform),
        kv_pages=kv_pages)
    # The weights as the engine holds them (``held_weights``): fused projections or not
    # (``choice.projections``), compute dtype, stacked in scan mode or packed for the CPU kernel;
    # ``param_shardings`` is what callers pass to ``put_params``, ``held_shardings`` what the
    # engine holds and its calls take.
    self.projections = choice.projections(self.mesh, self.model_cfg, config.decode_projections)
    self.weights = held_weights.HeldWeights(
        model, self.mesh, fused=self.projections == "fused", stacked=self.layers_impl == "scan",
        packed=self.matmul_impl == "cpu_packed", lora=lora,
        vocab_major_logits=choice.vocab_major_logits(platform))
    self.graphdef = self.weights.graphdef
    self.param_shardings, self.held_shardings = self.weights.param_shardings, self.weights.shardings
    # the layers in a scan: static structure of one layer and of the rest (``decode_scan``)
    self._scan = decode_scan.graphs(self.weights.cfg) if self.layers_impl == "scan" else None
    self.paged = config.kv_pages > 0
    if self.paged:
      pages_lib.check(slots_split, config)
    self.prefill_buckets = _buckets(config.prefill_buckets, config.max_len - 1, 32)
    # several kv buckets where a step reads up to the bound, not each slot up to its position
    dense = choice.reads_to_bound(self.attention_impl, self.layers_impl, config.max_len,
                                  self.paged)
    self.kv_buckets = _buckets(config.kv_buckets or (None if dense else (config.max_len,)),
                               config.max_len, 64)
    self.width_buckets = self._width_buckets()
    self._cache_dtype = jnp.dtype(config.cache_dtype or self.model_cfg.compute_dtype)
    choice.check_attention(self.attention_impl, self.layers_impl, self._cache_dtype,
                           config.max_len, self.model_cfg.head_dim, self.paged)
    self.state_shardings = self._state_shardings()
    # Compiled functions are shared by engines of the same model structure, config and mesh (and
    # choice of decode attention, of weight layout and of held layouts); the generate programs
    # per launch (engines under another launch, as a benchmark builds them side by side or
    # ``use_launch`` picks, compile their own).
    self._fns = fns = _COMPILED.setdefault(
        (self.graphdef, config, self.mesh, self.attention_impl, self.prefill_attention,
         self.matmul_impl, self.layers_impl, choice.held_layouts(platform)), {})
    self._prefill_fns: dict[tuple[int, int], Any] = fns.setdefault("prefill", {})
    self._insert_fns: dict[int, Any] = fns.setdefault("insert", {})
    # (the generate programs per kernel launch: ``use_launch`` switches between them)
    self._generate_fns: dict[tuple[int, int], Any] = fns.setdefault(("generate", self.launch), {})
    self._move_fns: dict[int, Any] = fns.setdefault("move", {})
    self._init_fn = fns.get("init")
    # program variants this engine built and the seconds their first calls took (compilation)
    self.compile_stats = {"compiles": 0, "compile_s": 0.0}
    # the layouts the weights and the decode state are held in (``choice.held_layouts``): the jit
    # shardings (and layouts) every program takes and returns them with
    self.held_formats, self.state_formats = self.held_shardings, self.state_shardings
    self.layouts_compile_s = 0.0  # the seconds finding the compiler's took (_compiler_layouts)
    if choice.held_layouts(platform) == "compiler":
      if "formats" not in fns:
        fns["formats"] = self._compiler_layouts(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        self.compile_stats.update(compiles=1, compile_s=self.layouts_compile_s)
      self.held_formats, self.state_formats = fns["formats"]
      self.weights.hold_in(self.held_formats)
    self._deactivate = fns.get("deactivate") or jax.jit(
        lambda state, mask_S: {**state, "active": state["active"] & ~mask_S},
        in_shardings=(self.state_formats, self._slot_sharding()),
        out_shardings=self.state_formats, donate_argnums=0)
    fns["deactivate"] = self._deactivate
    self._variant = functools.partial(variants.get, stats=self.compile_stats)
    self.lora = lora
    self.params = self.put_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

  @property
  def norm_tuning(self):
    """How the decode programs fuse each norm with its matmul (``launch.norms``; None: not)."""
    return self.launch.norms

  @property
  def paged_tuning(self):
    """How the decode programs launch the Pallas GPU paged kernel (``launch.paged``)."""
    return self.launch.paged

  @property
  def decode_matmul(self) -> str:
    """The decode programs' matmuls (``launch.matmul``, else the engine's ``matmul_impl``; the
    prefill and continuation programs keep the engine's)."""
    return self.launch.matmul or self.matmul_impl

  def use_launch(self, launch: choice.Launch) -> None:
    """Runs decode calls from here on with ``launch``'s programs (each compiled at its first use,
    as every variant is; the others' are kept); ``sampler.launch_tuning`` picks it."""
    self.launch = launch
    self._generate_fns = self._fns.setdefault(("generate", launch), {})

  def launch_stages(self):
    """The stages of launches this engine times before it decodes (``choice.launch_stages``)."""
    m = self.model_cfg
    q_kv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    return choice.launch_stages(
        self.platform, self.config.decode_tuning,
        paged_pallas=self.paged and self.attention_impl == "pallas_gpu",
        one_device=self.mesh.size == 1, group=m.n_heads // m.n_kv_heads,
        page_size=self.config.page_size, head_dim=m.head_dim,
        norm_dims=((m.d_model, q_kv), (m.d_model, m.d_ff)),
        no_triton=choice.triton_unusable(self.mesh.devices.flat),
        matmul_open=choice.matmul_open(self.matmul_impl, self.config.decode_matmul),
        blas=self.matmul_impl == "blas")

  @property
  def pages_per_slot(self) -> int:
    """Page table entries per slot (paged cache)."""
    return -(-self.config.max_len // self.config.page_size)

  @property
  def layers(self) -> Layers:
    """How this engine's programs run the model's layers (``Layers``)."""
    return Layers(self._scan, self.graphdef, self.cache_layout)

  @property
  def cache_layout(self) -> str:
    """The slots' cache layout (``slot_cache``): stacked with the layers in a scan; else per layer,
    heads before positions where the decode attention reads that layout in place
    (``choice.heads_major_per_layer``), positions first otherwise."""
    if self._scan is not None or self.paged:
      return slot_cache.STACKED
    return (slot_cache.HEADS if choice.heads_major_per_layer(self.attention_impl, self.platform)
            else slot_cache.ROWS)

  def _width_buckets(self) -> tuple[int, ...]:
    s, requested = self.config.num_slots, self.config.width_buckets
    if requested is None:  # slots split over devices: full width only (see the module doc)
      split = sharding.spec(("cache_batch",), (s,), self.mesh)[0] is not None
      requested = [] if split else [w for w in (s // 8, s // 4, s // 2) if w >= 1]
    if any(not 1 <= int(w) <= s for w in requested):
      raise ValueError(f"width_buckets={requested} must lie in [1, num_slots={s}]")
    return tuple(sorted({int(w) for w in requested} | {s}))

  def width_bucket(self, n: int) -> int:
    """Smallest decode width that covers slots ``[0, n)``."""
    return self.width_buckets[bisect.bisect_left(self.width_buckets, n)]

  # ---- placement -------------------------------------------------------------------------------

  def _named(self, logical, shape) -> NamedSharding:
    return NamedSharding(self.mesh, sharding.spec(logical, shape, self.mesh))

  def _slot_sharding(self, *rest):
    s = self.config.num_slots
    return self._named(("cache_batch",) + (None,) * len(rest), (s,) + rest)

  def _state_shardings(self):
    cfg, c = self.model_cfg, self.config
    vec = self._slot_sharding()
    if self.paged:
      pool = self._named(decode_scan.POOL_AXES,
                         decode_scan.pool_shape(cfg, c.kv_pages, c.page_size))
      cache = {"k": pool, "v": pool}
    else:
      cache = slot_cache.shardings(self._named, cfg, c.num_slots, c.max_len, self.cache_layout)
    return {
        "cache": cache,
        "tokens": vec, "pos": vec, "end": vec, "active": vec,
        "temperature": vec, "top_k": vec, "top_p": vec, "greedy": vec,
        "key": self._slot_sharding(2), "stop_ids": self._slot_sharding(c.max_stop_ids),
    }

  def _compiler_layouts(self, model_params: dict):
    """``(weights' formats, state's formats)``: the layouts the widest decode program (the largest
    kv bucket, every slot) picks for them when left to the compiler (``Layout.AUTO``), with the
    held shardings. Costs one compilation of that program, which becomes its variant (the state
    is donated, so the program returns it in the layouts it takes it in: checked, else that
    variant compiles at its first call as every other does)."""
    from jax.experimental.layout import Format, Layout  # noqa: PLC0415

    auto = lambda tree: jax.tree.map(lambda sh: Format(Layout.AUTO, sh), tree)  # noqa: E731
    kv_len, width = self.kv_buckets[-1], self.config.num_slots
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          self.weights.shapes(model_params), self.held_shardings)
    args = (params, self.state_shapes())
    if self.paged:
      args += (jax.ShapeDtypeStruct((width, self.pages_per_slot), jnp.int32),)
    t0 = time.perf_counter()
    formats = (auto(self.held_shardings), auto(self.state_shardings))
    try:
      compiled = self._make_generate(kv_len, width, formats).lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:
      if not program_memory.refused(e):
        raise
      # (too many slots for the device: the memory plan says so, and builds the engine again
      # with fewer, which finds its layouts; this one is never run)
      log.warning("sampler: the widest decode program (%d slots, kv %d) does not fit the device "
                  "(%s); its weights and state are held in the default layouts", width, kv_len,
                  str(e).splitlines()[0][:200])
      return self.held_shardings, self.state_shardings
    self.layouts_compile_s = time.perf_counter() - t0
    held, state = compiled.input_formats[0][:2]
    if jax.tree.leaves(compiled.output_formats[0]) == jax.tree.leaves(state):
      self._generate_fns[(kv_len, width, self._truncate(False))] = _Ready(
          compiled, self._make_generate(kv_len, width, (held, state)))
    return held, state

  def put_params(self, params: dict) -> dict:
    """Places a pure parameter dict on the sampler mesh in the layout the engine holds
    (``held_weights``: fused projections, compute dtype, stacked or packed, converted once per
    weight version; the caller's arrays are left as they are). With ``lora``, ``params`` may be
    LoRA adapters instead: they are merged into the base weights first."""
    return self.weights.put(params)

  def init_state(self) -> State:
    """An empty decode state: the device arrays of ``state_shapes`` and the host's ``TRUNCATES``."""
    if self._init_fn is None:
      self._init_fn = jax.jit(self._new_state(), out_shardings=self.state_formats)
      self._fns["init"] = self._init_fn
    return {**self._init_fn(), TRUNCATES: np.zeros((self.config.num_slots,), np.bool_)}

  def state_shapes(self) -> State:
    """``init_state``'s device arrays' shapes, dtypes and shardings, without allocating them."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        jax.eval_shape(self._new_state()), self.state_shardings)

  def _new_state(self):
    """A function making an empty decode state (closing over static structure only)."""
    cfg, c, cache_dtype = self.model_cfg, self.config, self._cache_dtype
    s, layout, paged = c.num_slots, self.cache_layout, self.paged

    def make() -> State:
      return {
          "cache": (decode_scan.init_pool(cfg, c.kv_pages, c.page_size, cache_dtype) if paged
                    else slot_cache.make(cfg, s, c.max_len, cache_dtype, layout)),
          "tokens": jnp.zeros((s,), jnp.int32), "pos": jnp.zeros((s,), jnp.int32),
          "end": jnp.zeros((s,), jnp.int32), "active": jnp.zeros((s,), jnp.bool_),
          "temperature": jnp.ones((s,), jnp.float32), "top_k": jnp.zeros((s,), jnp.int32),
          "top_p": jnp.ones((s,), jnp.float32), "greedy": jnp.zeros((s,), jnp.bool_),
          "key": jnp.zeros((s, 2), jnp.uint32),
          "stop_ids": jnp.full((s, c.max_stop_ids), -1, jnp.int32),
      }

    return make

  # ---- warmup ----------------------------------------------------------------------------------

  def warmup(self, state: State, progress: warmup_lib.Progress | None = None) -> State:
    """Compiles every prefill, insert, generate and move variant (no slot is armed afterwards);
    ``progress(done, total, what)`` after each (``sampler.warmup``)."""
    return warmup_lib.warmup(self, state, progress)

  def num_compiled(self) -> int:
    """Number of compiled variants of prefill / insert / generate / move (bounded by the buckets)."""
    fns = [*self._prefill_fns.values(), *self._insert_fns.values(), *self._generate_fns.values(),
           *self._move_fns.values()]
    return sum(f._cache_size() for f in fns) + self._deactivate._cache_size()


class _Ready:
  """A program variant compiled when the engine was built (``DecodeEngine._compiler_layouts``):
  called, its executable runs; ``lower`` lowers the jitted function it stands for (not traced
  unless asked: a benchmark's look at the program)."""

  def __init__(self, executable, jitted):
    self._executable, self._jitted = executable, jitted

  def __call__(self, *args):
    return self._executable(*args)

  def lower(self, *args):
    return self._jitted.lower(*args)

  def _cache_size(self) -> int:
    return 1
