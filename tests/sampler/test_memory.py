"""The sampler's memory plan: exact resident bytes per device, a clear stop (naming the keys and
the slots that fit) when it does not fit, and the runtime's budget for it."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from areal_jax import sharding
from areal_jax.kernels import choice
from areal_jax.sampler import memory
from areal_jax.sampler.engine import DecodeEngine, EngineConfig

from .conftest import TINY, tiny_model


def _engine(slots=8, mesh=None, **kw):
  return DecodeEngine(tiny_model(0), EngineConfig(num_slots=slots, max_len=64, **kw), mesh)


_PROGRAM_BYTES: dict = {}


def _programs(engine):
  """``memory.program_bytes`` (``plan``'s default ``programs``), lowered and compiled once per
  program set: engines alike in model, held weights, config, mesh and launch compile the same
  decode and prefill programs, so the plans of such engines share one look at their bytes."""
  key = (engine.graphdef, engine.model_cfg, engine.config, engine.mesh, engine.launch,
         engine.truncation_on_host, engine.attention_impl, engine.prefill_attention,
         engine.matmul_impl, engine.layers_impl, engine.projections,
         jax.tree.structure(engine.params),
         tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(engine.params)))
  if key not in _PROGRAM_BYTES:
    _PROGRAM_BYTES[key] = memory.program_bytes(engine)
  return _PROGRAM_BYTES[key]


def test_plan_counts_weights_cache_and_programs():
  eng = _engine(prefill_buckets=(16, 32))
  p = memory.plan(eng, None, programs=_programs)
  layers, kv, hd = TINY.n_layers, TINY.n_kv_heads, TINY.head_dim
  cache = 2 * layers * 8 * 64 * kv * hd * 4  # keys and values, float32
  vectors = 8 * (4 * 3 + 1 + 4 + 4 + 4 + 1 + 2 * 4 + eng.config.max_stop_ids * 4)
  assert p.state == cache + vectors
  assert p.weights == sum(x.nbytes for x in jax.tree.leaves(eng.params))
  assert p.generate_temp > 0 and p.prefill > 0 and p.lora_base == 0
  # a swap: the version arriving in the model's layout (float32 here, as held) and the one held
  assert p.incoming == sum(x.nbytes for x in jax.tree.leaves(
      nnx.to_pure_dict(nnx.state(tiny_model(0), nnx.Param))))
  # the prefix memo: at most the largest planned prefill call's positions (8 rows of 63 here)
  per_position = 2 * layers * kv * hd * 4
  assert eng.prefill_positions_to_plan() == 8 * 63 and p.memo == 8 * 63 * per_position
  assert p.peak_bytes == p.weights + p.memo + p.state + p.incoming + p.weights + max(
      p.generate_temp, p.prefill)
  assert p.fits and "8 slots" in p.summary()
  # colocated (paused while a version arrives) the swap and the programs do not add up
  paused = memory.plan(eng, None, swap_while_decoding=False, programs=_programs)
  assert paused.peak_bytes == p.weights + p.memo + p.state + max(
      p.incoming + p.weights, p.generate_temp, p.prefill)


@pytest.mark.slow
def test_a_version_arriving_in_the_compute_dtype_is_planned_at_its_size():
  """A bfloat16 engine: a transfer that casts before its copy delivers half the float32 bytes
  (norm scales stay float32); the plan counts what arrives, as told."""
  eng = DecodeEngine(tiny_model(0, dtype="bfloat16"), EngineConfig(num_slots=8, max_len=64))
  f32 = memory.plan(eng, None, incoming_dtype="float32", programs=_programs)
  bf16 = memory.plan(eng, None, programs=_programs)
  norms = sum(x.nbytes for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(
      tiny_model(0), nnx.Param))) if x.ndim == 1 and x.dtype == jnp.float32)
  assert bf16.incoming == (f32.incoming - norms) // 2 + norms
  assert f32.peak_bytes - bf16.peak_bytes == f32.incoming - bf16.incoming
  # what fits: every slot-bound branch of the peak, counted with the swap
  for dtype, overlap in ((None, True), ("float32", True), (None, False)):
    swap = dict(incoming_dtype=dtype, swap_while_decoding=overlap)
    need = memory.plan(eng, None, **swap, programs=_programs)
    budget = need.peak_bytes - need.state // 2
    slots = memory.plan(eng, budget, **swap, programs=_programs).slots_that_fit()
    assert 0 < slots < 8
    fewer = DecodeEngine(tiny_model(0, dtype="bfloat16"), EngineConfig(num_slots=slots, max_len=64))
    assert memory.plan(fewer, budget, **swap, programs=_programs).fits


def test_slots_split_over_the_data_axis_split_the_cache():
  one = memory.plan(_engine(), None, programs=_programs)
  four = memory.plan(_engine(mesh=sharding.make_mesh({"data": 4}, jax.devices()[:4])), None,
                     programs=_programs)
  assert four.state * 4 == one.state
  assert four.weights == one.weights  # replicated over data


def test_a_plan_that_does_not_fit_names_the_keys_and_the_slots_that_would():
  big = _engine(slots=64)
  need = memory.plan(big, None, programs=_programs)
  budget = need.peak_bytes - need.state // 2  # about half the cache's room
  with pytest.raises(MemoryError) as e:
    memory.check(big, budget, programs=_programs)
  msg = str(e.value)
  assert "rollout.num_slots (now 64)" in msg and "rollout.max_new_tokens" in msg
  slots = int(msg.split("About ")[1].split(" slots")[0])
  assert 0 < slots < 64
  # the suggestion is sound: that many slots fit the same budget
  assert memory.check(_engine(slots=slots), budget, programs=_programs).fits
  assert memory.check(big, need.peak_bytes, programs=_programs).fits
  # colocated: the resident part must also fit beside the learner's peak
  with pytest.raises(MemoryError, match="resident beside the learner's peak"):
    memory.check(big, need.peak_bytes, resident_budget=need.resident_bytes - 1,
                 programs=_programs)
  tight = memory.plan(big, need.peak_bytes, resident_budget=need.resident_bytes - need.state // 2,
                      programs=_programs)
  assert not tight.fits and 0 < tight.slots_that_fit() < 64
  assert memory.check(_engine(slots=tight.slots_that_fit()), need.peak_bytes,
                      resident_budget=tight.resident_budget, programs=_programs).fits


@pytest.mark.slow
def test_engines_build_checks_the_budget(capsys):
  from areal_jax import config as config_lib
  from areal_jax.models import tokenizer as tok_lib
  from areal_jax.runtime import engines

  c = config_lib.base_config()
  c.rollout.num_slots, c.rollout.prefill_buckets, c.rollout.max_new_tokens = 8, (16,), 16
  c.rollout.weight_swap = "overlap"  # (auto would pause the swap first: the next test)
  model, tokenizer = tiny_model(0), tok_lib.byte_tokenizer()
  mesh = sharding.make_mesh({}, jax.devices()[:1])
  engine = engines.build(c, model, tokenizer, mesh, memory_budget=2**30)
  assert "sampler memory plan:" in capsys.readouterr().out and engine.engine.config.num_slots == 8
  # 8 slots do not fit: the most that do, and the run says so
  eight = memory.plan(engine.engine, None, programs=_programs)
  room = eight.peak_bytes - eight.state // 2
  c.rollout.n_samples = 2
  engine = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  slots = engine.engine.config.num_slots
  assert 2 <= slots < 8 and memory.plan(engine.engine, room, programs=_programs).fits
  assert "rollout.num_slots=8 does not fit" in capsys.readouterr().out
  one_more = DecodeEngine(model, EngineConfig(num_slots=slots + 1, max_len=32, prefill_buckets=(16,)))
  assert not memory.plan(one_more, room, programs=_programs).fits  # the most that fit
  c.rollout.n_samples = 8  # a group needs 8 slots at once: no fewer will do
  with pytest.raises(MemoryError, match="at least 8 needed: rollout.n_samples"):
    engines.build(c, model, tokenizer, mesh, memory_budget=room)
  with pytest.raises(MemoryError, match="sampler memory plan: does not fit"):
    engines.build(c, model, tokenizer, mesh, memory_budget=2**16)


def test_auto_weight_swap_pauses_before_it_takes_slots(capsys):
  """``rollout.weight_swap="auto"``: the swap overlaps decode calls where the plan fits that;
  where it fits only paused (the current version let go of first, no decode call beside it) the
  sampler pauses for swaps and keeps its slots; forced to overlap it loses slots instead.
  Colocated (idle during a swap anyway) it pauses."""
  from areal_jax import config as config_lib
  from areal_jax.models import tokenizer as tok_lib
  from areal_jax.runtime import engines

  c = config_lib.base_config()
  c.rollout.num_slots, c.rollout.prefill_buckets, c.rollout.max_new_tokens = 8, (16,), 240
  c.rollout.n_samples = 2
  model, tokenizer = tiny_model(0), tok_lib.byte_tokenizer()
  mesh = sharding.make_mesh({}, jax.devices()[:1])
  roomy = engines.build(c, model, tokenizer, mesh, memory_budget=2**30)
  assert roomy.weight_swap == "overlap" and not roomy.memory_plan.swap_pauses
  over = memory.plan(roomy.engine, None, programs=_programs)
  paused = memory.plan(roomy.engine, None, weight_swap="pause", programs=_programs)
  assert paused.peak_bytes == paused.resident_bytes + max(
      paused.incoming, paused.generate_temp, paused.prefill) < over.peak_bytes
  room = (paused.peak_bytes + over.peak_bytes) // 2
  capsys.readouterr()
  engine = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  assert engine.weight_swap == "pause" and engine.memory_plan.swap_pauses
  assert engine.engine.config.num_slots == 8 and engine.memory_plan.fits
  assert "it pauses the sampler instead" in capsys.readouterr().out
  c.rollout.weight_swap = "overlap"
  engine = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  assert engine.weight_swap == "overlap" and 2 <= engine.engine.config.num_slots < 8
  c.rollout.weight_swap, c.mesh.colocated = "auto", True
  assert engines.build(c, model, tokenizer, mesh).weight_swap == "pause"


def test_fit_looks_at_a_groups_slots_before_giving_up(monkeypatch):
  """``slots_that_fit`` extrapolates from the widest plan; where that plan's decode program was
  refused by the compiler (costed at everything it said it needed) it undershoots: before
  stopping, the plan is looked at once with the fewest slots a group needs."""
  eight = memory.plan(_engine(slots=8), None, programs=_programs)
  budget = memory.plan(_engine(slots=2), None, programs=_programs).peak_bytes
  assert not memory.plan(_engine(slots=8), budget, programs=_programs).fits
  monkeypatch.setattr(memory.SamplerPlan, "slots_that_fit", lambda self: 1)  # (undershooting)
  holder = types.SimpleNamespace
  engine, p = memory.fit(lambda n: holder(engine=_engine(slots=n)), 8, min_slots=2,
                         budget_bytes=budget, programs=_programs)
  assert p.fits and p.num_slots == 2 == engine.engine.config.num_slots
  with pytest.raises(MemoryError, match="at least 2 needed"):  # (and not below a group)
    memory.fit(lambda n: holder(engine=_engine(slots=n)), 8, min_slots=2,
               budget_bytes=budget - eight.state // 8, programs=_programs)


def test_a_lora_base_counts_unless_it_is_the_learners_own():
  from areal_jax.models import lora
  eng = DecodeEngine(tiny_model(0), EngineConfig(num_slots=4, max_len=32, prefill_buckets=(8,)),
                     lora=lora.LoraConfig(rank=2, alpha=4.0))
  base = sum(x.nbytes for x in jax.tree.leaves(eng.weights.lora_base))
  own, shared = memory.plan(eng, None), memory.plan(eng, None, shared_base=True)
  assert own.lora_base == base > 0 and shared.lora_base == 0
  assert own.peak_bytes - shared.peak_bytes == base


def test_the_programs_compiled_for_the_plan_are_the_ones_the_sampler_runs():
  """With the persistent compilation cache (on in these tests, as in launch.py's runs) the
  sampler's first decode and prefill calls at the planned shapes read the plan's compilations."""
  from jax._src import monitoring
  events = []
  listener = lambda event, **_: events.append(event)  # noqa: E731
  monitoring.register_event_listener(listener)
  try:
    eng = DecodeEngine(tiny_model(0), EngineConfig(num_slots=12, max_len=40, prefill_buckets=(8,)))
    memory.plan(eng, None)  # a shape no other test compiles
    hits = lambda: events.count("/jax/compilation_cache/cache_hits")  # noqa: E731
    before = hits()
    eng.generate(eng.params, eng.init_state(), eng.kv_buckets[-1])
    eng.prefill_batch(eng.params, [[1] * eng.prefill_buckets[-1]] * eng.config.max_prefill_batch)
    assert hits() - before == 2  # (init_state's program is the only new compilation)
  finally:
    monitoring.unregister_event_listener(listener)


def test_a_paged_cache_is_planned_as_its_pool_not_its_slots():
  """With kv_pages the decode state is the pool of pages (and per-slot vectors), whatever the slot
  count; a pool that does not fit is lowered to the pages that do (the slots kept), and where not
  even a group's sequences' pages fit the run stops naming rollout.kv_pages, not 'fixed' by fewer
  slots."""
  def engine(slots):
    return DecodeEngine(tiny_model(0), EngineConfig(
        num_slots=slots, max_len=64, prefill_buckets=(16,), kv_pages=8, page_size=16,
        decode_layers="scan", decode_matmul="xla"))
  eng = engine(16)
  p = memory.plan(eng, None, programs=_programs)
  pool = 2 * (TINY.n_kv_heads * TINY.n_layers * 9 * 16 * TINY.head_dim * 4)  # k, v; 8 + trash
  vectors = sharding.device_bytes({k: v for k, v in eng.state_shapes().items() if k != "cache"})
  assert p.state == pool + vectors and p.kv_pages == 8 and "8 pages" in p.summary()
  rows = DecodeEngine(tiny_model(0), EngineConfig(num_slots=16, max_len=64, prefill_buckets=(16,),
                                                  decode_layers="scan", decode_matmul="xla"))
  # 16 slots x 64 positions: 1024 vs 144
  assert memory.plan(rows, None, programs=_programs).state > 4 * p.state
  with pytest.raises(MemoryError, match=r"Lower rollout.kv_pages \(now 8"):
    memory.check(eng, p.peak_bytes - 1, programs=_programs)
  made = []

  def make(n, kv_pages=8):
    made.append((n, kv_pages))
    return types.SimpleNamespace(engine=DecodeEngine(tiny_model(0), dataclasses.replace(
        eng.config, num_slots=n, kv_pages=kv_pages)))

  holder, fitted = memory.fit(make, 16, budget_bytes=p.peak_bytes - 1,
                                   programs=_programs)
  assert made == [(16, 8), (16, 7)] and fitted.fits and fitted.kv_pages == 7
  made.clear()
  with pytest.raises(MemoryError, match=r"Lower rollout.kv_pages \(now 8"):  # (a group of 3: 12)
    memory.fit(make, 16, min_slots=3, budget_bytes=p.peak_bytes - 1,
               programs=_programs)
  assert made == [(16, 8)]  # no smaller slot count tried


def _paged(slots, kv_pages=-1):
  return DecodeEngine(tiny_model(0), EngineConfig(
      num_slots=slots, max_len=64, prefill_buckets=(16,), kv_pages=kv_pages, page_size=16,
      decode_layers="scan", decode_matmul="xla"))


@pytest.mark.slow
def test_a_pool_sized_by_the_slots_keeps_them_over_the_pages_that_fit(monkeypatch, capsys):
  """kv_pages -1 where the platform pages (the GPU's choice, forced on CPU): the pool is a page
  for every position the slots could hold. Where that does not fit, the slots stay and the pool
  is the most pages the budget holds (sequences take pages as they grow), if those hold a group's
  sequences to max_len; below that, slots go with their pool, as rows."""
  monkeypatch.setenv(choice.PAGED_ENV, "1")
  eng = _paged(16)
  assert eng.paged and eng.pool_follows_slots and eng.config.kv_pages == 16 * (4 + 1)
  p = memory.plan(eng, None, programs=_programs)
  page = 2 * TINY.n_kv_heads * TINY.n_layers * 16 * TINY.head_dim * 4  # k, v of 16 positions
  assert p.pool_follows_slots and f"{16 * 5} pages" in p.summary() and p.page_bytes == page
  budget = p.peak_bytes - p.state // 2
  made = []

  def make(n, **kw):
    made.append((n, kw))
    return types.SimpleNamespace(engine=_paged(n, **kw))

  holder, fitted = memory.fit(make, 16, min_slots=4, budget_bytes=budget,
                               programs=_programs)
  pages = holder.engine.config.kv_pages
  assert made[0] == (16, {}) and made[-1] == (16, {"kv_pages": pages})
  assert fitted.fits and fitted.num_slots == 16 and not fitted.pool_follows_slots
  assert 4 * 4 <= pages < 16 * 5 and fitted.kv_pages == pages
  # the most pages that fit
  assert not memory.plan(_paged(16, pages + 1), budget, programs=_programs).fits
  assert f"the 16 slots are kept over a pool of {pages} pages" in capsys.readouterr().out
  # a group of 16 needs 64 pages (16 rows of 4): the pool cannot hold it, nor can fewer slots
  made.clear()
  with pytest.raises(MemoryError, match="at least 16 needed"):
    memory.fit(make, 16, min_slots=16, budget_bytes=budget, programs=_programs)
  assert all(not kw for _, kw in made)
  # where 16 slots' prefill call leaves no room for a group's pages (2 rows) but 2 slots fit:
  # slots go, and the pool follows them
  made.clear()
  small = memory.plan(_paged(2), None, programs=_programs).peak_bytes
  assert memory.plan(_paged(16), small, programs=_programs).pages_that_fit() < 2 * 4
  holder, fitted = memory.fit(make, 16, min_slots=2, budget_bytes=small,
                               programs=_programs)
  assert fitted.fits and 2 <= fitted.num_slots < 16 and fitted.pool_follows_slots
  assert holder.engine.config.kv_pages == fitted.num_slots * 5
  with pytest.raises(MemoryError, match="lower rollout.num_slots"):
    memory.check(eng, p.peak_bytes - 1, programs=_programs)


def test_the_plan_bounds_every_prefill_call_under_a_token_budget():
  """With ``max_prefill_tokens`` the largest prefill call may be at a smaller bucket with more
  rows: the plan takes the largest of the calls the engine can make, and a budget shrinks it."""
  cfg = dict(num_slots=8, max_len=96, prefill_buckets=(16, 32, 64))
  capped = DecodeEngine(tiny_model(0), EngineConfig(max_prefill_tokens=128, **cfg))
  free = DecodeEngine(tiny_model(0), EngineConfig(**cfg))
  plan = memory.plan(capped, None)
  assert plan.prefill < memory.plan(free, None).prefill
  for bucket in capped.prefill_buckets:
    for rows in {capped.prefill_rows(k, bucket) for k in range(1, 9)}:
      fn = capped._make_prefill(bucket, rows)  # noqa: SLF001
      m = fn.lower(capped.params, jax.ShapeDtypeStruct((rows, bucket), "int32")).compile()
      m = m.memory_analysis()
      assert m.temp_size_in_bytes + m.output_size_in_bytes <= plan.prefill, (bucket, rows)


@pytest.mark.parametrize("on_host", [False, True], ids=["one program", "truncation on host"])
def test_the_plan_bounds_the_top_p_program_too(monkeypatch, on_host):
  """Where the engine compiles a decode program for slots that truncate (top-k / top-p, its sort
  of the vocabulary) apart from the one without (on GPU; forced here), the plan counts the larger;
  elsewhere the one program holds both branches, and the plan counts it."""
  monkeypatch.setenv(choice.TRUNCATION_ENV, "1" if on_host else "0")
  eng = DecodeEngine(tiny_model(0), EngineConfig(num_slots=8, max_len=48, prefill_buckets=(8,)))
  assert eng.truncation_on_host == on_host
  plan = memory.plan(eng, None)

  def temp(truncate):
    fn = eng._make_generate(eng.kv_buckets[-1], 8, truncate=truncate)  # noqa: SLF001
    return fn.lower(eng.params, eng.state_shapes()).compile().memory_analysis().temp_size_in_bytes

  without, with_sort = temp(False), temp(True)
  assert max(without, with_sort) == plan.generate_temp
  if on_host:  # two programs: the sort's buffers are the larger one's
    assert with_sort > without
  else:  # one program, whatever the slots ask
    assert with_sort == without


def test_a_row_cache_plans_the_turns_multi_turn_episodes_keep(capsys):
  """A row cache copies a finished turn's row out for the episode's next turn: the plan counts
  one a slot where the workflow runs several turns, fewer where the budget has no room for them
  (the slots are kept), none for single-turn episodes; a paged cache keeps pages of its pool."""
  from areal_jax import config as config_lib
  from areal_jax.models import tokenizer as tok_lib
  from areal_jax.runtime import engines

  c = config_lib.base_config()
  c.rollout.num_slots, c.rollout.prefill_buckets, c.rollout.max_new_tokens = 8, (16,), 16
  c.rollout.weight_swap = "overlap"
  model, tokenizer = tiny_model(0), tok_lib.byte_tokenizer()
  mesh = sharding.make_mesh({}, jax.devices()[:1])
  single = engines.build(c, model, tokenizer, mesh, memory_budget=2**30)
  assert single.memory_plan.kept_rows == 0 and single._continued.capacity == 0
  # the server keeps every chat turn for its conversation's next request (serve.keep_turns)
  chats = engines.build(c, model, tokenizer, mesh, memory_budget=2**30, keep_turns=True)
  assert chats.memory_plan.kept_rows == 8 and chats._continued.capacity == 8
  c.rollout.workflow = "multi_turn"
  multi = engines.build(c, model, tokenizer, mesh, memory_budget=2**30)
  p = multi.memory_plan
  row = sharding.device_bytes(multi.engine.state_shapes()["cache"]) // 8  # one slot's row
  assert p.row_bytes == row and p.kept_rows == 8 and multi._continued.capacity == 8
  assert p.resident_bytes == p.weights + p.memo + p.state + 8 * row and p.fits
  assert "8 continuation rows" in capsys.readouterr().out
  # room for 3 rows beside the plan: 3 kept, all 8 slots stay
  bare = dataclasses.replace(p, kept_rows=0)
  room = bare.peak_bytes + 3 * row + row // 2
  three = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  assert three.engine.config.num_slots == 8 and three.memory_plan.kept_rows == 3
  assert three._continued.capacity == 3 and three.memory_plan.fits
  assert dataclasses.replace(three.memory_plan, kept_rows=4).fits is False
  # unplanned (no budget): one a slot, as before; a paged cache: pages of its pool, no rows
  assert engines.build(c, model, tokenizer, mesh)._continued.capacity == 8
  c.rollout.kv_pages, c.rollout.page_size = 8, 8
  paged = engines.build(c, model, tokenizer, mesh, memory_budget=2**30)
  assert paged.memory_plan.row_bytes == 0 and paged._continued.capacity == 8


@pytest.mark.parametrize("paged", [False, True], ids=["rows", "paged"])
@pytest.mark.slow
def test_a_continuing_turn_holds_no_more_than_the_planned_prefill(paged):
  """A multi-turn continuation (``sampler.continuation``) is not planned on its own: it works on
  a row of a prefill bucket, so its read of the kept row (or pages) and its extend over the new
  tokens hold no more than the prefill call the plan counts, at every bucket and chunk."""
  from areal_jax.sampler import continuation, pages, row_programs, slot_cache
  kw = dict(kv_pages=16, page_size=8) if paged else {}
  eng = DecodeEngine(tiny_model(0), EngineConfig(num_slots=4, max_len=96, max_prefill_tokens=64,
                                                 prefill_buckets=(16, 32, 64), **kw))
  plan = memory.plan(eng, None)
  table = pages.PageTable(4, 16, 8, 96) if paged else None
  kept = continuation.Continuations(eng, 1, table)
  cfg, layout = eng.model_cfg, eng.cache_layout
  for length in eng.prefill_buckets:
    row = jax.eval_shape(lambda n=length: slot_cache.make(cfg, 1, n, eng._cache_dtype, layout))
    source = ((eng.state_shapes()["cache"], jax.ShapeDtypeStruct((-(-length // 8),), "int32"))
              if paged else (row,))
    read = kept._make_take(length).lower(*source).compile().memory_analysis()
    for chunk in sorted({continuation.MIN_CHUNK, length // 2}):  # (at 32: one chunk of 16)
      m = row_programs.extend(eng, length).lower(
          eng.params, row, jax.ShapeDtypeStruct((1, chunk), "int32"),
          jax.ShapeDtypeStruct((1,), "int32")).compile().memory_analysis()
      held = read.output_size_in_bytes + read.temp_size_in_bytes + m.temp_size_in_bytes
      assert held <= plan.prefill, (length, chunk, held, plan.prefill)
