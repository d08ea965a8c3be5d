"""Multi-turn continuation: the next turn extends the previous turn's kept KV row instead of
prefilling the whole conversation, and samples exactly what a full re-prefill samples."""

import time
import types

import numpy as np
import pytest
from flax import nnx

from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler import continuation, slot_cache
from areal_jax.sampler.service import JaxRolloutEngine

from .conftest import compiles, full_forward_logprobs


def _one(engine, request, timeout=120.0):
  engine.submit(request)
  deadline = time.time() + timeout
  while time.time() < deadline:
    out = engine.poll(timeout=0.5)
    if out:
      assert len(out) == 1 and out[0].finish_reason != "error", out
      return out[0]
  raise AssertionError("no sample")


@pytest.mark.parametrize("layers", ["unrolled", "scan", "paged", "paged-unrolled"])
@pytest.mark.slow
def test_continued_turn_equals_full_reprefill(model, other_model, layers):
  kw = dict(decode_layers="scan", decode_matmul="xla", decode_projections="fused") \
      if layers in ("scan", "paged") else {}
  if layers.startswith("paged"):  # the kept row is read out of the slot's pages
    kw.update(kv_pages=24, page_size=16, decode_attention="dense")
  engine = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(96,), **kw)
  inserted = []  # positions of each prefix inserted: a continuation's row is a prefill bucket's
  insert = engine.engine.insert
  engine.engine.insert = lambda state, prefix, *a, **k: (
      inserted.append(slot_cache.prefix_len(prefix, engine.engine.cache_layout)),
      insert(state, prefix, *a, **k))[1]
  engine.start()
  try:
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 128, 21)]
    first = _one(engine, GroupRequest(1, prompt, 1, SamplingParams(greedy=True, max_new_tokens=9),
                                      {"continue": True}))
    follow = prompt + first.tokens + [7, 8, 9, 10, 11]  # the environment's tokens
    cut = prompt + first.tokens[:4] + [7, 8, 9]  # a turn cut short (a tool call), then a result
    cases = [(2, follow, SamplingParams(greedy=True, max_new_tokens=12)),
             (4, follow, SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)),
             (6, cut, SamplingParams(greedy=True, max_new_tokens=12))]
    for gid, tokens, params in cases:
      if gid > 2:  # keep the first turn again
        _one(engine, GroupRequest(gid - 1, prompt, 1, SamplingParams(greedy=True, max_new_tokens=9),
                                  {"continue": True}))
      continued = _one(engine, GroupRequest(gid, tokens, 1, params))
      assert engine.stats["continued"] == gid // 2
      assert len(engine._continued) == 0  # a kept row is used once
      full = _one(engine, GroupRequest(gid + 10, tokens, 1, params))  # nothing kept: prefilled
      assert engine.stats["continued"] == gid // 2
      assert continued.tokens == full.tokens
      np.testing.assert_allclose(continued.logprobs, full.logprobs, rtol=1e-4, atol=1e-5)
    # each turn, continued or prefilled, held a row of the prefill bucket holding it, not max_len
    assert set(inserted) == {96}, inserted
    # a weight swap drops kept rows: the next turn is prefilled under the new weights
    _one(engine, GroupRequest(20, prompt, 1, SamplingParams(greedy=True, max_new_tokens=9),
                              {"continue": True}))
    assert len(engine._continued) == 1
    engine.update_params(nnx.to_pure_dict(nnx.state(other_model, nnx.Param)), 1)
    _one(engine, GroupRequest(21, follow, 1, SamplingParams(greedy=True, max_new_tokens=4)))
    assert engine.stats["continued"] == 3 and len(engine._continued) == 0
  finally:
    engine.stop()


def test_a_paused_swap_drops_the_row_of_a_turn_its_drain_finishes(model, other_model):
  """``weight_swap="pause"`` finishes the calls in flight before it converts the new version: a
  turn that ends in one of them ends under the old weights, and its row goes with every other
  kept row, so the conversation's next turn is prefilled under the new weights, not continued
  over the old KV with tokens tagged with the new version."""
  # (the engine of the continued-turn test: its programs, compiled once)
  engine = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(96,),
                            weight_swap="pause")
  prompt = [int(t) for t in np.random.default_rng(0).integers(1, 128, 21)]
  greedy = SamplingParams(greedy=True, max_new_tokens=1)
  engine.submit(GroupRequest(1, prompt, 1, greedy, {"continue": True}))
  # the loop's own steps, one at a time (no thread yet): the turn's one token is in flight when
  # the new version arrives, so the swap's drain is what finishes the turn
  engine._state = engine.engine.init_state()  # (as start does)
  engine._admit()
  engine._prefill_chunk()
  engine._dispatch()
  assert len(engine._inflight) == 1 and engine.stats["finished"] == 0
  engine.update_params(nnx.to_pure_dict(nnx.state(other_model, nnx.Param)), 1)
  first = engine.poll()
  assert len(first) == 1 and first[0].versions == [0] and engine.version == 1
  assert len(engine._continued) == 0
  engine.start()
  try:
    follow = prompt + first[0].tokens + [7, 8, 9]
    turn = _one(engine, GroupRequest(2, follow, 1, SamplingParams(greedy=True, max_new_tokens=6)))
    assert engine.stats["continued"] == 0 and turn.versions == [1] * 6
    np.testing.assert_allclose(turn.logprobs, full_forward_logprobs(other_model, follow,
                                                                    turn.tokens), atol=1e-4)
  finally:
    engine.stop()


def test_chunk_bucket_and_match():
  assert [continuation.chunk_bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
  kept = continuation.Continuations.__new__(continuation.Continuations)
  kept._rows = {(1, 2, 3, 4): None, (1, 2, 9): None, (5, 6): None}
  assert kept.match([1, 2, 3, 4, 7, 7]) == ((1, 2, 3, 4), 4)
  assert kept.match([1, 2, 3, 8]) == ((1, 2, 3, 4), 3)
  assert kept.match([1, 2, 7, 7, 7, 7]) == (None, 0)  # shares less than half
  # the row a continuation works on: the prefill bucket holding it, max_len past them, none beyond
  kept.engine = types.SimpleNamespace(config=types.SimpleNamespace(max_len=128),
                                      prefill_buckets=(32, 64, 127))
  assert [kept.row_length(n) for n in (1, 40, 64, 127, 128, 129)] == [32, 64, 64, 127, 128, None]


def test_a_paged_cache_keeps_a_turn_in_its_pool_and_gives_it_up_before_anyone_waits(model):
  """A paged cache keeps a finished turn as its pages (the pool holds them, nothing is copied out);
  a group that needs those pages takes them back (the kept turn is evicted, nobody is preempted),
  and the next turn of the evicted conversation is prefilled, sampling the same."""
  engine = JaxRolloutEngine(model, num_slots=2, max_len=64, prefill_buckets=(48,), kv_pages=8,
                            page_size=8, decode_attention="dense", steps_per_call=4,
                            eos_token_ids=())
  table = engine._paging.table
  engine.start()
  try:
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 128, 21)]
    first = _one(engine, GroupRequest(1, prompt, 1, SamplingParams(greedy=True, max_new_tokens=9),
                                      {"continue": True}))
    deadline = time.time() + 10
    while table.kept_pages == 0 and time.time() < deadline:
      time.sleep(0.01)
    assert len(engine._continued) == 1 and table.kept_pages >= 4  # its 29 positions' pages
    assert table.free_pages == 8 and len(table._free) == 8 - table.kept_pages  # all obtainable
    # a long sequence needs every page of the pool: the kept turn's go back, nobody waits
    other = _one(engine, GroupRequest(2, list(range(1, 41)), 1,
                                      SamplingParams(greedy=True, max_new_tokens=20)))
    assert other.finish_reason == "length" and len(other.tokens) == 20
    assert engine._continued.stats["evicted"] == 1 and len(engine._continued) == 0
    assert engine.stats["preempted"] == 0
    follow = prompt + first.tokens + [7, 8, 9]
    again = _one(engine, GroupRequest(3, follow, 1, SamplingParams(greedy=True, max_new_tokens=6)))
    assert engine.stats["continued"] == 0  # prefilled: nothing was kept
    # kept, continued from its pages, and the same sample as the prefilled one
    _one(engine, GroupRequest(4, prompt, 1, SamplingParams(greedy=True, max_new_tokens=9),
                              {"continue": True}))
    continued = _one(engine, GroupRequest(5, follow, 1,
                                          SamplingParams(greedy=True, max_new_tokens=6)))
    assert engine.stats["continued"] == 1 and continued.tokens == again.tokens
    np.testing.assert_allclose(continued.logprobs, again.logprobs, rtol=1e-4, atol=1e-5)
    deadline = time.time() + 10
    while len(table._free) < 8 and time.time() < deadline:
      time.sleep(0.01)
    assert len(table._free) == 8 and table.kept_pages == 0  # every page back
  finally:
    engine.stop()


@pytest.mark.parametrize("paged", [False, True])
def test_short_turns_keep_more_conversations_in_the_same_memory(model, paged):
  """Kept rows are charged the positions they hold, not max_len: a capacity of one max_len row
  keeps three short conversations (their rows the 32-position bucket, or two pages of 16), each
  continued (its row grown to the bucket its next turn needs) to what a full prefill samples."""
  kw = dict(kv_pages=24, page_size=16, decode_attention="dense") if paged else {}
  engine = JaxRolloutEngine(model, num_slots=4, max_len=128, **kw)
  engine._continued.capacity = 1  # one row of 128 positions' worth
  engine.start()
  try:
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 128, 10)] for _ in range(3)]
    greedy = SamplingParams(greedy=True, max_new_tokens=9)
    firsts = [_one(engine, GroupRequest(i, p, 1, greedy, {"continue": True}))
              for i, p in enumerate(prompts)]
    assert len(engine._continued) == 3 and engine._continued.kept_positions == 3 * 32
    for i, (prompt, first) in enumerate(zip(prompts, firsts)):
      follow = prompt + first.tokens + [7, 8, 9, 10, 11]
      continued = _one(engine, GroupRequest(10 + i, follow, 1, greedy))
      assert engine.stats["continued"] == i + 1
      full = _one(engine, GroupRequest(20 + i, follow, 1, greedy))  # nothing kept: prefilled
      assert continued.tokens == full.tokens
      np.testing.assert_allclose(continued.logprobs, full.logprobs, rtol=1e-4, atol=1e-5)
  finally:
    engine.stop()


@pytest.mark.parametrize("paged", [False, True])
def test_a_long_chunk_runs_in_pieces_to_the_same_sample(model, monkeypatch, paged):
  """New tokens past ``MAX_PIECE`` (a long tool result) run as several extend calls over the row,
  each holding a piece's attention scores, and sample what a full prefill samples."""
  monkeypatch.setattr(continuation, "MAX_PIECE", 16)
  assert continuation.pieces(40) == [(0, 16, 16), (16, 16, 16), (32, 8, 16)]
  assert continuation.pieces(5) == [(0, 5, 16)] and continuation.pieces(0) == []
  kw = dict(kv_pages=24, page_size=16, decode_attention="dense") if paged else {}
  # (the engine of the continued-turn and system-prompt tests: their programs, compiled once)
  engine = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(96,), **kw)
  engine.start()
  try:
    prompt = [int(t) for t in np.random.default_rng(2).integers(1, 128, 40)]
    greedy = SamplingParams(greedy=True, max_new_tokens=9)
    first = _one(engine, GroupRequest(1, prompt, 1, greedy, {"continue": True}))
    follow = prompt + first.tokens + list(range(3, 33))  # 30 inserted: pieces of 16 and 14
    continued = _one(engine, GroupRequest(2, follow, 1, greedy))
    assert engine.stats["continued"] == 1
    full = _one(engine, GroupRequest(3, follow, 1, greedy))
    assert continued.tokens == full.tokens
    np.testing.assert_allclose(continued.logprobs, full.logprobs, rtol=1e-4, atol=1e-5)
  finally:
    engine.stop()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.slow
def test_warmup_compiles_every_program_a_conversation_runs(model, paged):
  """After the warm-up, conversations of short then longer turns compile nothing. They run one
  sequence at a time (prefill rows, insert and decode width 1, which 2 slots warm up as 4 do),
  so 2 slots run the same programs at the same lengths: prompts in both prefill buckets (32 and
  95), turns continued up to 90 of the 96 positions, over the kv buckets and chunks those
  lengths reach."""
  kw = dict(kv_pages=24, page_size=16, decode_attention="dense") if paged else {}
  engine = JaxRolloutEngine(model, num_slots=2, max_len=96, prefill_buckets=(32,), **kw)
  ticks = []
  engine.warmup(lambda done, total, what: ticks.append((done, total, what)), continuations=True)
  assert [d for d, _, _ in ticks] == list(range(1, engine.warmup_count(True) + 1))
  assert {t for _, t, _ in ticks} == {engine.warmup_count(True)}
  assert engine.warmup_count(True) > engine.warmup_count()
  engine.start()
  try:
    with compiles() as compiled:
      rng = np.random.default_rng(3)
      for gid, (length, answer, inserted) in enumerate([(20, 9, 5), (30, 8, 30), (60, 4, 3)]):
        prompt = [int(t) for t in rng.integers(1, 128, length)]  # short turns, then longer ones
        for turn in range(3):
          params = SamplingParams(greedy=True, max_new_tokens=answer)
          out = _one(engine, GroupRequest(10 * gid + turn, prompt, 1, params, {"continue": True}))
          prompt = prompt + out.tokens + [int(t) for t in rng.integers(1, 128, inserted)]
          if len(prompt) + answer > 90:
            break
      assert engine.stats["continued"] >= 4, engine.stats
      assert compiled == [], f"{len(compiled)} programs compiled after the warm-up"
  finally:
    engine.stop()


@pytest.mark.parametrize("paged", [False, True])
def test_a_shared_system_prompt_reads_a_kept_turn_and_leaves_it_to_its_conversation(model, paged):
  """Conversations that start alike (a system prompt): another conversation's first turn runs on
  a copy of a kept turn it shares only the prompt with, and the kept turn's own next turn still
  continues it; each samples what a full prefill samples."""
  kw = dict(kv_pages=24, page_size=16, decode_attention="dense") if paged else {}
  engine = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(96,), **kw)
  engine.start()
  try:
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(1, 128, 40)]
    question_a, question_b = [3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    a = _one(engine, GroupRequest(1, system + question_a, 1, greedy, {"continue": True}))
    b = _one(engine, GroupRequest(2, system + question_b, 1, greedy, {"continue": True}))
    assert engine.stats["continued"] == 1  # b ran on a copy of a's kept turn (40 shared of 45)
    assert engine._continued.stats["shared_prompt"] == 1 and len(engine._continued) == 2
    next_a = system + question_a + a.tokens + [11, 12, 13]
    a2 = _one(engine, GroupRequest(3, next_a, 1, greedy))
    assert engine.stats["continued"] == 2  # a's own next turn: a's row, used up now
    assert len(engine._continued) == 1
  finally:
    engine.stop()
  reference = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(96,), **kw)
  reference.start()  # (nothing kept: every prompt prefilled whole)
  try:
    for got, tokens in ((b, system + question_b), (a2, next_a)):
      full = _one(reference, GroupRequest(9, tokens, 1, greedy))
      assert got.tokens == full.tokens
      np.testing.assert_allclose(got.logprobs, full.logprobs, rtol=1e-4, atol=1e-5)
    assert reference.stats["continued"] == 0
  finally:
    reference.stop()


def test_a_row_cache_planned_without_kept_rows_compiles_no_continuation_program(model):
  """A memory plan with no room for kept rows (``kept_rows`` 0): the warm-up compiles no
  continuation program, and a conversation's next turn is prefilled whole, as it would be. (The
  row engine of the warm-up test: its other programs, compiled there, are not compiled again; its
  26-position conversation stays in the 32 bucket, as at any max_len.)"""
  engine = JaxRolloutEngine(model, num_slots=2, max_len=96, prefill_buckets=(32,))
  assert engine.warmup_count(True) > engine.warmup_count()
  engine.memory_plan = types.SimpleNamespace(kept_rows=0)
  assert engine.warmup_count(True) == engine.warmup_count()
  ticks = []
  engine.warmup(lambda done, total, what: ticks.append((done, total)), continuations=True)
  assert ticks[-1] == (engine.warmup_count(), engine.warmup_count())
  engine.start()
  try:
    prompt = list(range(1, 21))
    out = _one(engine, GroupRequest(0, prompt, 1, SamplingParams(greedy=True, max_new_tokens=4),
                                    {"continue": True}))
    _one(engine, GroupRequest(1, prompt + out.tokens + [5, 6], 1,
                              SamplingParams(greedy=True, max_new_tokens=4), {"continue": True}))
    assert engine.stats["continued"] == 0, engine.stats
  finally:
    engine.stop()
