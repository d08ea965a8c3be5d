"""Chunked prefill: a long prompt (or a long sequence re-prefilled after a weight swap) is prefilled
a chunk before each decode call of the running slots, and samples what one prefill samples."""

import numpy as np
import pytest

from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler import chunked_prefill
from areal_jax.sampler.service import JaxRolloutEngine

from .conftest import compiles, full_forward_logprobs
from .test_service import _collect, _swap_run


def test_chunks_start_every_chunk_and_end_inside_the_row():
  assert chunked_prefill.starts(40, 16, 64) == [0, 16, 32]
  assert chunked_prefill.starts(90, 40, 95) == [0, 40, 55]  # the last moved back: 55 + 40 = 95
  assert chunked_prefill.chunk_size(-1, "cpu") == chunked_prefill.DEFAULT["cpu"]
  assert chunked_prefill.chunk_size(0, "gpu") == 0
  assert chunked_prefill.chunk_size(100, "tpu") == 100
  with pytest.raises(ValueError, match="prefill_chunk=-2"):
    chunked_prefill.chunk_size(-2, "cpu")


def _calls(engine, log):
  """Logs the engine's decode calls ("decode") and chunks ("chunk") in the order dispatched."""
  generate, step = engine.engine.generate, engine._chunks.step
  engine.engine.generate = lambda *a, **k: (log.append("decode"), generate(*a, **k))[1]
  engine._chunks.step = lambda *a, **k: (lambda ran: (ran and log.append("chunk"), ran)[1])(
      step(*a, **k))


@pytest.mark.parametrize("paged", [False, True])
def test_a_long_prompt_in_chunks_between_decode_calls_samples_what_one_prefill_samples(model,
                                                                                         paged):
  """Prompts of 70 and 91 tokens in chunks of 40 (the last moved back to end in the 95-position
  row; over a paged cache, chunk boundaries inside pages of 16) while a short sequence decodes:
  at most one chunk between two decode calls, and the tokens and logprobs of a prefill in one
  call, for a greedy group of two, a sampled request, and the same prompt again (a prefix memo
  hit)."""
  kw = dict(kv_pages=40, page_size=16, decode_attention="dense") if paged else {}
  rng = np.random.default_rng(4)
  long_a, long_b = ([int(t) for t in rng.integers(1, 128, n)] for n in (91, 70))
  sampled = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
  requests = [GroupRequest(0, [1, 2, 3], 1, SamplingParams(greedy=True, max_new_tokens=30)),
              GroupRequest(1, long_a, 2, SamplingParams(greedy=True, max_new_tokens=6)),
              GroupRequest(2, long_b, 1, sampled), GroupRequest(3, long_b, 1, sampled)]
  runs = {}
  for chunk in (0, 40):
    engine = JaxRolloutEngine(model, num_slots=4, max_len=128, prefill_buckets=(32, 95),
                              prefill_chunk=chunk, **kw)
    log = []
    _calls(engine, log)
    engine.start()
    try:
      for request in requests:
        engine.submit(request)
      samples = _collect(engine, 5)
    finally:
      engine.stop()
    runs[chunk] = {(s.group_id, s.index): s for s in samples}, engine.stats, log
  whole, _, whole_log = runs[0]
  chunked, stats, log = runs[40]
  assert "chunk" not in whole_log
  assert stats["prefill_chunks"] == 3 + 2 and stats["prefix_hits"] >= 1, stats
  # the short sequence decodes throughout: never two chunks without a decode call between them
  assert "chunk chunk" not in " ".join(log), log
  assert sorted(whole) == sorted(chunked)
  for key, s in whole.items():
    assert s.finish_reason == "length" and chunked[key].tokens == s.tokens, key
    np.testing.assert_allclose(chunked[key].logprobs, s.logprobs, rtol=1e-5, atol=1e-5)
  greedy = chunked[1, 0]
  np.testing.assert_allclose(greedy.logprobs, full_forward_logprobs(model, long_a, greedy.tokens),
                             atol=1e-4)


@pytest.mark.parametrize("variant", ["rows", "paged"])
def test_a_long_sequence_reprefilled_after_a_swap_in_chunks_carries_the_new_weights(
    model, other_model, variant):
  """After a swap with ``continuation="reprefill"``, each sequence of a 40-token prompt group
  sits out (a row cache: in its slot; a paged cache: preempted) while its prompt and tokens so
  far are prefilled in chunks of 16 under the new weights, then goes on: every token after the
  swap carries the new weights' exact logprob."""
  kw = dict(decode_layers="scan", decode_attention="dense", decode_matmul="xla",
            decode_projections="fused", kv_pages=24, page_size=8) if variant == "paged" else {}
  prompt = [(7 * i) % 120 + 1 for i in range(40)]
  samples, eng = _swap_run(model, other_model, "reprefill", 1, prompt=prompt, n=2,
                           max_new_tokens=16, prefill_chunk=16, **kw)
  assert eng.stats["prefill_chunks"] >= 2 * 3, eng.stats
  if variant == "paged":
    assert eng.stats["preempted"] == eng.stats["resumed"] == 2
  else:
    assert eng.stats["reprefills"] == 2 and eng.stats["preempted"] == 0
  for s in samples:
    assert s.finish_reason == "length" and len(s.tokens) == 16
    j = s.versions.index(1)
    assert 0 < j and s.versions == [0] * j + [1] * (16 - j)
    np.testing.assert_allclose(s.logprobs[j:],
                               full_forward_logprobs(other_model, prompt, s.tokens, 0.8)[j:],
                               atol=1e-4)


@pytest.mark.slow
def test_warmup_compiles_the_chunks_and_an_aborted_long_group_is_never_prefilled(model):
  """The warm-up compiles a chunk's programs for each prefill bucket longer than a chunk (a long
  prompt then compiles nothing); a long group aborted while it waits runs no chunk."""
  engine = JaxRolloutEngine(model, num_slots=2, max_len=64, prefill_buckets=(16, 63),
                            prefill_chunk=16)
  ticks = []
  engine.warmup(lambda done, total, what: ticks.append((done, total, what)))
  assert [d for d, _, _ in ticks] == list(range(1, engine.warmup_count() + 1))
  assert sum("chunked prefill" in what for _, _, what in ticks) == 2  # bucket 63: row, chunk
  engine.pause()
  engine.start()
  try:
    with compiles() as compiled:
      engine.submit(GroupRequest(0, list(range(1, 50)), 1, SamplingParams(max_new_tokens=4)))
      engine.submit(GroupRequest(1, list(range(2, 51)), 1, SamplingParams(max_new_tokens=4)))
      engine.abort(0)
      engine.resume()
      samples = {s.group_id: s for s in _collect(engine, 2)}
  finally:
    engine.stop()
  assert samples[0].finish_reason == "abort" and samples[1].finish_reason == "length"
  assert engine.stats["prefill_chunks"] == 3 and engine._chunks.positions() == 0
  assert compiled == [], f"{len(compiled)} programs compiled after the warm-up"


def test_a_chunk_holds_no_more_than_the_planned_prefill(model):
  """A chunk of the platform's default size over the longest row (the CPU's dense prefill of a
  1023-position bucket is what the sampler's memory plan counts) holds less: its temporaries and
  the row it returns."""
  import jax

  from areal_jax.sampler import memory, row_programs
  from areal_jax.sampler.engine import DecodeEngine, EngineConfig

  engine = DecodeEngine(model, EngineConfig(num_slots=2, max_len=1024, prefill_buckets=(256,),
                                            max_prefill_batch=1))
  planned = memory.plan(engine, None).prefill
  chunk, length = chunked_prefill.chunk_size(-1, engine.platform), engine.prefill_buckets[-1]
  row = jax.eval_shape(row_programs.empty(engine, length))
  held = row_programs.extend(engine, length).lower(
      engine.params, row, jax.ShapeDtypeStruct((1, chunk), "int32"),
      jax.ShapeDtypeStruct((1,), "int32")).compile().memory_analysis()
  assert 0 < held.temp_size_in_bytes + held.output_size_in_bytes < planned
