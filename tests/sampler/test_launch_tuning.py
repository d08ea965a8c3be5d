"""The decode launches timed on the device (``sampler.launch_tuning``), stage by stage: the
fastest of each is kept (the launch kept so far unless another is clearly faster), one that fails
is dropped, decoding afterwards is as an untimed engine's with that launch (every launch a GPU
would time, run here in interpret mode), and the service and its replicas time once."""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

from areal_jax.kernels import choice, decode_launch, pallas_attention, pallas_norm_matmul
from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler import engine as engine_lib
from areal_jax.sampler import launch_tuning, memory, sampling
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
from areal_jax.sampler.pages import PageTable
from areal_jax.sampler.service import JaxRolloutEngine

from .test_service import _collect

# a paged cache read by the Pallas GPU kernels (interpret mode on CPU), as on a GPU
CONFIG = EngineConfig(num_slots=4, max_len=64, prefill_buckets=(16,), steps_per_call=4,
                      decode_attention="pallas_gpu", decode_matmul="xla",
                      decode_layers="unrolled", decode_projections="fused", kv_pages=20,
                      page_size=8)
OWN = choice.Launch(None, pallas_attention.PagedTuning())
WRITES = choice.Launch(None, pallas_attention.PagedTuning(writes=True))
BOTH = choice.Launch(pallas_norm_matmul.NormTuning(), pallas_attention.PagedTuning(writes=True))


def offer(*launches):
  """A stage offering ``launches`` after the launch kept so far."""
  return lambda kept: [kept, *launches]


@pytest.fixture(autouse=True)
def _no_forced_launch(monkeypatch):
  for name in (choice.PAGED_TUNING_ENV, choice.NORM_MATMUL_ENV, choice.BLOCK_PAGES_ENV):
    monkeypatch.delenv(name, raising=False)


def _costs(engine, seconds: dict):
  """A ``measure`` that runs the call and says it took ``seconds[launch name]``; the launches it
  timed, in order."""
  timed = []

  def measure(call):
    jax.block_until_ready(call())
    timed.append(engine.launch.name)
    return seconds[engine.launch.name]
  return measure, timed


def _group(eng, page_size=8, samples=3, calls=5):
  """``samples`` of one prompt over ``calls`` calls (on a paged cache, pages taken as they grow)."""
  prompt, slots = [5, 7, 9, 11, 3, 1, 2, 8, 4, 6, 10, 12], [0, 2, 3][:samples]
  keys = np.stack([np.asarray(sampling.slot_key(3, i)) for i in range(samples)])
  table = PageTable(4, 20, page_size, 64) if eng.paged else None
  assert table is None or table.share(slots, len(prompt) - 1)
  state = eng.insert(eng.init_state(), eng.prefill(eng.params, prompt[:-1]), slots,
                     token=[prompt[-1]] * samples, pos=[len(prompt) - 1] * samples,
                     end=[64] * samples, keys=keys, temperature=0.7, top_k=0, top_p=1.0,
                     greedy=False, stop_ids=[], pages=None if table is None else table.table[slots])
  outs = []
  for call in range(calls):
    assert table is None or all(table.grow(s, len(prompt) - 1 + 4 * (call + 1)) for s in slots)
    state, out = eng.generate(eng.params, state, eng.kv_bucket(len(prompt) + 4 * call),
                              pages=None if table is None else table.table)
    outs.append(jax.device_get(out))
  return outs


def _same(got, want, atol):
  """``_group``'s calls: the same steps valid, the same tokens, logprobs within ``atol``."""
  for (tok, lp, valid), (tok_ref, lp_ref, valid_ref) in zip(got, want, strict=True):
    np.testing.assert_array_equal(valid, valid_ref)
    np.testing.assert_array_equal(tok[valid], tok_ref[valid])
    np.testing.assert_allclose(lp[valid], lp_ref[valid], atol=atol)


def test_the_fastest_launch_is_kept_and_decodes_as_an_engine_built_with_it(model, monkeypatch):
  monkeypatch.setattr(engine_lib, "_COMPILED", {})  # (this engine's programs its own)
  made, real = [], DecodeEngine._make_generate

  def recorded(self, *args, **kwargs):  # the launch each generate program is traced under
    made.append(self.launch.name)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(DecodeEngine, "_make_generate", recorded)
  eng = DecodeEngine(model, CONFIG)
  assert eng.launch == OWN and eng.launch.name == "default"
  measure, timed = _costs(eng, {"default": 1.0, "writes=1": 0.8, "writes=1+norms": 0.5})
  state, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES), offer(BOTH)],
                                     rounds=2, measure=measure)
  assert eng.launch == BOTH and report["launch"] == "writes=1+norms"
  # a stage: each compiled (its first call), then the rounds in turn; the next on the one kept
  assert timed == (["default", "writes=1"] * 3 + ["writes=1+norms"]
                   + ["writes=1", "writes=1+norms"] * 2)
  assert report["step_ms"] == {"default": 250.0, "writes=1": 200.0, "writes=1+norms": 125.0}
  assert report["slots"] == 4 and report["position"] == 32 and not report["failed"]
  assert not np.asarray(state["active"]).any()  # no slot left armed
  assert made == ["default", "writes=1", "writes=1+norms"]  # a program of each launch
  got = _group(eng)
  assert len(made) == 3  # the kept launch's program, not compiled again
  # what it decodes from here on: an engine built with that launch's
  monkeypatch.setenv(choice.PAGED_TUNING_ENV, "writes=1")
  monkeypatch.setenv(choice.NORM_MATMUL_ENV, "1")
  built = DecodeEngine(model, CONFIG)
  assert built.launch == BOTH
  _same(got, _group(built), atol=2e-6)


def test_a_kept_launch_s_matmuls_are_its_decode_program_s(model, monkeypatch):
  """A launch naming other matmuls (on a GPU: XLA's own GEMMs against the vendor library's,
  ``choice.launch_stages``) traces and compiles the decode programs with them: here, the other way
  round, the library's ("blas", forced on CPU) against XLA's, which pads each K/V head's queries
  over a bfloat16 cache (``choice.query_rows``). Kept, the engine decodes as one built with them;
  its prefill keeps the engine's own."""
  from areal_jax.kernels import xla_attention
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  padded, pad = [], xla_attention.jnp.pad
  monkeypatch.setattr(xla_attention.jnp, "pad",
                      lambda x, w, *a, **k: padded.append(w) or pad(x, w, *a, **k))
  options = []
  real_options = choice.compiler_options
  monkeypatch.setattr(choice, "compiler_options",
                      lambda impl: options.append(impl) or real_options(impl))
  config = dataclasses.replace(CONFIG, decode_attention="dense", kv_pages=0,
                               cache_dtype="bfloat16")
  eng = DecodeEngine(model, config)
  assert eng.decode_matmul == "xla" and eng.launch_stages() == []  # (nothing to time on CPU)
  blas = dataclasses.replace(OWN, matmul="blas")
  assert blas.name == "matmul=blas"
  measure, _ = _costs(eng, {"default": 1.0, "matmul=blas": 0.5})
  options.clear()
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(blas)], rounds=1, measure=measure)
  assert report["launch"] == "matmul=blas" and eng.decode_matmul == "blas"
  assert eng.matmul_impl == "xla" and eng.compiler_options is None  # (prefill's: the engine's)
  assert options == ["xla", "blas"]  # each decode program compiled with its launch's options
  assert padded and all(w[2] == (0, 6) for w in padded)  # traced for the library's GEMMs
  got = _group(eng)
  monkeypatch.setattr(choice, "matmul", lambda mesh, dtype, requested="auto": "blas")
  built = DecodeEngine(model, config)
  assert built.matmul_impl == built.decode_matmul == "blas"
  _same(got, _group(built), atol=2e-6)


def _computing(monkeypatch, name: str, change):
  """Engines whose decode programs under the launch ``name`` return ``change(tokens, logprobs)``
  in place of what they computed (a launch that compiles and runs, and computes otherwise)."""
  real = DecodeEngine._make_generate

  def made(self, *args, **kwargs):
    fn = real(self, *args, **kwargs)
    if self.launch.name != name:
      return fn

    def changed(*a, **k):
      state, (tokens, logprobs, valid) = fn(*a, **k)
      return state, (*change(tokens, logprobs), valid)
    return changed
  monkeypatch.setattr(DecodeEngine, "_make_generate", made)


@pytest.mark.parametrize("change, why", [
    (lambda t, lp: (t, lp + 1.0), r"computes otherwise than default: greedy logprobs differ by "
                                  r"up to 1 nats \(slot \d, step \d; over 0.05 in 16 of 16 "
                                  r"compared\)"),
    (lambda t, lp: (t, lp.at[2, 1].set(np.nan)), "computes NaN or infinite logprobs"),
    # its greedy path departs from step 1 (as at a near tie), then its logprobs too: compared up
    # to the step that departs, the same
    (lambda t, lp: (t.at[1:].add(1), lp.at[2:].add(3.0)), None)])
def test_a_launch_that_computes_otherwise_is_not_kept_however_fast(model, monkeypatch, change,
                                                                    why):
  """Each launch's first call decodes greedily, every slot from a token of its own; one whose
  logprobs differ from the engine's own launch's (up to where their greedy tokens part) or are
  not finite is dropped, however fast, and the engine decodes on with its own."""
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  _computing(monkeypatch, "writes=1", change)
  eng = DecodeEngine(model, CONFIG)
  measure, _ = _costs(eng, {"default": 1.0, "writes=1": 0.5})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1,
                                 measure=measure)
  if why is None:
    assert eng.launch == WRITES and not report["failed"]
    return
  assert eng.launch == OWN and report["launch"] == "default"
  assert list(report["failed"]) == ["writes=1"] and re.fullmatch(why, report["failed"]["writes=1"])
  assert list(report["step_ms"]) == ["default"]
  tok, lp, valid = _group(eng, calls=1)[0]
  assert valid.any() and np.isfinite(lp[valid]).all()


def test_the_engine_keeps_its_own_launch_unless_another_is_clearly_faster(model):
  eng = DecodeEngine(model, CONFIG)
  measure, _ = _costs(eng, {"default": 1.0, "writes=1": 0.98})  # 2%: within the margin
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1,
                                 measure=measure)
  assert eng.launch == OWN and report["launch"] == "default"
  measure, _ = _costs(eng, {"default": 1.0, "writes=1": 0.9})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1,
                                 measure=measure)
  assert eng.launch == WRITES and report["launch"] == "writes=1"


@pytest.mark.slow
def test_then_the_kept_launch_s_loop_in_cuda_graphs_is_timed(model, monkeypatch):
  """The second stage: the launch kept, with its decode call's loop in XLA's command buffers
  (``graphs``: compiler options of the decode program; XLA:CPU takes and ignores them, so here
  they decode as without), kept where faster; options XLA refuses drop that launch."""
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  eng = DecodeEngine(model, CONFIG)
  graphs = [dataclasses.replace(WRITES, graphs=g) for g in choice.GRAPHS]
  measure, timed = _costs(eng, {"default": 1.0, "writes=1": 0.8, "writes=1+graphs": 0.6,
                                "writes=1+graphs:unrolled": 0.5})
  state, report = launch_tuning.tune(eng, eng.init_state(),
                                     [offer(WRITES), choice.graphs_to_time], rounds=1,
                                     measure=measure)
  assert eng.launch == graphs[2] and report["launch"] == "writes=1+graphs:unrolled"
  assert timed == ["default", "writes=1"] * 2 + ["writes=1+graphs", "writes=1+graphs:unrolled",
                                                 "writes=1", "writes=1+graphs",
                                                 "writes=1+graphs:unrolled"]
  assert not report["failed"] and len(_group(eng)) == 5
  # options this XLA does not know: the launch fails to compile and is dropped
  # (an engine of the same config: the default launch's programs the first one's; the refused
  # launch is one not compiled before, under options no earlier program had, so XLA compiles it)
  monkeypatch.setattr(decode_launch, "COMMAND_BUFFERS", "FUSION,NO_SUCH_COMMAND")
  eng = DecodeEngine(model, CONFIG)
  measure, _ = _costs(eng, {"default": 1.0, "graphs": 0.1})
  _, report = launch_tuning.tune(eng, eng.init_state(),
                                 [offer(choice.Launch(None, OWN.paged, "while"))], rounds=1,
                                 measure=measure)
  assert report["launch"] == "default" and "NO_SUCH_COMMAND" in report["failed"]["graphs"]


def test_no_other_launch_is_tried_after_a_long_compile_of_the_engine_s_own(model):
  eng = DecodeEngine(model, CONFIG)
  slow = launch_tuning.MAX_COMPILE_S + 1  # (every call "takes" it: the first is the compile)
  measure, timed = _costs(eng, {"default": slow, "writes=1": 0.1})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES), offer(BOTH)], rounds=1,
                                 measure=measure)
  assert eng.launch == OWN and timed == ["default"] * 2 and list(report["step_ms"]) == ["default"]


def test_no_stage_is_started_once_the_timing_has_taken_too_long(model, monkeypatch):
  """Stages run until the timing has taken ``MAX_TUNE_S`` (the last, XLA's autotuned GEMMs, is
  skipped where the ones before took minutes); the launch kept by then is used."""
  monkeypatch.setattr(launch_tuning, "MAX_TUNE_S", 0.0)
  eng = DecodeEngine(model, CONFIG)
  measure, timed = _costs(eng, {"default": 1.0, "writes=1": 0.5, "writes=1+norms": 0.1})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES), offer(BOTH)], rounds=1,
                                 measure=measure)
  assert eng.launch == WRITES and "writes=1+norms" not in timed
  assert report["stages"] == 2 and report["stages_timed"] == 1
  monkeypatch.setattr(launch_tuning, "MAX_TUNE_S", 1e9)
  eng.use_launch(OWN)
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES), offer(BOTH)], rounds=1,
                                 measure=measure)
  assert eng.launch == BOTH and report["stages_timed"] == 2


def test_a_launch_that_fails_is_dropped_and_the_engine_decodes_on(model, monkeypatch):
  monkeypatch.setattr(engine_lib, "_COMPILED", {})  # (this engine's programs its own)
  eng = DecodeEngine(model, CONFIG)
  real = DecodeEngine._make_generate

  def failing(self, *args, **kwargs):
    if self.paged_tuning.writes:
      raise RuntimeError("Triton could not compile this kernel\nmore")
    return real(self, *args, **kwargs)

  monkeypatch.setattr(DecodeEngine, "_make_generate", failing)
  measure, timed = _costs(eng, {"default": 1.0, "writes=1": 0.1})
  state, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1,
                                     measure=measure)
  assert eng.launch == OWN and report["launch"] == "default" and timed == ["default"] * 2
  assert report["failed"] == {"writes=1": "RuntimeError: Triton could not compile this kernel"}
  monkeypatch.setattr(DecodeEngine, "_make_generate", real)
  assert len(_group(eng)) == 5


def _tight_plan(eng, decode_call: int, planned=None):
  """A memory plan for ``eng`` with no room beyond a decode call of ``decode_call`` bytes (its
  prefill counted as nothing, so the decode call decides); ``planned``: ``eng``'s plan at its own
  launch, where already made (its programs lowered once, not per plan)."""
  planned = memory.plan(eng, None) if planned is None else planned
  plan = dataclasses.replace(planned, prefill=0, generate_temp=decode_call)
  return dataclasses.replace(plan, budget_bytes=plan.peak_bytes)


def _decode_call(eng, launch) -> int:
  """The temporaries of ``eng``'s planned decode call under ``launch``."""
  kept = eng.launch
  eng.use_launch(launch)
  try:
    return memory.generate_bytes(eng)
  finally:
    eng.use_launch(kept)


@pytest.mark.slow
def test_a_launch_kept_instead_of_the_engine_s_own_must_fit_its_memory_plan(model):
  """The memory plan counted the engine's own launch's decode call; a faster launch whose decode
  call needs more than the plan leaves is not kept, and the stage keeps the fastest that fits
  (here, in interpret mode, the fused norms' decode call needs more than the default's and the
  paged step kernel's less)."""
  eng = DecodeEngine(model, CONFIG)
  own, writes, both = (_decode_call(eng, x) for x in (OWN, WRITES, BOTH))
  planned = memory.plan(eng, None)  # (at the own launch, as each tune below starts from)
  assert writes < own < both
  costs = {"default": 1.0, "writes=1": 0.8, "writes=1+norms": 0.5}
  measure, _ = _costs(eng, costs)
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES, BOTH)], rounds=1,
                                 measure=measure, plan=_tight_plan(eng, own, planned))
  assert eng.launch == WRITES and report["launch"] == "writes=1"
  assert list(report["failed"]) == ["writes=1+norms"]
  assert report["failed"]["writes=1+norms"].startswith(
      "does not fit the memory plan: its decode call needs")
  # a byte more of budget than the fused norms' decode call needs: kept
  eng.use_launch(OWN)
  plan = _tight_plan(eng, both, planned)
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES, BOTH)], rounds=1,
                                 measure=measure, plan=plan)
  assert eng.launch == BOTH and not report["failed"]
  # the engine's own launch is what the plan counted: kept however little room is left
  eng.use_launch(OWN)
  measure, _ = _costs(eng, {**costs, "default": 0.1})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(BOTH)], rounds=1,
                                 measure=measure, plan=_tight_plan(eng, 0, planned))
  assert eng.launch == OWN and not report["failed"]
  # nothing but the engine's own fits: its own, and later stages start from it
  measure, _ = _costs(eng, costs)
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES), offer(BOTH)], rounds=1,
                                 measure=measure, plan=_tight_plan(eng, writes - 1, planned))
  assert eng.launch == OWN and set(report["failed"]) == {"writes=1", "writes=1+norms"}
  assert len(_group(eng)) == 5


def test_a_launch_whose_planned_decode_call_fails_to_compile_is_not_kept(model, monkeypatch):
  """A launch that ran at the timing's kv bucket but whose decode call at the largest one (what
  the plan counts) fails to compile is dropped, not left to fail when decoding reaches it."""
  eng = DecodeEngine(model, CONFIG)
  plan = _tight_plan(eng, _decode_call(eng, BOTH))
  real = memory.generate_bytes

  def failing(engine):
    if engine.launch == WRITES:
      raise RuntimeError("Triton: out of shared memory\nmore")
    return real(engine)

  monkeypatch.setattr(memory, "generate_bytes", failing)
  measure, _ = _costs(eng, {"default": 1.0, "writes=1": 0.5, "writes=1+norms": 0.8})
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES, BOTH)], rounds=1,
                                 measure=measure, plan=plan)
  assert eng.launch == BOTH and list(report["failed"]) == ["writes=1"]
  assert report["failed"]["writes=1"] == ("its planned decode call (the largest kv bucket) "
                                          "failed to compile: RuntimeError: Triton: out of "
                                          "shared memory")


def test_the_wall_clock_times_each_launch(model):
  """Without a ``measure``: every launch's step timed on this device, the one kept among them."""
  eng = DecodeEngine(model, dataclasses.replace(CONFIG, kv_pages=10))  # pages for 2 slots
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1)
  assert set(report["step_ms"]) == {"default", "writes=1"} and report["slots"] == 2
  assert report["position"] == 32  # half the positions
  _, report = launch_tuning.tune(eng, eng.init_state(), [offer(WRITES)], rounds=1, position=8)
  assert report["position"] == 8 and report["slots"] == 4  # (2 pages each reach 12 positions)
  assert all(ms > 0 for ms in report["step_ms"].values())
  assert report["launch"] in report["step_ms"]
  assert "writes=1" in launch_tuning.summary(report)


def test_nothing_is_timed_where_there_is_nothing_else_to_run(model):
  """On CPU (and TPU, or with ``decode_tuning="off"``) an engine offers only its own launch."""
  eng = DecodeEngine(model, CONFIG)
  assert eng.launch_stages() == []
  state = eng.init_state()
  assert launch_tuning.tune(eng, state) == (state, None)
  with pytest.raises(ValueError, match="decode_tuning='fast'"):
    EngineConfig(decode_tuning="fast")


def _service(model, num_slots=4, **kw):
  return JaxRolloutEngine(model, num_slots=num_slots, max_len=64, prefill_buckets=(16,),
                          steps_per_call=4, decode_attention="pallas_gpu", decode_matmul="xla",
                          decode_layers="unrolled", kv_pages=20, page_size=8,
                          eos_token_ids=(), **kw)


def _sample(eng):
  eng.submit(GroupRequest(0, [5, 7, 9, 11], n=2, params=SamplingParams(
      temperature=1.0, max_new_tokens=10, seed=4)))
  return sorted((s.tokens, s.logprobs) for s in _collect(eng, 2))


def _offer_writes_as_a_gpu_would(monkeypatch) -> list:
  """Engines offer ``WRITES`` beside their own launch (with ``decode_tuning="auto"``, as on a
  GPU) and their calls are timed by a clock under which it is faster; the calls timed."""
  def offered(self):
    return [offer(WRITES)] if self.config.decode_tuning == "auto" else []

  monkeypatch.setattr(DecodeEngine, "launch_stages", offered)
  calls = []

  def measure(call):
    jax.block_until_ready(call())
    calls.append(1)
    return 0.5 if len(calls) % 2 == 0 else 1.0  # writes=1 (every second call) is faster

  monkeypatch.setattr(launch_tuning, "wall_seconds", measure)
  return calls


def test_the_service_times_once_before_its_first_decode(model, monkeypatch, capsys):
  """``start`` times the launches (here offered on CPU as a GPU would), once, saying which it
  compiles and which it kept; what it samples is what a service built with the launch kept
  samples."""
  calls = _offer_writes_as_a_gpu_would(monkeypatch)
  eng = _service(model)
  eng.start()
  try:
    assert eng.engine.launch == WRITES and eng.launch_report["launch"] == "writes=1"
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == ["sampler decode launch: compiling default to time it",
                           "sampler decode launch: compiling writes=1 to time it"]
    assert printed[2].startswith("sampler decode launch: writes=1 (a decode step at 4 slots")
    n = len(calls)
    got = _sample(eng)
  finally:
    eng.stop()
  eng.start()  # again: not timed again
  eng.stop()
  assert len(calls) == n
  monkeypatch.setenv(choice.PAGED_TUNING_ENV, "writes=1")
  ref = _service(model, decode_tuning="off")
  assert ref.engine.launch == WRITES
  ref.start()
  try:
    want = _sample(ref)
  finally:
    ref.stop()
  assert [t for t, _ in got] == [t for t, _ in want]
  np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=2e-6)


def test_the_service_s_launch_must_fit_the_memory_plan_it_was_sized_by(model, monkeypatch,
                                                                       capsys):
  """``memory_plan`` (what ``runtime.engines.build`` sized the service by) bounds the launch it
  keeps: one whose decode call does not fit is timed but not kept, and the line says so."""
  _offer_writes_as_a_gpu_would(monkeypatch)
  eng = _service(model)
  eng.memory_plan = _tight_plan(eng.engine, _decode_call(eng.engine, WRITES) - 1)
  report = eng.tune_launch()
  assert eng.engine.launch == OWN and report["launch"] == "default"
  assert "writes=1" in report["step_ms"] and list(report["failed"]) == ["writes=1"]
  assert "failed: writes=1" in capsys.readouterr().out


@pytest.mark.slow
def test_replicas_take_the_launch_the_first_one_timed(model, monkeypatch):
  """Over two replicas the first times the launches; the second runs the one it kept, untimed.
  Two slots a replica (each warm-up compiles fewer widths and rows): a group of two still fits
  either replica, and each times or takes the launch as at four."""
  from areal_jax import sharding
  from areal_jax.sampler.replicas import ReplicatedRolloutEngine

  timed = _offer_writes_as_a_gpu_would(monkeypatch)
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  eng = ReplicatedRolloutEngine(lambda m, out: _service(model, 2, mesh=m, output=out),
                                sharding.split_mesh(mesh, "data"))
  eng.warmup()
  assert len(timed) == 2 * (1 + launch_tuning.ROUNDS)  # one replica's launches, each timed
  assert [r.engine.launch for r in eng.replicas] == [WRITES, WRITES]
  assert eng.launch_report["launch"] == "writes=1"
  eng.start()
  try:
    assert len(_sample(eng)) == 2
  finally:
    eng.stop()
  assert len(timed) == 2 * (1 + launch_tuning.ROUNDS)


@pytest.mark.slow
def test_every_launch_a_gpu_would_time_decodes_as_the_default(monkeypatch):
  """The stages a GPU engine times (``choice.launch_stages`` for a GPU: our paged step kernel,
  with dots, unpipelined, 2 pages a step, 4 warps, the fused norms, the loop in graphs, the
  library's GEMMs autotuned, XLA's GEMMs), walked to the last of each on CPU (Pallas in
  interpret mode; XLA:CPU takes the graphs' options and ignores them): each compiles and runs,
  and the launch kept decodes as the engine's default does. The model has one layer: a launch
  changes each layer's kernels alike, and each of the twelve decode programs compiles and runs
  one layer's kernels instead of two."""
  from .conftest import tiny_model
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  monkeypatch.setenv("XLA_FLAGS", " ".join(  # (no command buffers forced; the 8 devices kept)
      f for f in os.environ.get("XLA_FLAGS", "").split() if "command_buffer" not in f))
  model = tiny_model(3, head_dim=32, n_layers=1)  # (dots: half a head of at least 16)
  config = dataclasses.replace(CONFIG, page_size=16, kv_pages=20)
  eng, ref = DecodeEngine(model, config), DecodeEngine(model, config)
  m = model.cfg
  stages = choice.launch_stages(
      "gpu", "auto", paged_pallas=True, one_device=True, group=m.n_heads // m.n_kv_heads,
      page_size=16, head_dim=m.head_dim, norm_dims=((m.d_model, 8 * m.head_dim),),
      matmul_open=True, blas=True)
  ranks = {}  # each launch faster than every one offered before it

  def measure(call):
    jax.block_until_ready(call())
    return 1.0 / ranks.setdefault(eng.launch.name, len(ranks) + 1)

  _, report = launch_tuning.tune(eng, eng.init_state(), stages, rounds=1, measure=measure)
  # (Triton's loop unpipelined: no pipelining in interpret mode; then two pages a step, 4 warps;
  # XLA:CPU takes the autotuning option as it takes the graphs')
  step = "warps=4,writes=1,dot=1"
  last = f"{step}+norms+graphs:unrolled+autotune"
  assert list(report["step_ms"]) == [
      "default", "writes=1", "writes=1,dot=1", "stages=1,writes=1,dot=1",
      "block_pages=2,writes=1,dot=1", step, f"{step}+norms:block_n=16", f"{step}+norms",
      f"{step}+norms+graphs", f"{step}+norms+graphs:unrolled", last,
      f"{step}+norms+graphs:unrolled+matmul=xla"]
  assert report["launch"] == f"{step}+norms+graphs:unrolled+matmul=xla"
  assert not report["failed"]

  _same(_group(eng, page_size=16, samples=2, calls=3),
        _group(ref, page_size=16, samples=2, calls=3), atol=2e-5)
