"""Data-parallel sampling as replicas: an engine per data index behind one RolloutEngine."""

import functools
import re
import time
import types

import jax
import numpy as np
import pytest

from areal_jax import sharding
from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
from areal_jax.sampler.replicas import ReplicatedRolloutEngine, on_mesh
from areal_jax.sampler.service import JaxRolloutEngine

from .test_service import _collect

KW = dict(max_len=64, prefill_buckets=(16, 32), kv_buckets=(32, 64), steps_per_call=2,
          decode_attention="xla", decode_matmul="xla", decode_layers="scan")


def _replicated(model, data=4, slots=4, **kw):
  mesh = sharding.make_mesh({"data": data}, jax.devices()[:data])
  return ReplicatedRolloutEngine(
      lambda m, out: JaxRolloutEngine(model, mesh=m, num_slots=slots, output=out, **{**KW, **kw}),
      sharding.split_mesh(mesh, "data"))


def _requests(count=6, n=2, budget=(5, 9, 14)):
  return [GroupRequest(g, [g + 1, 3, 5, 7][: 2 + g % 3], n=n, params=SamplingParams(
      temperature=1.0, max_new_tokens=budget[g % len(budget)], seed=g)) for g in range(count)]


def _run(engine, requests):
  engine.start()
  try:
    for r in requests:
      engine.submit(r)
    samples = _collect(engine, sum(r.n for r in requests))
  finally:
    engine.stop()
  return {(s.group_id, s.index): s for s in samples}


def test_split_mesh_gives_one_sub_mesh_per_data_index():
  mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
  subs = sharding.split_mesh(mesh, "data")
  assert [dict(m.shape) for m in subs] == [{"data": 1, "fsdp": 1, "tensor": 2}] * 2
  assert [list(m.devices.flat) for m in subs] == [list(mesh.devices[i].flat) for i in range(2)]
  # an array on the whole mesh (split over the tensor axis, replicated over data) viewed on a
  # sub-mesh: its own shards there, no copy
  x = jax.device_put(np.arange(32.0).reshape(4, 8), jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "tensor")))
  y = on_mesh(x, subs[1])
  assert y.sharding.mesh == subs[1] and y.sharding.spec == x.sharding.spec
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  src = {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  assert all(s.data.unsafe_buffer_pointer() == src[s.device] for s in y.addressable_shards)
  split = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  assert on_mesh(split, subs[1]) is split and on_mesh(np.ones(3), subs[1]).shape == (3,)


@functools.lru_cache(maxsize=1)
def _reference(model):
  return _run(JaxRolloutEngine(model, num_slots=16, **KW), _requests(8))


@pytest.mark.parametrize("data,pages", [(2, 0), (4, 12)])
@pytest.mark.slow
def test_replicas_draw_what_one_engine_draws(model, data, pages):
  """Replicas of 4 slots (a paged cache each: one engine over a data axis cannot hold one) give
  every sample one 16-slot engine gives: same tokens, logprobs, versions; the groups spread over
  the replicas and every sample is counted back."""
  page_kw = dict(kv_pages=pages, page_size=16) if pages else {}
  eng = _replicated(model, data=data, **page_kw)
  got, ref = _run(eng, _requests(8)), _reference(model)
  assert got.keys() == ref.keys()
  for key, s in got.items():
    assert s.tokens == ref[key].tokens and s.versions == ref[key].versions
    np.testing.assert_allclose(s.logprobs, ref[key].logprobs, atol=1e-5)
    assert s.finish_reason == ref[key].finish_reason == "length"
  assert all(r.stats["finished"] >= 2 for r in eng.replicas)  # 8 groups of 2 over the replicas
  assert eng.load() == ([0] * data, 0) and eng.stats["finished"] == 16
  assert eng.num_slots == 4 * data and eng.engine is eng.replicas[0].engine
  if pages:
    assert all(r._paging.table.free_pages == pages for r in eng.replicas)


def _wait_for(condition, timeout=30.0):
  deadline = time.time() + timeout
  while not condition() and time.time() < deadline:
    time.sleep(0.02)
  assert condition()


def test_groups_wait_for_a_replica_with_room_and_go_to_the_least_loaded(model):
  eng = _replicated(model, data=2, slots=4)
  eng.submit(GroupRequest(20, [1, 2], n=1))  # not started: waits here; stop aborts it
  eng.stop()
  assert [(s.group_id, s.finish_reason) for s in eng.poll()] == [(20, "abort")]
  eng.start()
  eng.pause()  # the replicas take groups but decode nothing
  try:
    for r in _requests(3, n=2) + [GroupRequest(9, [1, 2], n=1), GroupRequest(10, [3, 4], n=2)]:
      eng.submit(r)
    # groups 0 and 2 -> replica 0 (equal loads: the lowest index), 1 and 9 -> replica 1; group 10
    # waits: neither replica has two slots left
    _wait_for(lambda: eng.load() == ([4, 3], 1))
    eng.abort(1)  # its replica gives its samples back: room for group 10 there
    assert {(s.group_id, s.finish_reason) for s in _collect(eng, 2)} == {(1, "abort")}
    _wait_for(lambda: eng.load() == ([4, 3], 0))
    eng.submit(GroupRequest(12, [5, 6], n=2))  # waits, then is aborted while waiting
    _wait_for(lambda: eng.load()[1] == 1)
    eng.abort(12)
    assert {(s.group_id, s.finish_reason) for s in _collect(eng, 2)} == {(12, "abort")}
    eng.submit(GroupRequest(13, [5, 6], n=5))  # more than a replica's slots: refused at once
    (bad,) = [s for s in _collect(eng, 5) if s.index == 0]
    assert bad.finish_reason == "error" and "slot count 4" in bad.error
    eng.resume()
    done = _collect(eng, 7)
  finally:
    eng.stop()
  assert {s.group_id for s in done} == {0, 2, 9, 10} and eng.load() == ([0, 0], 0)
  assert not {s.finish_reason for s in done} & {"abort", "error"}


@pytest.mark.slow
def test_a_conversation_continues_on_the_replica_that_kept_its_turn(model):
  """The next turn goes where the last turn's KV is kept (not to the least loaded replica), so
  that replica continues it instead of prefilling the history."""
  eng = _replicated(model, data=2, slots=4)
  eng.start()
  try:
    eng.submit(GroupRequest(0, [9, 9, 9], n=1, params=SamplingParams(max_new_tokens=40, seed=1)))
    first = [1, 2, 3, 4, 5]
    eng.submit(GroupRequest(1, first, n=1, params=SamplingParams(max_new_tokens=6, seed=2),
                            metadata={"continue": True}))
    (turn,) = [s for s in _collect(eng, 2) if s.group_id == 1] or [None]
    assert eng.replicas[1].stats["finished"] >= 1  # turn 1 ran on replica 1 (0 was busier)
    nxt = first + turn.tokens + [7, 7]
    eng.submit(GroupRequest(2, nxt, n=1, params=SamplingParams(max_new_tokens=4, seed=3),
                            metadata={"continue": True}))
    _collect(eng, 1)
  finally:
    eng.stop()
  assert eng.replicas[1].stats["continued"] == 1 and eng.replicas[0].stats["continued"] == 0


@pytest.mark.slow
def test_a_weight_version_reaches_every_replica(model, other_model):
  from flax import nnx

  # as a weight transfer hands them over: replicated over the whole sampler mesh
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  new = jax.device_put(nnx.to_pure_dict(nnx.state(other_model, nnx.Param)),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  eng = _replicated(model, data=2, slots=4)  # (the other tests' replicas: their programs)
  eng.update_params(new, 3)  # before start: in use at once
  for r in eng.replicas:  # each replica's copy on its own device
    assert {frozenset(leaf.sharding.device_set) for leaf in jax.tree.leaves(r.engine.params)} == {
        frozenset(r.engine.mesh.devices.flat)}
  assert eng.version == 3
  got = _run(eng, _requests(4))
  ref = _run(JaxRolloutEngine(other_model, num_slots=4, **KW), _requests(4))
  for key, s in got.items():
    assert set(s.versions) == {3} and s.tokens == ref[key].tokens
  eng.start()  # in flight, on the same (stopped) replicas: each swaps between its own calls
  try:
    for r in _requests(4, budget=(30,)):
      eng.submit(r)
    eng.update_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), 4)
    samples = _collect(eng, 8)
  finally:
    eng.stop()
  assert eng.version == 4 and all(r.stats["swaps"] == 2 for r in eng.replicas)
  for s in samples:
    assert s.versions == sorted(s.versions) and set(s.versions) <= {3, 4}


@pytest.mark.slow
def test_warmup_compiles_every_replica_at_once(model):
  eng = _replicated(model, data=2, slots=1, prefill_buckets=(16,), kv_buckets=(64,))
  ticks = []
  eng.warmup(lambda done, total, what: ticks.append((done, total, what)))
  counts = [r.compile_stats()["compiles"] for r in eng.replicas]
  assert counts[0] == counts[1] > 0 and eng.compile_stats()["compiles"] == sum(counts)
  # progress over both replicas: each program once, counted up to a total known from the start
  assert [t[:2] for t in ticks] == [(k, sum(counts)) for k in range(1, sum(counts) + 1)]
  assert sum(t[2].startswith("replica 1: ") for t in ticks) == counts[1]
  # with the continuation programs (a server keeping its chats' turns): each replica's too
  ticks.clear()
  eng.warmup(lambda done, total, what: ticks.append((done, total, what)), continuations=True)
  total = sum(r.warmup_count(True) for r in eng.replicas)
  assert total > sum(counts) and [t[:2] for t in ticks] == [(k, total) for k in range(1, total + 1)]
  assert sum("replica 1: continuation" in t[2] for t in ticks) == \
      eng.replicas[1].warmup_count(True) - eng.replicas[1].warmup_count()


def _collectives(compiled_text: str) -> list[str]:
  return re.findall(r"= (\S+) (?:all-gather|all-to-all|collective-permute|all-reduce)\(",
                    compiled_text)


def test_an_engine_over_a_data_axis_decodes_at_full_width_without_moving_its_cache(model):
  """Slots split over devices: one width (the full one), whose decode program moves nothing of
  cache size between devices; a replica's program has no collective at all."""
  mesh = sharding.make_mesh({"data": 4}, jax.devices()[:4])
  config = EngineConfig(num_slots=16, max_len=64, steps_per_call=2, decode_attention="dense",
                        decode_matmul="xla", decode_layers="scan")
  eng = DecodeEngine(model, config, mesh)
  assert eng.width_buckets == (16,)
  cache_elems = int(np.prod(eng.state_shardings["cache"]["k"].shard_shape(
      eng.state_shapes()["cache"]["k"].shape)))
  text = eng._make_generate(64, 16).lower(eng.params, eng.state_shapes()).compile().as_text()
  sizes = [int(np.prod([int(d) for d in re.search(r"\[([\d,]*)\]", shape)[1].split(",") if d]))
           for shape in _collectives(text)]
  assert max(sizes) < cache_elems
  one = DecodeEngine(model, config, sharding.split_mesh(mesh, "data")[0])
  assert one.width_buckets == (2, 4, 8, 16)
  text = one._make_generate(64, 4).lower(one.params, one.state_shapes()).compile().as_text()
  assert _collectives(text) == []


def test_engines_build_makes_a_replica_per_data_index_and_plans_one(capsys):
  from areal_jax import config as config_lib
  from areal_jax.models import tokenizer as tok_lib
  from areal_jax.runtime import engines
  from areal_jax.sampler import memory

  from .conftest import tiny_model

  c = config_lib.base_config()
  c.rollout.num_slots, c.rollout.prefill_buckets, c.rollout.max_new_tokens = 8, (16,), 16
  c.rollout.n_samples = 2
  model, tokenizer = tiny_model(0), tok_lib.byte_tokenizer()
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  eng = engines.build(c, model, tokenizer, mesh)
  assert isinstance(eng, ReplicatedRolloutEngine) and eng.num_slots == 8
  assert [r.engine.mesh.devices.tolist() for r in eng.replicas] == [[[[d]]] for d in mesh.devices.flat]
  # a budget four slots do not fit: the first replica's plan lowers every replica's slots
  four = memory.plan(eng.engine, None)
  room = four.peak_bytes - four.state // 3
  # (rollout.weight_swap="auto" fits it with the swap paused, every replica so, all slots kept)
  eng = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  assert [r.weight_swap for r in eng.replicas] == ["pause", "pause"] and eng.num_slots == 8
  c.rollout.weight_swap = "overlap"
  capsys.readouterr()
  eng = engines.build(c, model, tokenizer, mesh, memory_budget=room)
  out = capsys.readouterr().out
  assert "each of 2 replicas" in out and "rollout.num_slots=4 does not fit" in out
  slots = {r.engine.config.num_slots for r in eng.replicas}
  assert len(slots) == 1 and 2 <= slots.pop() < 4
  # each replica holds the plan it was sized by (the launch it times must fit it: test_launch_tuning)
  assert [r.memory_plan for r in eng.replicas] == [eng.memory_plan] * 2
  assert eng.memory_plan.budget_bytes == room
  c.rollout.data_parallel = "sharded"  # one engine, its slots split over the data axis
  eng = engines.build(c, model, tokenizer, mesh)
  assert isinstance(eng, JaxRolloutEngine) and eng.engine.width_buckets == (8,)
  assert engines.replica_meshes(sharding.make_mesh({}, jax.devices()[:1]), "replicas") is None
  with pytest.raises(ValueError, match="rollout.data_parallel='rows'"):
    engines.replica_meshes(mesh, "rows")


def test_config_checks_that_a_group_fits_one_replica():
  from areal_jax import config as config_lib

  c = config_lib.base_config()
  c.mesh.sampler_devices, c.rollout.num_slots, c.rollout.n_samples = 4, 8, 4
  with pytest.raises(ValueError, match="rollout.n_samples=4 exceeds the 2 slots of one sampler "
                                       "replica"):
    config_lib.validate(c, n_devices=8)
  c.rollout.data_parallel = "sharded"
  config_lib.validate(c, n_devices=8)
  c.rollout.data_parallel = "rows"
  with pytest.raises(ValueError, match="rollout.data_parallel='rows' must be"):
    config_lib.validate(c, n_devices=8)


@pytest.mark.slow
def test_replicas_share_the_pool_their_first_plan_sized_to_memory(monkeypatch, capsys):
  """A paged cache whose slots' pool does not fit: the first replica's plan keeps the slots over
  the pages that fit, every replica takes that pool, and the run's groups all finish on it."""
  from areal_jax import config as config_lib
  from areal_jax.kernels import choice
  from areal_jax.runtime import engines
  from areal_jax.sampler import memory

  from .conftest import tiny_model

  monkeypatch.setenv(choice.PAGED_ENV, "1")  # (the GPU's choice, on CPU)
  c = config_lib.base_config()
  c.rollout.num_slots, c.rollout.prefill_buckets, c.rollout.max_new_tokens = 8, (16,), 48
  c.rollout.n_samples, c.rollout.page_size, c.rollout.weight_swap = 2, 16, "overlap"
  c.rollout.decode_attention, c.rollout.decode_matmul = "dense", "xla"
  model, tokenizer = tiny_model(0), types.SimpleNamespace(eos_token_ids=())  # (no EOS)
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  roomy = engines.build(c, model, tokenizer, mesh)
  four = memory.plan(roomy.engine, None)
  assert four.pool_follows_slots and four.kv_pages == 4 * 5
  capsys.readouterr()
  eng = engines.build(c, model, tokenizer, mesh, memory_budget=four.peak_bytes - 8 * four.page_bytes)
  assert "the 4 slots are kept over a pool of" in capsys.readouterr().out
  pools = {r.engine.config.kv_pages for r in eng.replicas}
  slots = {r.engine.config.num_slots for r in eng.replicas}
  assert slots == {4} and len(pools) == 1 and 2 * 4 <= pools.pop() < 4 * 5
  requests = [GroupRequest(g, [g + 1, 3, 5], n=2, params=SamplingParams(
      temperature=1.0, max_new_tokens=(40, 12, 30)[g % 3], seed=g)) for g in range(6)]
  samples = _run(eng, requests)
  assert len(samples) == 12
  assert all(s.finish_reason == "length" and len(s.tokens) == (40, 12, 30)[s.group_id % 3]
             for s in samples.values())
