"""Host loop: streaming, group sampling, in-flight weight swaps, pause/resume/abort, bad input."""

import dataclasses
import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import init_cache
from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler.service import JaxRolloutEngine

from .conftest import full_forward_logprobs


def _collect(engine, count, timeout=120.0):
  out, deadline = [], time.time() + timeout
  while len(out) < count and time.time() < deadline:
    out += engine.poll(timeout=0.5)
  assert len(out) == count, f"got {len(out)} of {count} samples"
  return out


def _engine(model, **kw):
  kw = {"num_slots": 8, "max_len": 64, "prefill_buckets": (16, 63), "kv_buckets": (32, 64), **kw}
  return JaxRolloutEngine(model, **kw)


def test_groups_stream_distinct_samples_before_the_longest_ends(model):
  eng = _engine(model, num_slots=6, steps_per_call=2)
  eng.start()
  try:
    params = lambda m, seed: SamplingParams(temperature=1.0, max_new_tokens=m, seed=seed)
    eng.submit(GroupRequest(0, [1, 2, 3], n=4, params=params(40, 0), metadata={"q": "a"}))
    eng.submit(GroupRequest(1, [4, 5], n=2, params=params(3, 1)))
    eng.submit(GroupRequest(2, [6, 7, 8, 9], n=2, params=params(3, 2)))  # waits for free slots
    samples = _collect(eng, 8)
  finally:
    eng.stop()
  order = [s.group_id for s in samples]
  assert order.index(1) < order.index(0) and order.index(2) < order.index(0)
  long = [s for s in samples if s.group_id == 0]
  assert max(s.finished_s for s in samples if s.group_id != 0) < max(s.finished_s for s in long)
  assert len({tuple(s.tokens) for s in long}) == 4 and sorted(s.index for s in long) == [0, 1, 2, 3]
  for s in samples:
    assert s.finish_reason == "length" and len(s.tokens) == len(s.logprobs) == len(s.versions)
    assert s.submitted_s <= s.started_s <= s.finished_s
  assert long[0].metadata == {"q": "a"}
  g2 = [s for s in samples if s.group_id == 2]
  assert min(s.started_s for s in g2) >= min(s.finished_s for s in samples if s.group_id == 1)
  # prefill and insert buckets used + generate per kv bucket x width (1, 3, 6) + moves + deactivate
  assert eng.engine.num_compiled() <= 2 + 2 + 2 * 3 + 3 + 1


def test_draining_batch_moves_down_and_keeps_exact_logprobs(model):
  """With nothing waiting and few sequences left, live ones move to low slots and steps run at a
  smaller width; the samples are unchanged (logprobs equal a full forward of the final weights)."""
  eng = _engine(model, num_slots=8)
  eng.start()
  try:
    for g, budget in enumerate((2, 3, 4, 5, 6, 7, 40, 45)):  # six short, two long, one per slot
      eng.submit(GroupRequest(g, [g + 1, 2, 3], n=1, params=SamplingParams(
          temperature=0.9, max_new_tokens=budget, seed=g)))
    samples = _collect(eng, 8)
  finally:
    eng.stop()
  assert eng.stats["moves"] >= 1
  assert eng.stats["slot_steps"] < 8 * eng.stats["calls"]  # some steps ran narrower
  for s in samples:
    np.testing.assert_allclose(s.logprobs,
                               full_forward_logprobs(model, s.prompt_tokens, s.tokens, 0.9),
                               atol=1e-4)
  assert sorted(len(s.tokens) for s in samples) == [2, 3, 4, 5, 6, 7, 40, 45]


def test_stop_tokens_eos_and_cache_full(model):
  """Stop ids, the cache's end and EOS (checked on the host and, 4 steps a call, on the device).
  The EOS engine has 4 slots (the swap tests' programs): its groups are of one sample."""
  eng = _engine(model, eos_token_ids=(), max_len=32, kv_buckets=(32,), prefill_buckets=(31,))
  eng.start()
  try:
    greedy = SamplingParams(greedy=True, max_new_tokens=100)
    eng.submit(GroupRequest(0, [5, 6, 7], n=1, params=greedy))
    (full,) = _collect(eng, 1)
    assert full.finish_reason == "cache_full" and len(full.tokens) == 32 - 3
    stop = full.tokens[4]
    eng.submit(GroupRequest(1, [5, 6, 7], n=1, params=SamplingParams(
        greedy=True, max_new_tokens=100, stop_token_ids=(stop,))))
    (stopped,) = _collect(eng, 1)
  finally:
    eng.stop()
  assert stopped.finish_reason == "stop"
  assert stopped.tokens == full.tokens[:full.tokens.index(stop) + 1]
  # EOS also checked on device
  eng = _engine(model, num_slots=4, eos_token_ids=(stop,), steps_per_call=4)
  eng.start()
  try:
    eng.submit(GroupRequest(2, [5, 6, 7], n=1, params=greedy))
    (eos,) = _collect(eng, 1)
    # ignore_eos: the EOS id no longer ends it, max_new_tokens does (explicit stop ids still do)
    eng.submit(GroupRequest(3, [5, 6, 7], n=1, params=SamplingParams(
        greedy=True, max_new_tokens=20, ignore_eos=True)))
    (ignored,) = _collect(eng, 1)
    eng.submit(GroupRequest(4, [5, 6, 7], n=1, params=SamplingParams(
        greedy=True, max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop,))))
    (explicit,) = _collect(eng, 1)
  finally:
    eng.stop()
  assert eos.finish_reason == "eos" and eos.tokens == stopped.tokens
  assert ignored.finish_reason == "length" and ignored.tokens == full.tokens[:20]
  assert explicit.finish_reason == "eos" and explicit.tokens == stopped.tokens


def _swap_run(model, new_model, continuation, steps_per_call, prompt=(3, 1, 4, 1, 5), n=2,
              max_new_tokens=40, tokens_before=6, **kw):
  """Samples of one group whose weights swap to ``new_model``'s (version 1) once the engine has
  drawn ``tokens_before`` tokens; the engine (stopped) too."""
  eng = _engine(model, num_slots=4, continuation=continuation, eos_token_ids=(),
                steps_per_call=steps_per_call, **kw)
  new_params = nnx.to_pure_dict(nnx.state(new_model, nnx.Param))
  eng.start()
  try:
    eng.pause()
    eng.submit(GroupRequest(0, list(prompt), n=n, params=SamplingParams(
        temperature=0.8, max_new_tokens=max_new_tokens, seed=5)))
    eng.resume()
    deadline = time.time() + 60
    while eng.stats["tokens"] < tokens_before and time.time() < deadline:
      time.sleep(0.001)
    eng.pause()
    eng.update_params(new_params, version=1)
    # the loop applies it once the call it may be in (a compile, on a loaded machine) returns
    deadline = time.time() + 60
    while eng.version != 1 and time.time() < deadline:
      time.sleep(0.01)
    assert eng.version == 1
    eng.resume()
    samples = _collect(eng, n)
  finally:
    eng.stop()
  return samples, eng


_SCAN = {"decode_layers": "scan", "decode_attention": "dense", "decode_matmul": "xla",
         "decode_projections": "fused"}
_SWAP_VARIANTS = {  # engine settings of the exact-continuation test below
    "unrolled": {},  # the platform's choices (on CPU: layers unrolled)
    "scan": _SCAN,  # the accelerator path: layers in a scan
    # the swap lands while slots hold pages (2 samples of 45 positions: 12 of the 16, no
    # preemption; the pool of the paged preemption test below, which shares its programs)
    "paged": {**_SCAN, "kv_pages": 16, "page_size": 8},
    "pause": {"weight_swap": "pause"},  # the loop pauses to convert the new version
}


@nnx.jit
def _keep_cache_logprobs(model, new_model, head_1xH, tail_1xT, tokens_T, temperature):
  """The logprobs of ``tokens_T`` drawn by ``new_model`` on top of the KV ``model`` computed for
  ``head_1xH`` (fed ``tail_1xT`` after it). Jitted whole: one program per swap point, not each
  of its ops compiled on its own at each length."""
  cache = init_cache(model.cfg, 1, 64)
  _, cache = model.extend(head_1xH, jnp.zeros((1,), jnp.int32), cache)
  logits, _ = new_model.extend(tail_1xT, jnp.full((1,), head_1xH.shape[1], jnp.int32), cache)
  logp = jax.nn.log_softmax(logits[0] / temperature, axis=-1)
  return logp[jnp.arange(tail_1xT.shape[1]), tokens_T]


@pytest.mark.parametrize("continuation,steps_per_call,variant",
                         [("reprefill", 1, "unrolled"), ("keep_cache", 1, "unrolled"),
                          ("reprefill", 4, "unrolled"), ("keep_cache", 4, "unrolled"),
                          ("reprefill", 4, "scan"), ("keep_cache", 3, "scan"),
                          ("reprefill", 4, "paged"), ("keep_cache", 3, "paged"),
                          ("reprefill", 4, "pause"), ("keep_cache", 3, "pause")])
@pytest.mark.slow
def test_in_flight_weight_swap(model, other_model, continuation, steps_per_call, variant):
  """Exact continuation across a swap, also with several decode steps per call (the swap lands
  between two calls: every token of a call comes from one version), with the layers in a scan
  (the new version's weights fused and stacked in put_params, the stacked cache kept or
  re-prefilled), over a paged cache, and with a swap that pauses the loop to convert the new
  version (the same tokens and logprobs: only when the conversion runs changes)."""
  new_model = other_model
  prompt, temperature = [3, 1, 4, 1, 5], 0.8
  kw = _SWAP_VARIANTS[variant]
  for s in _swap_run(model, new_model, continuation, steps_per_call, **kw)[0]:
    assert len(s.tokens) == 40
    j = s.versions.index(1)  # first token drawn by the new weights
    assert 0 < j < 40 and s.versions == [0] * j + [1] * (40 - j)
    assert j % steps_per_call == 0
    np.testing.assert_allclose(s.logprobs[:j],
                               full_forward_logprobs(model, prompt, s.tokens, temperature)[:j],
                               atol=1e-4)
    if continuation == "reprefill":
      ref = full_forward_logprobs(new_model, prompt, s.tokens, temperature)[j:]
    else:  # old weights' KV for everything fed before the swap, new weights from then on
      seq = np.asarray([prompt + s.tokens], np.int32)
      p = len(prompt)
      ref = np.asarray(_keep_cache_logprobs(model, new_model, seq[:, :p + j - 1],
                                            seq[:, p + j - 1:-1],
                                            np.asarray(s.tokens[j:], np.int32), temperature))
      fresh = full_forward_logprobs(new_model, prompt, s.tokens, temperature)[j:]
      assert np.abs(fresh - ref).max() > 1e-3  # the stale cache does matter
    np.testing.assert_allclose(s.logprobs[j:], ref, atol=1e-4)


@pytest.mark.parametrize("weight_swap", ["overlap", "pause"])
def test_a_paused_swap_lets_go_of_the_current_version_before_converting(model, other_model,
                                                                        weight_swap):
  """With ``weight_swap="pause"`` no array of the current version is alive when the new one is
  converted (one held version less at a swap's peak, as the memory plan counts it); overlapping,
  the current one stays while the loop goes on decoding with it."""
  eng = _engine(model, num_slots=4, eos_token_ids=(), weight_swap=weight_swap)
  old = [weakref.ref(x) for x in jax.tree.leaves(eng.engine.params)]
  alive, put = [], eng.engine.put_params

  def counting_put(params):
    gc.collect()
    alive.append(sum(r() is not None for r in old))
    return put(params)

  eng.engine.put_params = counting_put
  eng.start()
  try:
    eng.submit(GroupRequest(0, [3, 1, 4], n=2, params=SamplingParams(max_new_tokens=30, seed=1)))
    deadline = time.time() + 60
    while eng.stats["tokens"] < 4 and time.time() < deadline:
      time.sleep(0.001)
    # paused until the new version is in (as _swap_run): the sequences cannot all end with the
    # old one while a loaded machine converts the new
    eng.pause()
    eng.update_params(nnx.to_pure_dict(nnx.state(other_model, nnx.Param)), version=1)
    deadline = time.time() + 60
    while eng.version != 1 and time.time() < deadline:
      time.sleep(0.01)
    eng.resume()
    samples = _collect(eng, 2)
  finally:
    eng.stop()
  assert alive == ([len(old)] if weight_swap == "overlap" else [0])
  assert all(len(s.tokens) == 30 and 1 in s.versions for s in samples)
  with pytest.raises(ValueError, match="weight_swap"):
    _engine(model, weight_swap="later")


def test_pause_resume_abort_and_bad_requests(model):
  eng = _engine(model, num_slots=4, eos_token_ids=())
  eng.start()
  try:
    ok = SamplingParams(max_new_tokens=50)
    bad = [
        GroupRequest(10, [], n=1, params=ok),
        GroupRequest(11, list(range(1, 65)), n=1, params=ok),
        GroupRequest(12, [1, 2], n=5, params=ok),
        GroupRequest(13, [1, 2], n=1, params=SamplingParams(temperature=0.0)),
        GroupRequest(14, [1, 2], n=1, params=SamplingParams(top_p=1.5)),
        GroupRequest(15, [1, 999], n=2, params=ok),
    ]
    eng.pause()
    eng.submit(GroupRequest(0, [1, 2, 3], n=2, params=ok))
    for r in bad:
      eng.submit(r)
    errors = _collect(eng, 1 + 1 + 5 + 1 + 1 + 2)
    assert {s.group_id for s in errors} == {10, 11, 12, 13, 14, 15}
    assert all(s.finish_reason == "error" and s.error for s in errors)
    assert "empty" in errors[0].error
    eng.submit(GroupRequest(1, [4, 5, 6], n=2, params=SamplingParams(max_new_tokens=5)))
    time.sleep(0.3)
    assert eng.poll() == []  # paused: nothing decodes
    eng.resume()
    done = _collect(eng, 2)
    assert {s.group_id for s in done} == {1} and all(len(s.tokens) == 5 for s in done)
    eng.abort(0)
    aborted = _collect(eng, 2)
    assert all(s.group_id == 0 and s.finish_reason == "abort" for s in aborted)
    assert all(0 < len(s.tokens) < 50 and len(s.logprobs) == len(s.tokens) for s in aborted)
    eng.submit(GroupRequest(2, [7, 8], n=4, params=SamplingParams(max_new_tokens=3)))
    assert len(_collect(eng, 4)) == 4  # still serving after errors and aborts
  finally:
    eng.stop()


def test_a_later_group_that_fits_overtakes_a_blocked_head(model):
  """4 slots at 4 steps a call (the swap tests' programs): group 0 holds 3 slots for 30 tokens,
  group 1 needs 3 and waits for it, group 2 (one sample of 3 tokens) takes the free
  slot at once and ends first."""
  eng = _engine(model, num_slots=4, eos_token_ids=(), steps_per_call=4)
  eng.start()
  try:
    params = lambda m, seed: SamplingParams(temperature=1.0, max_new_tokens=m, seed=seed)
    eng.pause()
    eng.submit(GroupRequest(0, [1, 2, 3], n=3, params=params(30, 0)))
    eng.submit(GroupRequest(1, [4, 5], n=3, params=params(3, 1)))  # does not fit next to group 0
    eng.submit(GroupRequest(2, [6, 7], n=1, params=params(3, 2)))  # fits the free slot
    eng.resume()
    samples = _collect(eng, 7)
  finally:
    eng.stop()
  by = lambda g: [s for s in samples if s.group_id == g]
  assert max(s.finished_s for s in by(2)) < min(s.started_s for s in by(1))
  assert min(s.started_s for s in by(1)) >= min(s.finished_s for s in by(0))
  assert all(s.finish_reason == "length" for s in samples)


def test_token_listener_hears_every_token_in_order_and_cannot_stop_decoding(model):
  """Two groups of 2 in 4 slots (the pausing swap test's programs), 3 steps a call: each sample's
  tokens (up to 10) stream in pieces of up to 3, one a call."""
  heard = {}

  def listener(group_id, index, tokens):
    heard.setdefault((group_id, index), []).extend(tokens)
    if group_id == 1:
      raise RuntimeError("a consumer's bug")

  eng = _engine(model, num_slots=4, steps_per_call=3)
  eng.set_token_listener(listener)
  eng.start()
  try:
    for g in (0, 1):
      eng.submit(GroupRequest(g, [5, 6, 7], n=2, params=SamplingParams(max_new_tokens=10, seed=g)))
    out = _collect(eng, 4)
  finally:
    eng.stop()
  assert all(s.finish_reason in ("length", "eos") for s in out)
  for s in out:  # streamed pieces add up to the final sample, also for the raising listener's group
    assert heard[(s.group_id, s.index)] == s.tokens


@pytest.mark.slow
def test_a_paged_cache_preempts_and_resumes_to_the_same_samples(model):
  """A pool of 16 pages of 8 positions (half of 4 slots x 64; the scan swap tests' configs and
  programs): sequences admitted last are preempted when it runs out (groups 0 and 1 alone grow
  to 5 + 5 + 1 shared + 5 + 5 pages) and resumed by re-prefill; every sample (tokens, logprobs,
  versions, finish reasons) equals the run with a cache row per slot, and no page is left
  taken."""
  def run(**kw):
    eng = _engine(model, num_slots=4, steps_per_call=4, eos_token_ids=(), **_SCAN, **kw)
    eng.start()
    try:
      for g in range(4):
        prompt = [(g * 7 + i) % 120 + 1 for i in range(5 + 3 * g)]
        eng.submit(GroupRequest(g, prompt, n=2, params=SamplingParams(
            temperature=1.0, max_new_tokens=30 + 5 * g, seed=g)))
      out = {(s.group_id, s.index): s for s in _collect(eng, 8)}
      if eng._paging is not None:
        deadline = time.time() + 10
        while eng._paging.table.free_pages < 16 and time.time() < deadline:
          time.sleep(0.01)
        assert eng._paging.table.free_pages == 16 and not eng._paging.preempted
    finally:
      eng.stop()
    return out, eng.stats

  rows, _ = run()
  paged, stats = run(kv_pages=16, page_size=8)
  assert stats["preempted"] >= 1 and stats["resumed"] == stats["preempted"]
  for key, ref in rows.items():
    got = paged[key]
    assert got.tokens == ref.tokens and got.versions == ref.versions
    assert got.finish_reason == ref.finish_reason == "length"
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)


@pytest.mark.slow
def test_the_platforms_paged_cache_admits_as_rows_do_and_never_preempts(model, monkeypatch):
  """kv_pages -1 where the platform pages (the GPU's choice, forced on CPU, through the Pallas GPU
  kernel in interpret mode): a pool of every slot's row of pages and one more. Groups fill every
  slot, sequences run to the end of the cache: nothing is preempted, the decode calls are the
  ones a cache of rows (dense read) makes (admission never waited for pages), and every sample
  is the same."""
  def run(**kw):
    eng = _engine(model, num_slots=4, steps_per_call=4, eos_token_ids=(), **kw)
    eng.start()
    try:
      for g in range(5):  # 10 samples over 4 slots: groups wait for slots, not for pages
        prompt = [(g * 11 + i) % 120 + 1 for i in range(3 + 9 * g)]
        eng.submit(GroupRequest(g, prompt, n=2, params=SamplingParams(
            temperature=1.0, max_new_tokens=64 - len(prompt) if g % 2 else 12 + g, seed=g)))
      return {(s.group_id, s.index): s for s in _collect(eng, 10)}, eng
    finally:
      eng.stop()

  rows, rows_eng = run(kv_pages=0, decode_attention="dense")
  monkeypatch.setenv("AREAL_JAX_PAGED_CACHE", "1")
  monkeypatch.setenv("AREAL_JAX_DECODE_ATTENTION", "pallas_gpu")
  paged, eng = run(page_size=16)  # kv_pages: the default, -1
  assert eng.engine.paged and eng.engine.attention_impl == "pallas_gpu"
  assert eng.engine.config.kv_pages == 4 * (64 // 16 + 1) and not rows_eng.engine.paged
  assert eng.stats["preempted"] == 0 and eng.stats["calls"] == rows_eng.stats["calls"] > 0
  assert max(len(s.tokens) + 3 + 9 * g for (g, _), s in paged.items()) == 64  # a row's end
  for key, ref in rows.items():
    got = paged[key]
    assert got.tokens == ref.tokens and got.versions == ref.versions
    assert got.finish_reason == ref.finish_reason == "length"
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)


def test_aborting_a_group_with_preempted_samples_gives_every_page_back(model):
  """Four samples growing in a pool that holds one sequence: some are preempted; aborting the group
  ends all four (each once), every page comes back, and the pool then serves a new group."""
  eng = _engine(model, steps_per_call=2, decode_layers="scan", decode_matmul="xla",
                decode_attention="dense", eos_token_ids=(), kv_pages=8, page_size=8)
  long = SamplingParams(temperature=1.0, max_new_tokens=50, seed=1)
  eng.start()
  try:
    eng.submit(GroupRequest(0, list(range(1, 13)), n=4, params=long))  # 4 growing samples
    deadline = time.time() + 60
    while eng.stats["preempted"] < 1 and time.time() < deadline:
      time.sleep(0.005)
    assert eng.stats["preempted"] >= 1
    eng.abort(0)
    out = _collect(eng, 4)
    assert {s.finish_reason for s in out} <= {"abort", "length"} and len(
        {(s.group_id, s.index) for s in out}) == 4
    deadline = time.time() + 10
    while eng._paging.table.free_pages < 8 and time.time() < deadline:
      time.sleep(0.01)
    assert eng._paging.table.free_pages == 8 and not eng._paging.preempted
    eng.submit(GroupRequest(1, [5, 6, 7], n=2, params=SamplingParams(max_new_tokens=5)))
    assert len(_collect(eng, 2)) == 2
    # a group whose prompt pages alone exceed the pool is refused, not left waiting for ever
    eng.submit(GroupRequest(2, list(range(1, 61)), n=8, params=SamplingParams(max_new_tokens=2)))
    refused = _collect(eng, 8)
    assert all(s.finish_reason == "error" for s in refused)
    assert "needs 15 pages; the pool has kv_pages=8" in refused[0].error
  finally:
    eng.stop()


def test_a_reprefill_swap_that_unshares_prompt_pages_preempts_and_resumes(model, other_model):
  """A group of four shares a 40-token prompt's pages; the swap re-prefills each sample alone (one
  copy of the prompt each), more than the pool holds: the samples that do not fit wait and resume
  later, and every token after the swap still carries the new weights' exact logprob."""
  prompt = [(5 * i) % 120 + 1 for i in range(40)]
  samples, eng = _swap_run(model, other_model, "reprefill", 2, prompt=prompt, n=4,
                           max_new_tokens=20, tokens_before=8, decode_layers="scan",
                           decode_matmul="xla", decode_attention="dense", kv_pages=14,
                           page_size=8, prefill_buckets=(48, 63))
  assert eng.stats["preempted"] >= 1 and eng.stats["resumed"] == eng.stats["preempted"]
  for s in samples:
    assert s.finish_reason == "length" and len(s.tokens) == 20
    j = s.versions.index(1)
    assert 0 < j and s.versions == [0] * j + [1] * (20 - j)
    np.testing.assert_allclose(s.logprobs[:j],
                               full_forward_logprobs(model, prompt, s.tokens, 0.8)[:j], atol=1e-4)
    np.testing.assert_allclose(s.logprobs[j:],
                               full_forward_logprobs(other_model, prompt, s.tokens, 0.8)[j:],
                               atol=1e-4)


def test_a_finished_top_p_group_leaves_the_program_that_sorts(model, monkeypatch):
  """Where the engine picks the program that sorts for top-k / top-p on the host (a GPU's
  default; forced here): while a top-p group decodes its calls run that program; once it is over,
  a plain group's calls run the one without the sort, next to a slot the top-p group held."""
  from areal_jax.kernels import choice
  from areal_jax.sampler import engine as engine_lib

  monkeypatch.setattr(engine_lib, "_COMPILED", {})  # (this engine's programs its own)
  monkeypatch.setenv(choice.TRUNCATION_ENV, "1")
  eng = _engine(model, num_slots=4, steps_per_call=2, kv_buckets=(64,))
  programs = eng.engine._generate_fns  # noqa: SLF001 ((kv bucket, width, sorts) -> program)
  wide = lambda: sorted(k[2] for k in programs if k[1] == 4)  # noqa: E731 (4 slots: the groups)
  eng.start()
  try:
    eng.submit(GroupRequest(0, [1, 2, 3], n=4, params=SamplingParams(
        temperature=1.0, top_p=0.5, max_new_tokens=5, seed=0)))
    _collect(eng, 4)
    assert wide() == [True]
    # 3 samples: slots 0-2, the width still 4, slot 3 left as the top-p group left it
    eng.submit(GroupRequest(1, [4, 5], n=3, params=SamplingParams(max_new_tokens=5, seed=1)))
    _collect(eng, 3)
  finally:
    eng.stop()
  assert wide() == [False, True]


def test_an_admission_round_holds_no_more_prefixes_than_the_plan_counts(model, monkeypatch):
  """Twelve prompts admitted in one round are prefilled a window at a time, each window's groups
  inserted before the next one's prefill: at no fill does the memo hold more positions than the
  largest planned prefill call returns (what the memory plan counts), and every sample is the
  one the same request gives alone."""
  from areal_jax.sampler import prefix_memo

  held, fill = [], prefix_memo.PrefixMemo.fill

  def spy(self, params, token_lists):
    fill(self, params, token_lists)
    held.append(self.positions())

  monkeypatch.setattr(prefix_memo.PrefixMemo, "fill", spy)
  # buckets 16 and 63, 32 tokens a call: 2 rows of 16 or one of 63 (63 positions planned)
  eng = _engine(model, num_slots=12, max_prefill_tokens=32, steps_per_call=2, eos_token_ids=())
  requests = [GroupRequest(g, [(g * 5 + i) % 120 + 1 for i in range(3 + g % 4)], n=1,
                           params=SamplingParams(temperature=1.0, max_new_tokens=6, seed=g))
              for g in range(12)]
  for r in requests:  # (all waiting when the loop starts: one admission round)
    eng.submit(r)
  eng.start()
  try:
    together = {s.group_id: s for s in _collect(eng, 12)}
    assert max(held) <= eng._prefixes.max_positions == 63 and len(held) >= 4, held
    for r in requests[:3]:
      eng.submit(dataclasses.replace(r, group_id=r.group_id + 100))
      alone = _collect(eng, 1)[0]
      assert alone.tokens == together[r.group_id].tokens
      np.testing.assert_allclose(alone.logprobs, together[r.group_id].logprobs, atol=1e-5)
  finally:
    eng.stop()
