"""The sampler's memory plan: do its weights, KV cache and programs fit in device memory.

Per device (the fullest one), before the decode state is allocated:

  peak = held weights          (the version the engine decodes with)
       + frozen LoRA base      (with LoRA: the base the adapters are merged into)
       + decode state          (the KV cache of every slot and the per-slot vectors)
       + prefix memo           (the prompts' prefixes kept between prefill calls, at most as
                                many positions as the largest prefill call's: ``prefix_memo``)
       + continuation rows     (a row cache: finished turns' rows kept for multi-turn episodes'
                                next turns, as many as fit beside the rest: ``with_rows``;
                                a paged cache keeps them as pages of its pool)
       + a weight swap         (the version arriving, in the model's layout and the dtype the
                                transfer delivers (``incoming``), and the held version it is
                                converted into, both until the conversion returns)
       + the larger program    (XLA's memory analysis of the two largest programs, compiled on
                                abstract shapes: the decode call at full width and the largest kv
                                bucket, its temporaries (the larger of its two programs where
                                top-k / top-p has one of its own); the largest prefill call,
                                its temporaries and the prefixes it returns: at the largest
                                bucket and the most rows rollout.max_prefill_tokens
                                leaves it, or at the bucket whose rows hold the most tokens)

The swap and a program add up where the sampler decodes while a version arrives (its own devices:
the learner publishes while it generates); colocated it is paused then, and the peak is the
larger of the two. A swap that pauses (``rollout.weight_swap="pause"``, the service's
``weight_swap``) lets go of the current version before converting the new one: its bytes are the
arriving version's, and no program runs beside it. Under ``"auto"``, ``fit`` keeps the swap
overlapping decode calls where that fits the budget and pauses it otherwise, before it takes any
slot away.

The budget is the caller's (``learner.memory.device_budget`` of the sampler's devices). Colocated
with the learner, the two alternate on the same devices and what each keeps between its turns
stays: the sampler's peak must fit beside the learner's resident state (weights, optimizer state,
reference and frozen weights), and the sampler's resident part (``resident_bytes``: weights, LoRA
base, decode state) beside the learner's planned peak (``resident_budget``). A LoRA base the
learner holds in the compute dtype is the very array the sampler merges into (shared, counted
once). When the configured slots do not fit, ``fit`` rebuilds the engine with the most slots
that do (as the learner's plan lowers its micro-batch) and says so; a paged cache whose pool the
slots sized (a page for every position they could hold) keeps its slots first, over the most
pages that fit (sequences take pages as they grow). A run stops, before the decode
state is allocated, only when not even the fewest slots it needs fit, with the parts of the plan.
The programs compiled for the plan are ones the sampler runs: with the persistent compilation
cache (``runtime.compile_cache_dir``, on by default) their first calls read the plan's
compilations (tested); on a GPU the top-k / top-p decode program too, which runs only once a slot
asks for top-k / top-p (a compile more at the start of a run that never does; its GEMMs are the
other program's, whose autotuning XLA keeps for the process). The decode call counted is the
engine's own launch's; where the engine times other launches of it before its first call (on a
GPU: ``sampler.launch_tuning``), one kept instead must fit the plan with its own temporaries
(``launch_tuning.within_plan``).
Figures are those of the backend the plan compiles for (XLA:CPU's buffer assignment differs
somewhat from GPU's or TPU's).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from areal_jax import program_memory, sharding
from areal_jax.sampler import slot_cache

GIB = 1024**3


@dataclasses.dataclass
class SamplerPlan:
  """Bytes per device of each part of the sampler's peak, and the budget it was checked against."""

  weights: int  # one held version
  lora_base: int
  state: int  # KV cache and per-slot vectors
  generate_temp: int
  prefill: int  # temporaries and returned prefixes
  num_slots: int
  budget_bytes: int | None
  resident_budget: int | None = None  # colocated: what the learner's peak leaves
  kv_pages: int = 0  # a paged cache's pages (its state is the pool, not slots x max_len)
  pool_follows_slots: bool = False  # the pool was sized by the slots (kv_pages -1): fewer shrink it
  page_bytes: int = 0  # a paged cache: one page of the pool (its keys and values, all layers)
  incoming: int = 0  # a weight version as it arrives, before its conversion (``incoming_bytes``)
  swap_while_decoding: bool = True  # a swap happens beside a decode or prefill call
  swap_pauses: bool = False  # the current version is let go of before the new one is converted
  # a row cache: the bytes of one kept continuation row of max_len (a finished turn's KV copied
  # out for the next turn, ``sampler.continuation``, which keeps short turns' rows at their prefill
  # bucket, several to a max_len row's bytes; a paged cache keeps pages of its pool: 0), and how
  # many such rows the plan makes room for
  row_bytes: int = 0
  kept_rows: int = 0
  memo: int = 0  # the prefixes kept between prefill calls (``prefix_memo``)

  @property
  def fixed_bytes(self) -> int:
    """The resident bytes no slot or page changes: weights, LoRA base, prefix memo."""
    return self.weights + self.lora_base + self.memo

  @property
  def resident_bytes(self) -> int:
    """What stays allocated between decode calls (while a colocated learner trains)."""
    return self.fixed_bytes + self.state + self.kept_rows * self.row_bytes

  def rows_that_fit(self) -> int | None:
    """The most continuation rows (``row_bytes`` each, held between calls) that fit beside this
    plan's peak and resident part as they are; None without a budget (or rows to count)."""
    if not self.row_bytes:
      return None
    free = []
    if self.budget_bytes is not None:
      free.append(self.budget_bytes - self.peak_bytes)
    if self.resident_budget is not None:
      free.append(self.resident_budget - self.resident_bytes)
    if not free:
      return None
    return self.kept_rows + max(0, min(free) // self.row_bytes)

  def with_rows(self, wanted: int) -> SamplerPlan:
    """This plan keeping ``wanted`` continuation rows, or the fewer that fit (a row cache; the
    slots are not lowered for them: a turn not kept is prefilled whole)."""
    fit = self.rows_that_fit()
    return dataclasses.replace(self, kept_rows=wanted if fit is None else min(wanted, fit))

  @property
  def swap_bytes(self) -> int:
    """A weight swap's bytes beside the resident part: the arriving version and the held one it
    is converted into (in place of the current one, when the swap pauses)."""
    return self.incoming + (0 if self.swap_pauses else self.weights)

  @property
  def peak_bytes(self) -> int:
    programs = max(self.generate_temp, self.prefill)
    return self.resident_bytes + (self.swap_bytes + programs if self.overlapping
                                  else max(self.swap_bytes, programs))

  @property
  def overlapping(self) -> bool:
    """Whether a swap's bytes and a decode call's are held at once."""
    return self.swap_while_decoding and not self.swap_pauses

  def pausing(self) -> SamplerPlan:
    """This plan with the swap paused (``weight_swap="pause"``)."""
    return dataclasses.replace(self, swap_pauses=True)

  @property
  def fits(self) -> bool:
    return ((self.budget_bytes is None or self.peak_bytes <= self.budget_bytes)
            and (self.resident_budget is None or self.resident_bytes <= self.resident_budget))

  def slots_that_fit(self) -> int:
    """About how many slots fit the budget (the state and the decode call's temporaries taken as
    proportional to the slots; the weights and the prefill call are not)."""
    fits, n = [], self.num_slots
    if self.budget_bytes is not None:  # every branch of the peak's max must fit
      free = self.budget_bytes - self.fixed_bytes
      if self.overlapping:
        free -= self.swap_bytes
      else:
        fits.append((free - self.swap_bytes) // (self.state / n))
      fits += [free // ((self.state + self.generate_temp) / n),
               (free - self.prefill) // (self.state / n)]
    if self.resident_budget is not None:
      free = self.resident_budget - self.fixed_bytes
      fits.append(free // (self.state / n))
    return max(0, int(min(fits, default=self.num_slots)))

  def pages_that_fit(self) -> int:
    """A paged cache: the most pages of a pool that fit the budget at these slots (the per-slot
    vectors and the programs' temporaries taken as they are: a decode call's do not grow with the
    pool, whose pages it reads through the page table)."""
    if not self.page_bytes:
      return 0
    rest = self.state - (self.kv_pages + 1) * self.page_bytes  # the per-slot vectors
    room = []
    if self.budget_bytes is not None:
      programs = max(self.generate_temp, self.prefill)
      room.append(self.budget_bytes - self.fixed_bytes - rest
                  - (self.swap_bytes + programs if self.overlapping
                     else max(self.swap_bytes, programs)))
    if self.resident_budget is not None:
      room.append(self.resident_budget - self.fixed_bytes - rest)
    if not room:
      return self.kv_pages
    return max(0, int(min(room)) // self.page_bytes - 1)  # (and the trash page)

  def summary(self) -> str:
    budget = "" if self.budget_bytes is None else f" of {size(self.budget_bytes)}"
    resident = "" if self.resident_budget is None else (
        f" ({size(self.resident_bytes)} resident beside the learner's peak, of "
        f"{size(self.resident_budget)})")
    swap = ("paused, the current version let go of first" if self.swap_pauses else
            "beside decode calls" if self.swap_while_decoding else "between decode calls")
    return (f"{size(self.peak_bytes)} per device{budget}{resident}: weights "
            f"{size(self.weights)}, a swap's {size(self.incoming)} arriving and "
            f"{size(self.weights)} converted ({swap}), "
            + (f"LoRA base {size(self.lora_base)}, " if self.lora_base else "")
            + f"KV cache and slots {size(self.state)} ({self.num_slots} slots"
            + (f", {self.kv_pages} pages" if self.kv_pages else "") + "), "
            + (f"{self.kept_rows} continuation rows {size(self.kept_rows * self.row_bytes)}, "
               if self.kept_rows and self.row_bytes else "")
            + f"prefix memo {size(self.memo)}, decode call "
            f"{size(self.generate_temp)}, prefill call {size(self.prefill)}")


def size(n: int) -> str:
  """``n`` bytes, in GiB or MiB."""
  return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _compiled_memory(jitted, *args):
  cost = program_memory.cost(jitted.lower(*args), args)  # (a refused program: too large)
  return cost["temp"], cost["out"]


def generate_bytes(engine) -> int:
  """The temporaries of the decode call the plan counts (every slot, the largest kv bucket), under
  the engine's current launch, compiled on abstract shapes for its own devices: the larger of its
  programs where the engine compiles one per answer to whether a slot truncates (on GPU,
  ``choice.truncation_on_host``: the top-k / top-p program sorts the vocabulary, a few
  [slots, vocab] float32 arrays more; compiled for an H100, 232 MiB against 107 for the
  Qwen2.5-1.5B shape at 128 slots); elsewhere one program holds both (a ``lax.cond``, whose
  temporaries XLA counts for either branch)."""
  c = engine.config
  pages = ((jax.ShapeDtypeStruct((c.num_slots, engine.pages_per_slot), np.int32),)
           if engine.paged else ())  # a paged cache's page table
  return max(_compiled_memory(fn, engine.params, engine.state_shapes(), *pages)[0]
             for fn in planned_generates(engine))


def planned_generates(engine) -> list:
  """The decode programs the plan counts (every slot, the largest kv bucket, jitted): the one
  without the top-k / top-p sort, and with it where the engine compiles that apart
  (``truncation_on_host``)."""
  return [engine._make_generate(engine.kv_buckets[-1], engine.config.num_slots,  # noqa: SLF001
                                truncate=truncate)
          for truncate in ((False, True) if engine.truncation_on_host else (False,))]


def program_bytes(engine) -> tuple[int, int]:
  """``(decode call's temporaries, largest prefill call's temporaries and returned prefixes)``,
  compiled on abstract shapes for the engine's own devices."""
  gen_temp = generate_bytes(engine)
  prefill = max(sum(_compiled_memory(engine._make_prefill(bucket, rows),  # noqa: SLF001
                                     engine.params, jax.ShapeDtypeStruct((rows, bucket), np.int32)))
                for bucket, rows in engine.prefill_shapes_to_plan())
  return gen_temp, prefill


def plan(engine, budget_bytes: int | None, resident_budget: int | None = None,
         shared_base: bool = False, programs=program_bytes, incoming_dtype=None,
         swap_while_decoding: bool = True, incoming: int | None = None,
         weight_swap: str = "overlap") -> SamplerPlan:
  """The plan of a ``DecodeEngine`` (its weights placed, its state not needed); ``shared_base``:
  its LoRA base is the learner's own array, already counted there; ``programs``: what gives the
  programs' bytes (``program_bytes``; bench/aot_decode.py compiles them for another device);
  ``incoming_dtype``: the dtype of the matmul weights of a version as it arrives (None: the
  compute dtype, as a transfer that casts before its copy delivers them); ``swap_while_decoding``:
  whether a swap happens beside decode calls (False: colocated, paused while the learner runs);
  ``incoming``: those bytes as given (bench/aot_decode.py: a LoRA merge compiled for another
  device) instead of ``HeldWeights.incoming_bytes``; ``weight_swap``: ``"pause"`` plans a swap
  that lets go of the current version first (``"overlap"`` and ``"auto"``: one that does not)."""
  c = engine.config
  gen_temp, prefill = programs(engine)
  base = engine.weights.lora_base  # with LoRA: the base the adapters are merged into
  return SamplerPlan(
      weights=sharding.device_bytes(engine.params),
      lora_base=sharding.device_bytes(base) if base is not None and not shared_base else 0,
      state=sharding.device_bytes(engine.state_shapes()), generate_temp=gen_temp,
      prefill=prefill, num_slots=c.num_slots, budget_bytes=budget_bytes,
      resident_budget=resident_budget, kv_pages=c.kv_pages,
      pool_follows_slots=engine.pool_follows_slots,
      page_bytes=(sharding.device_bytes(engine.state_shapes()["cache"]) // (c.kv_pages + 1)
                  if engine.paged else 0),
      incoming=engine.weights.incoming_bytes(incoming_dtype) if incoming is None else incoming,
      swap_while_decoding=swap_while_decoding, swap_pauses=weight_swap == "pause",
      row_bytes=0 if engine.paged else row_bytes(engine),
      memo=row_bytes(engine, engine.prefill_positions_to_plan()))


def row_bytes(engine, positions: int | None = None) -> int:
  """Bytes per device of one prefix row of ``positions`` (default ``max_len``: a row cache's
  continuation row at its longest, as ``sampler.continuation`` copies it out; a prefill bucket: one
  prompt's prefix, as a prefill call returns it)."""
  cfg, n = engine.model_cfg, positions or engine.config.max_len
  shapes = jax.eval_shape(lambda: slot_cache.make(cfg, 1, n, engine._cache_dtype,  # noqa: SLF001
                                                  engine.cache_layout))
  shards = slot_cache.shardings(engine._named, cfg, 1, n, engine.cache_layout,  # noqa: SLF001
                                prefix=True)
  return sharding.device_bytes(jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shards))


def check(engine, budget_bytes: int | None, resident_budget: int | None = None,
          shared_base: bool = False, **swap) -> SamplerPlan:
  """``plan`` (``swap``: its ``incoming_dtype``, ``swap_while_decoding``, ``weight_swap``), raising
  ``MemoryError`` naming what to change when it does not fit."""
  p = plan(engine, budget_bytes, resident_budget, shared_base, **swap)
  if not p.fits:
    raise _too_big(p, engine.config.max_len, engine.mesh)
  return p


def fit(make, num_slots: int, min_slots: int = 1, **budget):
  """``(holder, plan)``: ``make(num_slots)`` (an object whose ``engine`` is the ``DecodeEngine``,
  e.g. a ``JaxRolloutEngine``) when its plan fits ``budget`` (``check``'s keywords); else rebuilt
  with the most slots that fit, a multiple of the mesh's data-axis size (slots are split over it)
  and at least ``min_slots`` (a group's samples are admitted together), and printed. Raises
  ``check``'s ``MemoryError`` when even that does not fit. ``weight_swap`` ``"auto"`` (in
  ``budget``): the swap overlaps decode calls where that fits, else pauses (printed), before any
  slot goes; the plan says which (``swap_pauses``).

  A paged cache keeps its slots first: rebuilt as ``make(num_slots, kv_pages=n)`` over the
  most pages ``n`` that fit, if those hold at least a group's sequences to ``max_len``
  (``min_slots`` rows' pages), and printed (a pool that follows the slots, ``kv_pages`` -1, has a
  page for every position they could hold; a configured pool is lowered as slots are). Sequences
  take pages as they grow, so the pool holds as many as their lengths allow, not as their longest
  could; when it runs out the service preempts the sequences admitted last and re-prefills them
  later (``sampler.paging``). Only when not even that pool fits do slots go, where the pool
  follows them (a configured pool: the run stops, naming ``rollout.kv_pages``)."""
  auto = budget.get("weight_swap") == "auto"
  holder = make(num_slots)
  first = p = plan(holder.engine, **budget)
  if auto and not p.fits and p.pausing().fits:
    print(f"sampler memory plan: a weight swap beside decode calls does not fit ({p.summary()}); "
          "it pauses the sampler instead (rollout.weight_swap)", flush=True)
    return holder, p.pausing()
  if auto and not p.fits:  # (fewer slots, the swap paused: the most slots a budget can hold)
    first = p = p.pausing()
    budget = {**budget, "weight_swap": "pause"}
  max_len, mesh = holder.engine.config.max_len, holder.engine.mesh
  if p.kv_pages and not p.fits:  # a paged cache: the slots kept, over the pool that fits
    page_size = holder.engine.config.page_size
    least = max(min_slots, 1) * -(-max_len // page_size)  # a group's sequences, each to max_len
    pooled = p
    for _ in range(3):  # pages_that_fit extrapolates (programs as they were): a look settles it
      pages = pooled.pages_that_fit()
      if pages < least or pages >= pooled.kv_pages:
        break
      del holder
      holder = make(num_slots, kv_pages=pages)
      pooled = plan(holder.engine, **budget)
      if pooled.fits:
        asked = (f"rollout.num_slots={num_slots} with a page for every position they could hold"
                 if p.pool_follows_slots else f"rollout.kv_pages={p.kv_pages}")
        print(f"sampler memory plan: {asked} does not fit ({first.summary()}); the "
              f"{num_slots} slots are kept over a pool of {pages} pages ("
              f"{pages * page_size} positions, {pages * page_size / max_len:.1f} sequences of "
              f"{max_len}): sequences take pages as they grow, and when the pool runs out the "
              "last admitted wait (preempted, then re-prefilled)", flush=True)
        return holder, pooled
    if not p.pool_follows_slots:  # the pool is the user's to lower: fewer slots keep it as large
      raise _too_big(first, max_len, mesh, min_slots)
  looked = False  # at the fewest slots a group needs
  for _ in range(5):  # slots_that_fit extrapolates: a second look settles it
    if p.fits:
      if p.num_slots != num_slots:
        print(f"sampler memory plan: rollout.num_slots={num_slots} does not fit "
              f"({first.summary()}); using {p.num_slots}", flush=True)
      return holder, p
    shards = holder.engine.mesh.shape.get("data", 1)
    need = -(-max(min_slots, shards) // shards) * shards
    slots = min(p.slots_that_fit(), p.num_slots - 1) // shards * shards
    if slots < need:
      # the extrapolation can undershoot (a program the compiler refused for want of memory is
      # costed at all it said it needed): look at the fewest slots a group needs, once
      if looked or p.num_slots <= need:
        break
      slots, looked = need, True
    del holder  # its weights go before the next engine places its own
    holder = make(slots)
    p = plan(holder.engine, **budget)
  raise _too_big(first, max_len, mesh, min_slots)


def _too_big(p: SamplerPlan, max_len: int, mesh, min_slots: int = 1) -> MemoryError:
  need = f" (at least {min_slots} needed: rollout.n_samples)" if min_slots > 1 else ""
  prefill = (" Most of it is the prefill call: lower rollout.max_prefill_tokens or the largest "
             "of rollout.prefill_buckets." if p.prefill > p.state + p.generate_temp else "")
  if p.kv_pages and not p.pool_follows_slots:
    return MemoryError(
        f"sampler memory plan: does not fit: {p.summary()}. Lower rollout.kv_pages (now "
        f"{p.kv_pages}: the paged KV cache's pool), or give the sampler more devices "
        f"(mesh.sampler_devices, mesh.sampler.* = {dict(mesh.shape)}).{prefill}")
  return MemoryError(
      f"sampler memory plan: does not fit: {p.summary()}. About {p.slots_that_fit()} slots would "
      f"fit{need}: lower rollout.num_slots (now {p.num_slots}), or the cache's positions per slot "
      f"({max_len} = the largest of rollout.prefill_buckets + rollout.max_new_tokens), or give "
      f"the sampler more devices (mesh.sampler_devices, mesh.sampler.* = "
      f"{dict(mesh.shape)}; colocated, the learner's plan takes its share first).{prefill}")
