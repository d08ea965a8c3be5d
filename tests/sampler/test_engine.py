"""Device side: greedy parity with naive decoding, logprob parity with the learner-side forward,
bounded compilation, and a 4-device sampler mesh with slots over data."""

import dataclasses
import gc
import os
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import monitoring

from areal_jax import sharding
from areal_jax.models import ModelConfig, Transformer
from areal_jax.sampler import sampling, slot_cache
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
from areal_jax.sampler.pages import PageTable

from .conftest import full_forward_logprobs


def _decode(eng, prompt, n, steps, slots=None, temperature=1.0, greedy=False, seed=0):
  """Runs one group through prefill/insert/generate; returns per-sample tokens and logprobs."""
  state = eng.init_state()
  slots = slots or list(range(n))
  keys = np.stack([np.asarray(sampling.slot_key(seed, i)) for i in range(n)])
  state = eng.insert(state, eng.prefill(eng.params, prompt[:-1]), slots, token=[prompt[-1]] * n,
                     pos=[len(prompt) - 1] * n, end=[eng.config.max_len] * n, keys=keys,
                     temperature=temperature, top_k=0, top_p=1.0, greedy=greedy, stop_ids=[])
  toks, lps = [[] for _ in range(n)], [[] for _ in range(n)]
  while len(toks[0]) < steps:
    state, (t, lp, v) = eng.generate(eng.params, state, eng.kv_bucket(len(prompt) + len(toks[0])))
    t, lp, v = np.asarray(t), np.asarray(lp), np.asarray(v)
    for i, s in enumerate(slots):
      toks[i] += [int(x) for x in t[v[:, s], s]]
      lps[i] += [float(x) for x in lp[v[:, s], s]]
  return [x[:steps] for x in toks], [x[:steps] for x in lps]


@nnx.jit
def _forward(model, tokens_1xL):
  return model(tokens_1xL, attention="dense")


def _naive_greedy(model, prompt, steps):
  """The model's greedy tokens after ``prompt``, one full (dense causal) forward a token. The row
  is padded to a multiple of 64 tokens (causal: the padding after a position changes nothing
  before it) and the forward takes the model as an argument, so the module's references compile
  it once per model shape, not once per test and length."""
  seq = np.zeros((1, -(-(len(prompt) + steps) // 64) * 64), np.int32)
  seq[0, :len(prompt)] = prompt
  for i in range(len(prompt), len(prompt) + steps):
    seq[0, i] = int(jnp.argmax(_forward(model, seq)[0, i - 1]))
  return [int(t) for t in seq[0, len(prompt):len(prompt) + steps]]


def test_greedy_equals_naive_argmax(model):
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, steps_per_call=3,
                                         prefill_buckets=(8, 32), kv_buckets=(16, 64)))
  prompt = [5, 7, 9, 11, 3, 1, 2]
  toks, _ = _decode(eng, prompt, 2, 20, slots=[1, 3], greedy=True)
  expected = _naive_greedy(model, prompt, 20)
  assert toks[0] == expected and toks[1] == expected


def test_behaviour_logprobs_match_full_forward(model):
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64))
  prompt = [3, 14, 15, 92, 65]
  temperature = 0.7
  toks, lps = _decode(eng, prompt, 4, 24, temperature=temperature, seed=11)
  assert len({tuple(t) for t in toks}) == 4  # distinct samples from one shared prefill
  for t, lp in zip(toks, lps):
    np.testing.assert_allclose(lp, full_forward_logprobs(model, prompt, t, temperature), atol=1e-4)


def test_logprobs_exact_with_slots_at_very_different_positions(model):
  """24 slots, 16 on a short prompt above 8 on a long one: decode attention sorts the rows into
  groups that stop at their own last cache chunk; every logprob still equals the full forward's."""
  eng = DecodeEngine(model, EngineConfig(num_slots=24, max_len=128, prefill_buckets=(8, 96)))
  groups = [([3, 14, 15], list(range(8, 24))),
            ([(7 * i) % 120 + 1 for i in range(70)], list(range(8)))]
  state = eng.init_state()
  for g, (prompt, slots) in enumerate(groups):
    n = len(slots)
    keys = np.stack([np.asarray(sampling.slot_key(g, i)) for i in range(n)])
    state = eng.insert(state, eng.prefill(eng.params, prompt[:-1]), slots, token=[prompt[-1]] * n,
                       pos=[len(prompt) - 1] * n, end=[128] * n, keys=keys, temperature=1.0,
                       top_k=0, top_p=1.0, greedy=False, stop_ids=[])
  toks, lps = np.zeros((0, 24), np.int32), np.zeros((0, 24), np.float32)
  for _ in range(6):
    state, (t, lp, _) = eng.generate(eng.params, state, 128)
    toks, lps = np.concatenate([toks, np.asarray(t)]), np.concatenate([lps, np.asarray(lp)])
  for prompt, slots in groups:
    for s in slots:
      np.testing.assert_allclose(lps[:, s], full_forward_logprobs(model, prompt, toks[:, s]),
                                 atol=1e-4)


@pytest.mark.slow
def test_no_recompilation_in_steady_state(model):
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 32),
                                         kv_buckets=(16, 32, 64)))
  compiles = []
  listener = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    ticks = []  # every prefill, insert and kv bucket, each reported once compiled
    eng.warmup(eng.init_state(), lambda done, total, what: ticks.append((done, total, what)))
    _decode(eng, [1, 2, 3], 1, 2)  # and the test's own helpers (sampling keys)
    warm = len(compiles)
    n_fns = eng.num_compiled()
    # every variant this engine built was timed once, at its first call (deactivate is built with
    # the engine), and the warm-up's progress counted each of them once, out of a total known first
    stats = dict(eng.compile_stats)
    assert stats["compiles"] == n_fns - 1 and stats["compile_s"] > 0
    assert [t[:2] for t in ticks] == [(k, n_fns - 1) for k in range(1, n_fns)]
    whats = [t[2] for t in ticks]
    assert len(set(whats)) == len(whats) and "generate kv 64 width 4" in whats
    for prompt_len, n in ((4, 3), (5, 1), (18, 2), (25, 4), (31, 3), (2, 1)):
      _decode(eng, list(range(2, prompt_len + 2)), n, 64 - prompt_len - 1)
    assert len(compiles) == warm, compiles[warm:]
    assert eng.compile_stats == stats
    # prefill buckets (8, 32 and max_len - 1) x (1, 2, 4 prompts) + insert (those buckets + no
    # prefix) x (1, 2, 4 rows) + generate per kv bucket x width (1, 2, 4) + move (1, 2 rows)
    # + deactivate
    assert eng.width_buckets == (1, 2, 4)
    assert eng.num_compiled() == n_fns <= 3 * 3 + 4 * 3 + 3 * 3 + 2 + 1
  finally:
    monitoring.unregister_event_duration_listener(listener)


def test_batched_prefill_equals_one_prompt_at_a_time(model):
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 32),
                                         max_prefill_batch=2))
  prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8, 9], [], [2, 7, 1, 8, 2]]  # 2 calls: 2 prompts, then 1
  batched = eng.prefill_batch(eng.params, prompts)
  assert batched[2] is None
  for prompt, prefix in zip(prompts, batched):
    if not prompt:
      continue
    alone = eng.prefill(eng.params, prompt)
    for layer_b, layer_a in zip(prefix, alone):
      for name in ("k", "v"):
        assert layer_b[name].shape[0] == 1
        np.testing.assert_allclose(layer_b[name][:, :len(prompt)], layer_a[name][:, :len(prompt)],
                                   atol=1e-5)


def test_a_token_budget_caps_prefill_rows_at_long_buckets_and_changes_no_prefix(model):
  """``max_prefill_tokens``: a call at a long bucket takes fewer prompts (its memory grows with
  rows x bucket), short buckets keep their rows, and every prefix is what the uncapped engine
  gives."""
  cfg = dict(num_slots=8, max_len=64, prefill_buckets=(8, 16, 32), max_prefill_batch=8)
  eng = DecodeEngine(model, EngineConfig(max_prefill_tokens=64, **cfg))
  free = DecodeEngine(model, EngineConfig(**cfg))
  assert [eng.prefill_rows(8, b) for b in eng.prefill_buckets] == [8, 4, 2, 1]  # 63: the last
  assert [free.prefill_rows(8, b) for b in free.prefill_buckets] == [8, 8, 8, 8]
  assert eng.prefill_rows(3, 32) == 2 and eng.prefill_rows(1, 63) == 1  # at least one row
  # the largest bucket at its rows, and the one whose rows hold the most tokens (of equal
  # tokens the longer bucket: its attention is larger)
  assert eng.prefill_shapes_to_plan() == [(32, 2), (63, 1)]
  assert free.prefill_shapes_to_plan() == [(63, 8)]
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 100, n)) for n in (3, 30, 12, 7, 50, 9, 31, 2, 15, 40)]
  calls = []
  eng._variant = lambda fns, key, make, what: calls.append(key) or make()  # noqa: SLF001
  capped, uncapped = eng.prefill_batch(eng.params, prompts), free.prefill_batch(free.params, prompts)
  assert all(rows * bucket <= 64 or rows == 1 for bucket, rows in calls), calls
  for prompt, a, b in zip(prompts, capped, uncapped):
    for layer_a, layer_b in zip(a, b):
      for name in ("k", "v"):
        np.testing.assert_allclose(layer_a[name][:, :len(prompt)], layer_b[name][:, :len(prompt)],
                                   atol=1e-5)
  with pytest.raises(ValueError, match="invalid engine config"):
    EngineConfig(max_prefill_tokens=-1, **cfg)


@pytest.mark.parametrize("impl,layers", [("pallas_gpu", "unrolled"), ("pallas_gpu", "scan"),
                                         ("pallas_gpu", "paged"), ("pallas_tpu", "unrolled")])
@pytest.mark.slow
def test_a_flash_prefill_gives_the_dense_prefill_s_cache_and_tokens(model, impl, layers):
  """``prefill_attention``: the flash kernel (Pallas interpret mode here) over a prompt's own keys
  and values fills the cache the dense prefill fills (every position of the bucket, padding
  included: both attend causally), for several prompts a call, with the layers unrolled over
  per-layer caches, in a scan, or unrolled over the stacked prefix a paged engine inserts (a GPU's
  default); and the decode after it draws the same greedy tokens with the same logprobs."""
  paged = layers == "paged"
  cfg = dict(num_slots=4, max_len=64, prefill_buckets=(8, 32), max_prefill_batch=2,
             decode_layers="unrolled" if paged else layers, decode_matmul="xla",
             **(dict(kv_pages=20, page_size=8) if paged else {}))
  dense = DecodeEngine(model, EngineConfig(prefill_attention="dense", **cfg))
  flash = DecodeEngine(model, EngineConfig(prefill_attention=impl, **cfg))
  assert (dense.prefill_attention, flash.prefill_attention) == ("dense", impl)
  prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3]]
  for a, b in zip(dense.prefill_batch(dense.params, prompts),
                  flash.prefill_batch(flash.params, prompts)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)
  if paged:  # (decoding over pages from equal prefixes: test_a_paged_cache_decodes_...)
    assert flash.paged and flash.cache_layout == slot_cache.STACKED
    return
  prompt = prompts[1]
  (t_d, lp_d), (t_f, lp_f) = (_decode(e, prompt, 2, 12, greedy=True) for e in (dense, flash))
  assert t_f == t_d
  np.testing.assert_allclose(lp_f, lp_d, atol=1e-4)


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
@pytest.mark.slow
def test_moved_sequences_continue_exactly_at_a_narrower_width(model, layers):
  """Sequences moved down mid-decode and advanced at a smaller width draw the same tokens with the
  same logprobs as if they had stayed; a live slot beyond the width is left untouched."""
  eng = DecodeEngine(model, EngineConfig(num_slots=8, max_len=64, decode_layers=layers,
                                         decode_matmul="xla" if layers == "scan" else "auto"))
  assert eng.width_buckets == (1, 2, 4, 8)
  prompt, n, steps = [4, 8, 15, 16, 23], 3, 20
  ref_toks, ref_lps = _decode(eng, prompt, n, steps, slots=[5, 6, 7], temperature=0.8, seed=3)

  state = eng.init_state()
  keys = np.stack([np.asarray(sampling.slot_key(3, i)) for i in range(n)])
  state = eng.insert(state, eng.prefill(eng.params, prompt[:-1]), [5, 6, 7],
                     token=[prompt[-1]] * n, pos=[len(prompt) - 1] * n, end=[64] * n, keys=keys,
                     temperature=0.8, top_k=0, top_p=1.0, greedy=False, stop_ids=[])
  toks = [[] for _ in range(n)]
  lps = [[] for _ in range(n)]
  for step in range(steps):
    if step == 7:  # slots 5, 6 -> 0, 1 and slot 7 -> 2: the group now fits width 4
      state = eng.move(state, [5, 6, 7], [0, 1, 2])
      assert not np.asarray(state["active"])[5:].any()
    slots = [5, 6, 7] if step < 7 else [0, 1, 2]
    width = 8 if step < 7 else 4
    state, (t, lp, v) = eng.generate(eng.params, state, eng.kv_bucket(len(prompt) + step), width)
    t, lp, v = np.asarray(t), np.asarray(lp), np.asarray(v)
    assert t.shape == (1, width)
    for i, s in enumerate(slots):
      assert v[0, s]
      toks[i].append(int(t[0, s]))
      lps[i].append(float(lp[0, s]))
  assert toks == ref_toks
  np.testing.assert_allclose(lps, ref_lps, atol=1e-5)

  # a live slot beyond the width does not advance (its position stays)
  pos_before = np.asarray(state["pos"]).copy()
  state = eng.insert(state, None, [6], token=[1], pos=[3], end=[64], keys=keys[:1],
                     temperature=1.0, top_k=0, top_p=1.0, greedy=True, stop_ids=[])
  state, _ = eng.generate(eng.params, state, 64, 4)
  pos = np.asarray(state["pos"])
  assert pos[6] == 3 and (pos[:3] == pos_before[:3] + 1).all()


def test_four_device_mesh_slots_over_data(model):
  mesh = sharding.make_mesh({"data": 4}, jax.devices()[4:8])
  eng = DecodeEngine(model, EngineConfig(num_slots=8, max_len=64, steps_per_call=2), mesh)
  state = eng.init_state()
  assert state["cache"][0]["k"].sharding.spec[0] == "data"
  assert len(state["cache"][0]["k"].sharding.device_set) == 4
  prompt = [9, 8, 7, 6]
  toks, _ = _decode(eng, prompt, 3, 12, slots=[0, 3, 6], greedy=True)
  assert toks == [_naive_greedy(model, prompt, 12)] * 3


@pytest.mark.slow
def test_discarded_engine_frees_its_params(model):
  """Compiled functions are shared between engines but must not pin an engine's weights."""
  config = EngineConfig(num_slots=2, max_len=32, prefill_buckets=(8,))
  eng = DecodeEngine(model, config)
  state = eng.warmup(eng.init_state())
  ref = weakref.ref(jax.tree.leaves(eng.params)[0])
  del eng, state
  gc.collect()
  assert ref() is None
  again = DecodeEngine(model, config)  # reuses the compiled functions
  toks, _ = _decode(again, [1, 2, 3], 1, 4, greedy=True)
  assert toks == [_naive_greedy(model, [1, 2, 3], 4)]


@pytest.mark.parametrize("impl", ["xla", "dense", "pallas_gpu"])
@pytest.mark.slow
def test_accelerator_paths_forced_on_cpu_match_the_reference(model, impl):
  """The GPU/TPU path run on CPU: a forced decode attention (Pallas in interpret mode), XLA's
  matmuls and 16 steps per call give the naive greedy tokens and the full forward's logprobs."""
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 32),
                                         steps_per_call=16, decode_attention=impl,
                                         decode_matmul="xla"))
  assert eng.attention_impl == impl and eng.matmul_impl == "xla"
  prompt = [5, 7, 9, 11, 3, 1, 2]
  toks, _ = _decode(eng, prompt, 2, 20, slots=[1, 3], greedy=True)
  assert toks[0] == toks[1] == _naive_greedy(model, prompt, 20)
  toks, lps = _decode(eng, prompt, 2, 20, temperature=0.7, seed=3)
  for t, lp in zip(toks, lps):
    np.testing.assert_allclose(lp, full_forward_logprobs(model, prompt, t, 0.7), atol=1e-4)


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
@pytest.mark.slow
def test_the_gpu_library_gemms_path_forced_on_cpu_decodes_the_same(model, monkeypatch, layers):
  """The GPU default's decode (the dense read, the vendor library's GEMMs: ``"blas"``, forced here
  without its GPU compiler options) pads each K/V head's queries (2 here) to 8 rows over its
  bfloat16 cache (``choice.query_rows``): the same tokens and logprobs as XLA's matmuls without
  the padding."""
  from areal_jax.kernels import choice, xla_attention
  padded = []
  pad = jnp.pad
  monkeypatch.setattr(xla_attention.jnp, "pad",
                      lambda x, w, *a, **k: padded.append(w) or pad(x, w, *a, **k))
  config = EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 32), steps_per_call=4,
                        decode_attention="dense", decode_layers=layers, cache_dtype="bfloat16",
                        decode_matmul="xla")
  prompt, runs = [5, 7, 9, 11, 3, 1, 2], []
  for matmul in ("xla", "blas"):
    if matmul == "blas":
      monkeypatch.setattr(choice, "matmul", lambda mesh, dtype, requested="auto": "blas")
      monkeypatch.setattr(choice, "compiler_options", lambda impl: None)
    eng = DecodeEngine(model, config)
    assert eng.matmul_impl == matmul and not padded
    runs.append(_decode(eng, prompt, 3, 12, slots=[0, 1, 3], temperature=0.7, seed=5))
  assert padded and all(w[2] == (0, 6) for w in padded)  # 2 queries + 6 zero ones
  (toks, lps), (toks_ref, lps_ref) = runs[1], runs[0]
  assert toks == toks_ref
  np.testing.assert_allclose(lps, lps_ref, atol=1e-5)


def test_defaults_come_from_the_platform_and_the_attention(model):
  eng = DecodeEngine(model, EngineConfig(num_slots=2, max_len=300))
  assert eng.config.steps_per_call == 1 and eng.kv_buckets == (300,)  # per-slot reads on CPU
  assert not eng.weights.cfg.vocab_major_logits  # (the TPU's form of the LM head)
  dense = DecodeEngine(model, EngineConfig(num_slots=2, max_len=300, decode_attention="dense"))
  assert dense.kv_buckets == (64, 128, 256, 300)  # the dense read stops at the furthest slot's
  assert dense.kv_bucket(100) == 128
  # the Pallas kernels over the scan's stacked cache read each slot up to its own position
  for impl in ("pallas_gpu", "pallas_tpu"):
    paged = DecodeEngine(model, EngineConfig(num_slots=2, max_len=320, decode_attention=impl,
                                             decode_layers="scan", decode_matmul="xla",
                                             cache_dtype="bfloat16"))
    assert paged.kv_buckets == (320,)
  per_layer = DecodeEngine(model, EngineConfig(num_slots=2, max_len=320, decode_attention="pallas_gpu"))
  assert per_layer.kv_buckets == (64, 128, 256, 320)  # gqa splits the bound


def test_engines_built_under_another_kernel_launch_compile_their_own_programs(model, monkeypatch):
  """The Pallas GPU kernel's launch (read when a program is traced) and the fused norms (read
  when an engine is built) are part of what engines share compiled programs by: an engine built
  under another launch compiles its own (as a benchmark builds them side by side in one process),
  one built under the same reuses them."""
  from areal_jax.kernels import choice
  config = EngineConfig(num_slots=2, max_len=32, prefill_buckets=(16,), steps_per_call=2,
                        decode_attention="xla", decode_matmul="xla", kv_buckets=(32,))

  def compiles(**env):
    for name in (choice.PAGED_TUNING_ENV, choice.NORM_MATMUL_ENV):
      monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
    eng = DecodeEngine(model, config)
    eng.generate(eng.params, eng.init_state(), 32)
    return eng.compile_stats["compiles"]

  assert compiles() == 1
  assert compiles(**{choice.PAGED_TUNING_ENV: "writes=1"}) == 1
  assert compiles(**{choice.NORM_MATMUL_ENV: "1"}) == 1
  assert compiles() == 0 and compiles(**{choice.PAGED_TUNING_ENV: "writes=1"}) == 0


def test_weights_are_held_in_the_compute_dtype():
  """bfloat16 compute: the engine keeps matmul weights and the embedding in bfloat16 (cast once in
  put_params; the caller's float32 arrays untouched), norms in float32, with the same results as
  float32 weights cast inside every step."""
  model = Transformer(ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  head_dim=16, d_ff=128, dtype="bfloat16"), nnx.Rngs(3))
  eng = DecodeEngine(model, EngineConfig(num_slots=2, max_len=32, prefill_buckets=(8,)))
  master = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  placed = eng.put_params(master)
  assert placed["embed"].dtype == jnp.bfloat16 and master["embed"].dtype == jnp.float32
  assert placed["layers"][0]["mlp"]["up"].dtype == jnp.bfloat16
  assert placed["layers"][0]["attn_norm"]["scale"].dtype == jnp.float32
  uncast = jax.device_put(master, eng.param_shardings)  # float32: the model casts in the step
  outs = []
  for params in (placed, uncast):
    state = eng.init_state()
    state = eng.insert(state, eng.prefill(params, [1, 2, 3]), [0, 1], token=[4] * 2, pos=[3] * 2,
                       end=[32] * 2, keys=np.zeros((2, 2), np.uint32), temperature=1.0, top_k=0,
                       top_p=1.0, greedy=False, stop_ids=[])
    for _ in range(3):
      state, out = eng.generate(params, state, 32)
      outs.append(jax.device_get(out))
  for a, b in zip(outs[:3], outs[3:]):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("impl,steps", [("dense", 1), ("dense", 3), ("dense", 16), ("xla", 4),
                                        ("pallas_gpu", 16)])
@pytest.mark.slow
def test_layers_in_a_scan_match_the_reference(model, impl, steps):
  """The layers in a scan (stacked weights and cache, forced on CPU): the naive greedy tokens and
  the full forward's logprobs, over several steps per call."""
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8, 32),
                                         steps_per_call=steps, decode_attention=impl,
                                         decode_matmul="xla", decode_layers="scan"))
  assert eng.layers_impl == "scan" and eng.attention_impl == impl
  n_layers = model.cfg.n_layers
  assert eng.params["layers"]["mlp"]["up"].shape == (n_layers,) + model.layers[0].mlp.up.shape
  assert eng.init_state()["cache"]["k"].shape == (n_layers, 4, 2, 64, 16)  # heads before positions
  prompt = [5, 7, 9, 11, 3, 1, 2]
  toks, _ = _decode(eng, prompt, 2, 20, slots=[1, 3], greedy=True)
  assert toks[0] == toks[1] == _naive_greedy(model, prompt, 20)
  toks, lps = _decode(eng, prompt, 3, 20, temperature=0.7, seed=3)
  for t, lp in zip(toks, lps):
    np.testing.assert_allclose(lp, full_forward_logprobs(model, prompt, t, 0.7), atol=1e-4)


def test_layers_in_a_scan_on_a_four_device_mesh(model):
  """Stacked cache with slots over the data axis (axis 1), stacked weights placed per layer's
  sharding; greedy decoding still equals the naive loop."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:8])
  eng = DecodeEngine(model, EngineConfig(num_slots=8, max_len=64, steps_per_call=2,
                                         decode_attention="dense", decode_matmul="xla",
                                         decode_layers="scan"), mesh)
  cache = eng.init_state()["cache"]["k"]
  assert cache.sharding.spec[1] == "data" and len(cache.sharding.device_set) == 4
  assert cache.sharding.spec[2] == "tensor"  # the K/V heads
  prompt = [9, 8, 7, 6]
  toks, _ = _decode(eng, prompt, 3, 12, slots=[0, 3, 6], greedy=True)
  assert toks == [_naive_greedy(model, prompt, 12)] * 3


@pytest.mark.parametrize("split,steps", [(False, 8), (True, 4)])
@pytest.mark.slow
def test_pallas_tpu_path_matches_the_chunked_read_across_weight_swaps(model, other_model, split,
                                                                      steps):
  """The TPU kernel path forced on CPU (Pallas TPU interpret mode; the layers in a scan, a bfloat16
  cache, float32 compute, several steps per call), on one device and on a data x tensor mesh: the same
  tokens and logprobs (1e-4) as XLA's chunked read of the same cache, through a weight swap that
  keeps the cache and a continuation re-prefilled under the new weights. Two calls, the second
  after the swap (it reads the cache the first wrote under the old weights): with 8 steps a call
  and a 15-token prompt they put the re-prefilled slot where its call crosses the end of the
  cache (position 30 of 32); with 4 (on the mesh, where each step costs most), a 7-token prompt
  decodes positions 6..13 and the re-prefilled slot 14..17. (The kernel reads these rows of 32
  positions as one page of 32: no page or block boundary lies between.)"""
  mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:8]) if split else None
  config = EngineConfig(num_slots=4, max_len=32, prefill_buckets=(8, 32), steps_per_call=steps,
                        decode_matmul="xla", decode_layers="scan", cache_dtype="bfloat16")
  engines = [DecodeEngine(model, dataclasses.replace(config, decode_attention=impl), mesh)
             for impl in ("pallas_tpu", "xla")]
  assert engines[0].attention_impl == "pallas_tpu" and engines[0].kv_buckets == (32,)
  new = nnx.to_pure_dict(nnx.state(other_model, nnx.Param))
  calls, length = 2, 15 if steps == 8 else 7
  prompt, runs = [5, 7, 9, 11, 3, 1, 2, 8, 4, 6, 10, 12, 13, 14, 15][:length], []
  for eng in engines:
    params, state, outs = eng.params, eng.init_state(), []
    keys = np.stack([np.asarray(sampling.slot_key(3, i)) for i in range(3)])
    state = eng.insert(state, eng.prefill(params, prompt[:-1]), [0, 1, 3], token=[prompt[-1]] * 3,
                       pos=[len(prompt) - 1] * 3, end=[32] * 3, keys=keys, temperature=0.7,
                       top_k=0, top_p=1.0, greedy=False, stop_ids=[])
    for call in range(calls):
      if call == calls - 1:  # the swap: the cache written under the old weights is kept
        params = eng.put_params(new)
      state, out = eng.generate(params, state, 32)
      outs.append(jax.device_get(out))
    # slot 0's sequence re-prefilled under the new weights into slot 2, decoded on from there
    seq = prompt + [int(t) for t in np.concatenate([o[0][:, 0] for o in outs])]
    state = eng.deactivate(state, [0, 1, 3])
    state = eng.insert(state, eng.prefill(params, seq[:-1]), [2], token=[seq[-1]],
                       pos=[len(seq) - 1], end=[32], keys=keys[:1], temperature=0.7, top_k=0,
                       top_p=1.0, greedy=False, stop_ids=[])
    state, out = eng.generate(params, state, 32)
    runs.append(outs + [jax.device_get(out)])
  for (tok, lp, valid), (tok_ref, lp_ref, valid_ref) in zip(*runs):
    np.testing.assert_array_equal(valid, valid_ref)
    np.testing.assert_array_equal(np.where(valid, tok, -1), np.where(valid_ref, tok_ref, -1))
    np.testing.assert_allclose(np.where(valid, lp, 0), np.where(valid_ref, lp_ref, 0), atol=1e-4)
  # the re-prefilled slot's steps (to the end of the cache when the call is longer)
  assert runs[0][-1][2][:, 2].sum() == min(steps, 32 - len(prompt) - calls * steps)


_ROWS_RUNS = {}  # (rows config, launch) -> the rows engine's calls in the paged-cache test


@pytest.mark.parametrize("impl,layers", [("dense", "scan"), ("pallas_gpu", "scan"),
                                         ("pallas_tpu", "scan"), ("dense", "unrolled"),
                                         ("pallas_tpu", "unrolled"), ("cpu", "unrolled"),
                                         ("pallas_gpu:writes", "unrolled"),
                                         ("pallas_gpu:writes:parts", "scan"),
                                         ("pallas_gpu:writes:fused", "unrolled"),
                                         ("pallas_gpu:writes:fused", "scan"),
                                         ("pallas_gpu:writes:fused:norms", "unrolled"),
                                         ("pallas_gpu:fused:norms", "scan")])
@pytest.mark.slow
def test_a_paged_cache_decodes_what_the_slot_rows_decode(model, impl, layers, monkeypatch):
  """A group of three over a paged cache (its prompt's full page shared, the partial one copied,
  pages taken as the slots grow): the same tokens and logprobs as an engine with a cache row per
  slot and the layers in a scan, through the dense read over gathered pages and both Pallas
  kernels (interpret mode), the paged engine's layers in a scan or unrolled (its per-layer weights
  over the same pools; ``cpu``: the CPU defaults, C++ matmul kernel included; ``:writes``: the
  step's writes and attention in one kernel, ``kernels.pallas_paged_step``, ``:parts`` each row's
  pages read by it in 3 parts combined after it, ``:fused`` with the projections fused, so the
  kernel takes them before rope and rotates them itself; ``:norms``: the
  paged engine's norms each in one kernel with the matmul after it, ``kernels.pallas_norm_matmul``,
  the rows engine's as written). A 15-token prompt and 3 calls of 4 steps (positions 14..25) in
  rows of 32 positions (4 pages of 8: the fewest that hold them) still cross every page boundary
  of the row: page 1 copied partial, pages 2 and 3 taken at 16 and 24, and with ``:parts`` a
  part left empty (rows of 2 and of 4 pages). The rows engine's run
  depends only on its config and launch (the same for both layers of an impl, and for ``cpu`` and
  ``dense``), so each runs once (``_ROWS_RUNS``)."""
  from areal_jax.kernels import choice
  impl, *how = impl.split(":")
  monkeypatch.setenv(choice.PAGED_TUNING_ENV, ("writes=1" if "writes" in how else "")
                     + (",parts=3" if "parts" in how else ""))
  monkeypatch.delenv(choice.NORM_MATMUL_ENV, raising=False)
  projections = "fused" if "fused" in how else "auto"
  base = EngineConfig(num_slots=4, max_len=32, prefill_buckets=(16,), steps_per_call=4,
                      decode_attention=impl, decode_matmul="xla", decode_layers="scan",
                      decode_projections=projections,
                      cache_dtype="bfloat16" if impl == "pallas_tpu" else None)
  paged = dict(kv_pages=20, page_size=8, decode_layers=layers)
  if impl == "cpu":
    base = dataclasses.replace(base, decode_attention="dense")
    paged.update(decode_attention="auto", decode_matmul="auto")
  prompt, slots, runs = [5, 7, 9, 11, 3, 1, 2, 8, 4, 6, 10, 12, 13, 14, 15], [0, 2, 3], []
  keys = np.stack([np.asarray(sampling.slot_key(3, i)) for i in range(3)])
  for kv_pages in (0, 20):
    if not kv_pages and (base, os.environ[choice.PAGED_TUNING_ENV]) in _ROWS_RUNS:
      runs.append(_ROWS_RUNS[base, os.environ[choice.PAGED_TUNING_ENV]])
      continue
    if kv_pages and "norms" in how:  # (read when an engine is built)
      monkeypatch.setenv(choice.NORM_MATMUL_ENV, "1")
    eng = DecodeEngine(model, dataclasses.replace(base, **(paged if kv_pages else {})))
    assert eng.layers_impl == (layers if kv_pages else "scan")
    assert (eng.norm_tuning is not None) == (kv_pages > 0 and "norms" in how)
    table = PageTable(4, 20, 8, 32) if kv_pages else None
    if table is not None:
      assert table.share(slots, len(prompt) - 1) and table.free_pages == 20 - 1 - 3
    state = eng.insert(eng.init_state(), eng.prefill(eng.params, prompt[:-1]), slots,
                       token=[prompt[-1]] * 3, pos=[len(prompt) - 1] * 3, end=[32] * 3, keys=keys,
                       temperature=0.7, top_k=0, top_p=1.0, greedy=False, stop_ids=[],
                       pages=None if table is None else table.table[slots])
    outs = []
    for call in range(3):  # positions 14..25: pages 1 (partial, copied), 2, 3 taken on the way
      if table is not None:
        assert all(table.grow(s, min(len(prompt) - 1 + 4 * (call + 1), 32)) for s in slots)
      state, out = eng.generate(eng.params, state, eng.kv_bucket(len(prompt) + 4 * call),
                                pages=None if table is None else table.table)
      outs.append(jax.device_get(out))
    runs.append(outs)
    if not kv_pages:
      _ROWS_RUNS[base, os.environ[choice.PAGED_TUNING_ENV]] = outs
  assert eng.init_state()["cache"]["k"].shape == (2, 2, 21, 8, 16)  # the pool, not slot rows
  for (tok, lp, valid), (tok_ref, lp_ref, valid_ref) in zip(*runs):
    np.testing.assert_array_equal(valid, valid_ref)
    np.testing.assert_array_equal(tok[valid], tok_ref[valid])
    np.testing.assert_allclose(lp[valid], lp_ref[valid], atol=2e-6 if impl != "cpu" else 2e-5)


def test_a_paged_cache_needs_one_slot_split_and_room_for_a_sequence(model):
  with pytest.raises(ValueError, match="not split over slots"):
    DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, kv_pages=8, decode_layers="scan",
                                     decode_matmul="xla"),
                 sharding.make_mesh({"data": 2}, jax.devices()[:2]))
  with pytest.raises(ValueError, match="cannot hold one sequence"):
    DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=3, page_size=16,
                                     decode_layers="scan", decode_matmul="xla"))


def test_on_a_gpu_the_layers_default_to_unrolled_also_with_a_paged_cache(model, monkeypatch):
  """A GPU engine left to choose runs the layers unrolled (XLA:GPU copies a scanned layer's weight
  and cache slices every step), over a cache row per slot (the dense read) or a paged cache's
  pools (the Pallas GPU kernel reads them in place) alike; kv_pages -1 pages it, a pool of each
  slot's row of pages and one more; the platform forced here, XLA's matmuls asked for (the GPU
  default's options are for a GPU compiler)."""
  from areal_jax.kernels import choice
  monkeypatch.setattr(choice, "platform_of", lambda mesh: "gpu")
  for env in (choice.LAYERS_ENV, choice.ATTENTION_ENV, choice.PAGED_ENV):
    monkeypatch.delenv(env, raising=False)
  rows = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, decode_matmul="xla"))
  paged = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=8, page_size=16,
                                           decode_matmul="xla"))
  auto = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=-1, page_size=16,
                                          decode_matmul="xla"))
  assert (rows.layers_impl, rows.attention_impl, rows.paged) == ("unrolled", "dense", False)
  assert (paged.layers_impl, paged.attention_impl) == ("unrolled", "pallas_gpu")
  assert (auto.layers_impl, auto.attention_impl, auto.config.kv_pages) == \
      ("unrolled", "pallas_gpu", 2 * (4 + 1)) and auto.pool_follows_slots
  assert not paged.pool_follows_slots and not rows.pool_follows_slots
  assert len(rows.init_state()["cache"]) == model.cfg.n_layers  # per-layer caches
  assert paged.init_state()["cache"]["k"].shape[:3] == (model.cfg.n_kv_heads, model.cfg.n_layers, 9)
  small_pages = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=16,
                                                 page_size=8, decode_matmul="xla"))
  assert small_pages.attention_impl == "dense"  # pages of 8: under the kernel's 16-position blocks
  forced_dense = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=-1,
                                                  decode_attention="dense", decode_matmul="xla"))
  assert not forced_dense.paged and forced_dense.attention_impl == "dense"
  if len(jax.devices()) >= 2:  # slots split over a data axis: rows, not an error
    split = DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, kv_pages=-1,
                                             decode_matmul="xla"),
                         sharding.make_mesh({"data": 2}, jax.devices()[:2]))
    assert not split.paged and split.attention_impl == "dense"


def test_on_a_tpu_the_layers_default_to_unrolled_with_one_scatter_per_layer(model, monkeypatch):
  """A TPU engine left to choose runs the layers unrolled over positions-first per-layer caches,
  each layer's new keys and values written with one scatter (a TPU compiles a per-row update into a
  loop over the rows), and decodes the naive greedy tokens; the platform forced here, XLA's matmuls
  asked for (the matmul choice reads the mesh's devices)."""
  from areal_jax.kernels import choice
  monkeypatch.setattr(choice, "platform_of", lambda mesh: "tpu")
  for env in (choice.LAYERS_ENV, choice.ATTENTION_ENV, choice.MATMUL_ENV):
    monkeypatch.delenv(env, raising=False)
  eng = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8,),
                                         steps_per_call=4, width_buckets=(),
                                         decode_matmul="xla"))
  assert (eng.layers_impl, eng.attention_impl) == ("unrolled", "dense")
  assert eng.cache_layout == slot_cache.ROWS
  asked = []
  extend = Transformer.extend
  monkeypatch.setattr(Transformer, "extend", lambda self, *a, **kw: (
      asked.append(kw.get("scatter_writes")), extend(self, *a, **kw))[1])
  eng._make_generate(eng.kv_buckets[-1], 4).lower(eng.params, eng.state_shapes())
  assert asked and all(asked)  # (a per-row update also lowers to a scatter, which XLA:TPU loops)
  monkeypatch.setattr(Transformer, "extend", extend)
  # the logits vocabulary-major, each slot's block of them taken by a masked sum
  assert eng.weights.cfg.vocab_major_logits and not model.cfg.vocab_major_logits
  # the weights and the state held in the layouts its widest decode program picked
  from jax.experimental.layout import Format
  assert all(isinstance(f, Format) for f in jax.tree.leaves((eng.held_formats, eng.state_formats)))
  by_mask, sample = [], sampling.sample
  monkeypatch.setattr(sampling, "sample", lambda *a, **kw: (
      by_mask.append(kw.get("select_by_mask")), sample(*a, **kw))[1])
  eng._make_generate(eng.kv_buckets[-1], 4).lower(eng.params, eng.state_shapes())
  assert by_mask and all(by_mask)
  monkeypatch.setattr(sampling, "sample", sample)
  prompt = [5, 7, 9, 11, 3, 1, 2]
  toks, _ = _decode(eng, prompt, 4, 10, greedy=True)
  assert toks == [_naive_greedy(model, prompt, 10)] * 4


def test_pallas_tpu_refuses_what_its_kernel_cannot_read(model):
  for kw, what in (({"decode_layers": "unrolled", "cache_dtype": "bfloat16"}, "decode_layers"),
                   ({"decode_layers": "scan"}, "cache_dtype='bfloat16'"),
                   ({"decode_layers": "scan", "cache_dtype": "bfloat16", "max_len": 40},
                    "multiple of 16")):
    with pytest.raises(ValueError, match=what):
      DecodeEngine(model, EngineConfig(**{"num_slots": 2, "max_len": 64, "decode_matmul": "xla",
                                          "decode_attention": "pallas_tpu", **kw}))


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
@pytest.mark.slow
def test_lora_adapters_are_merged_once_per_version(layers):
  """``put_params(adapters)`` decodes exactly like the merged model (a Qwen3-shaped one here), also
  with the layers in a scan and fused projections (merged, then fused and stacked)."""
  from flax import nnx

  from areal_jax.models import ModelConfig, Transformer, lora
  qwen3 = Transformer(ModelConfig(arch="qwen3", qk_norm=True, vocab_size=128, d_model=64),
                      nnx.Rngs(3))
  lcfg = lora.LoraConfig(rank=4, alpha=8.0)
  base = nnx.to_pure_dict(nnx.state(qwen3, nnx.Param))
  ad = lora.init_adapters(base, lcfg, jax.random.key(0))
  ad = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape), ad)
  cfg = EngineConfig(num_slots=2, max_len=32, prefill_buckets=(8,), decode_layers=layers,
                     decode_matmul="xla" if layers == "scan" else "auto",
                     decode_projections="fused" if layers == "scan" else "auto")
  eng = DecodeEngine(qwen3, cfg, lora=lcfg)
  eng.params = eng.put_params(ad)
  merged = lora.merged_model(qwen3, ad, lcfg)
  prompt = [5, 7, 9, 11]
  toks, _ = _decode(eng, prompt, 1, 8, greedy=True)
  assert toks[0] == _naive_greedy(merged, prompt, 8)
  assert toks[0] != _naive_greedy(qwen3, prompt, 8)  # the adapters change the answer
  plain = DecodeEngine(merged, cfg)  # full weights still go in as they are
  for x, y in zip(jax.tree.leaves(eng.params), jax.tree.leaves(plain.params)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
@pytest.mark.slow
def test_fused_projections_decode_like_the_separate_ones(layers):
  """q/k/v and gate/up fused once per version (the GPU/TPU default) on a mesh whose tensor axis
  splits the KV heads: the fused weights are split over it in whole KV heads, and prefill, decode
  and a weight swap give the separate layout's tokens and logprobs (a Qwen2-shaped model: q/k/v
  biases fused too)."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:8])
  cfg = ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=128, d_model=64, n_layers=2,
                    n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
  model = Transformer(cfg, nnx.Rngs(5))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = jax.tree.map(lambda x: x + 0.05 if x.ndim == 1 else x, params)  # nonzero biases
  config = EngineConfig(num_slots=8, max_len=64, steps_per_call=2, decode_attention="dense",
                        decode_matmul="xla", decode_layers=layers)
  runs = {}
  for projections in ("separate", "fused"):
    eng = DecodeEngine(model, dataclasses.replace(config, decode_projections=projections), mesh)
    assert eng.projections == projections
    out = []
    for version in (params, nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(6)), nnx.Param))):
      eng.params = eng.put_params(version)
      out.append(_decode(eng, [9, 8, 7, 6, 5], 3, 10, slots=[0, 3, 6], temperature=0.9, seed=2))
    runs[projections] = out
    layer = eng.params["layers"] if layers == "scan" else eng.params["layers"][0]
    if projections == "fused":
      assert {"qkv", "qkv_bias"} <= set(layer["attn"]) and "gate_up" in layer["mlp"]
      assert "tensor" in layer["attn"]["qkv"].sharding.spec  # split in whole KV heads
  for (tok_s, lp_s), (tok_f, lp_f) in zip(runs["separate"], runs["fused"]):
    assert tok_s == tok_f
    np.testing.assert_allclose(lp_f, lp_s, atol=1e-5)
  assert runs["fused"][0][0] != runs["fused"][1][0]  # the swap changed the samples


def test_a_slow_first_call_is_logged_as_a_warning(model, monkeypatch, caplog):
  """Every program variant's first call (its compilation) is logged; one slower than
  ``SLOW_COMPILE_S`` as a warning, which the launcher's default verbosity shows."""
  import logging

  from areal_jax.sampler import variants
  eng = DecodeEngine(model, EngineConfig(num_slots=2, max_len=48, prefill_buckets=(8,),
                                         kv_buckets=(24, 48)))
  state = eng.init_state()
  with caplog.at_level(logging.INFO, logger=variants.__name__):
    state, _ = eng.generate(eng.params, state, 24)
    monkeypatch.setattr(variants, "SLOW_COMPILE_S", 0.0)
    state, _ = eng.generate(eng.params, state, 48)
    state, _ = eng.generate(eng.params, state, 48)  # compiled: not logged again
  records = [(r.levelno, r.getMessage()) for r in caplog.records]
  assert [level for level, _ in records] == [logging.INFO, logging.WARNING], records
  assert "generate kv_len=24 width=2 compiled in" in records[0][1]
  assert "generate kv_len=48 width=2" in records[1][1] and "compile_cache_dir" in records[1][1]


def test_a_device_too_small_for_the_widest_decode_program_still_builds_the_engine(model,
                                                                                  monkeypatch):
  """Where the compiler's layouts are held (a TPU), the engine compiles its widest decode program
  when built; a TPU's compiler refuses one whose buffers exceed the chip (64 slots of 16k
  positions of Qwen3-1.7B: 118.87 GiB, compiled for a v5e by libtpu on a CPU). The engine then
  holds the default layouts instead of raising, so the memory plan can build it again with the
  slots that fit (which find their layouts)."""
  from areal_jax.kernels import choice
  from areal_jax.sampler import engine as engine_lib

  real = DecodeEngine._make_generate

  def refusing(self, kv_len, width, formats=None, truncate=False):
    fn = real(self, kv_len, width, formats, truncate)
    if formats is None or width <= 4:
      return fn

    class Refused:
      def lower(self, *args):
        def compile():
          raise jax.errors.JaxRuntimeError(
              "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
              "temporaries (118.87G) exceeds available HBM (15.75G).")
        return types.SimpleNamespace(compile=compile)
    return Refused()

  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  monkeypatch.setenv(choice.HELD_LAYOUTS_ENV, "compiler")
  monkeypatch.setattr(DecodeEngine, "_make_generate", refusing)
  wide = DecodeEngine(model, EngineConfig(num_slots=8, max_len=64, prefill_buckets=(8,)))
  assert wide.held_formats is wide.held_shardings and wide.state_formats is wide.state_shardings
  narrow = DecodeEngine(model, EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8,)))
  assert narrow.held_formats is not narrow.held_shardings  # (its compile went through)
  monkeypatch.setattr(DecodeEngine, "_make_generate", lambda *a, **k: (_ for _ in ()).throw(
      jax.errors.JaxRuntimeError("INTERNAL: something else")))
  with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
    DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, prefill_buckets=(8,)))


# A small engine the layout and sampling tests below share: their engines with the default layouts
# reuse each other's compiled programs (``engine._COMPILED``); a paged one has pages of 8 in a
# pool of 40, room for every slot's full row.
_SMALL = dict(num_slots=4, max_len=64, prefill_buckets=(8,), steps_per_call=3, width_buckets=(2,))
_SMALL_PAGED = dict(kv_pages=40, page_size=8)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.slow
def test_weights_and_state_stay_in_the_layouts_the_compiler_picked(model, monkeypatch, paged):
  """With the compiler's layouts held (``choice.held_layouts``, a TPU's default; forced here on
  CPU, and the layouts the compiler "picked" forced to every array's axes reversed, which XLA:CPU
  can hold): the weights are put in them (also a new version), the decode state is made in them
  and every program (prefill, insert, generate, move, deactivate) returns it in them, and the
  tokens and logprobs are those of an engine with the default layouts."""
  from jax.experimental.layout import Format, Layout

  from areal_jax.kernels import choice
  from areal_jax.sampler import engine as engine_lib

  def reversed_axes(tree):
    return jax.tree.map(lambda sh, x: Format(Layout(major_to_minor=tuple(range(x.ndim))[::-1]), sh),
                        *tree)

  def picked(self, model_params):  # what the compiler's pick stands in for here
    held = reversed_axes((self.held_shardings, self.weights.shapes(model_params)))
    return held, reversed_axes((self.state_shardings, jax.eval_shape(self._new_state())))

  config = EngineConfig(**_SMALL, **(_SMALL_PAGED if paged else {}))
  plain = DecodeEngine(model, config)
  monkeypatch.setattr(engine_lib, "_COMPILED", {})  # (programs built with these layouts)
  monkeypatch.setenv(choice.HELD_LAYOUTS_ENV, "compiler")
  monkeypatch.setattr(DecodeEngine, "_compiler_layouts", picked)
  eng = DecodeEngine(model, config)

  def in_layouts(tree, formats):  # (a state's device arrays: not the host's TRUNCATES)
    tree = {k: v for k, v in tree.items() if k != engine_lib.TRUNCATES}
    got = [x.format.layout.major_to_minor for x in jax.tree.leaves(tree)]
    want = [f.layout.major_to_minor for f in jax.tree.leaves(formats)]
    return got == want and any(m != tuple(sorted(m)) for m in got)

  assert in_layouts(eng.params, eng.held_formats)
  eng.params = eng.put_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))  # a new version
  assert in_layouts(eng.params, eng.held_formats)
  prompt, slots, runs = [5, 7, 9, 11, 3, 1, 2], [0, 1], []
  keys = np.stack([np.asarray(sampling.slot_key(4, i)) for i in range(2)])
  for e in (plain, eng):
    table = PageTable(4, 40, 8, 64) if paged else None
    if table is not None:
      assert table.share(slots, len(prompt) - 1)
    state = e.init_state()
    assert e is plain or in_layouts(state, eng.state_formats)
    state = e.insert(state, e.prefill(e.params, prompt[:-1]), slots, token=[prompt[-1]] * 2,
                     pos=[len(prompt) - 1] * 2, end=[64] * 2, keys=keys, temperature=0.8,
                     top_k=0, top_p=1.0, greedy=False, stop_ids=[],
                     pages=None if table is None else table.table[slots])
    outs = []
    for call in range(3):
      if table is not None:
        assert all(table.grow(s, len(prompt) - 1 + 3 * (call + 1)) for s in slots)
      state, out = e.generate(e.params, state, 64, pages=None if table is None else table.table)
      outs.append(jax.device_get(out))
      assert e is plain or in_layouts(state, eng.state_formats)
    if table is None:
      state = e.move(state, [1], [2])
    state = e.deactivate(state, [0])
    assert e is plain or in_layouts(state, eng.state_formats)
    runs.append(outs)
  for a, b in zip(*runs):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.slow
def test_the_program_compiled_to_find_the_layouts_is_the_widest_variant(model, monkeypatch, paged):
  """With the compiler's layouts held (a TPU's default; forced here on CPU, found by the compiler
  itself), the widest decode program is compiled once, when the engine is built: its first call
  compiles nothing, a narrower width compiles its own; the tokens and logprobs are those of an
  engine with the default layouts, and the engine's compile stats count that program."""
  from areal_jax.kernels import choice
  from areal_jax.sampler import engine as engine_lib

  config = EngineConfig(**_SMALL, **(_SMALL_PAGED if paged else {}))
  plain = DecodeEngine(model, config)
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  monkeypatch.setenv(choice.HELD_LAYOUTS_ENV, "compiler")
  compiles = []
  listener = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    eng = DecodeEngine(model, config)
    assert eng.compile_stats["compiles"] == 1
    assert eng.compile_stats["compile_s"] == eng.layouts_compile_s > 0
    prompt, slots, runs = [5, 7, 9, 11, 3, 1, 2], [0, 1, 2, 3], []
    keys = np.stack([np.asarray(sampling.slot_key(4, i)) for i in slots])
    for e in (plain, eng):
      table = PageTable(4, 40, 8, 64) if paged else None
      if table is not None:
        assert table.share(slots, len(prompt) - 1)
      state = e.insert(e.init_state(), e.prefill(e.params, prompt[:-1]), slots,
                       token=[prompt[-1]] * 4, pos=[len(prompt) - 1] * 4, end=[64] * 4,
                       keys=keys, temperature=0.8, top_k=0, top_p=1.0, greedy=False, stop_ids=[],
                       pages=None if table is None else table.table[slots])
      outs = []
      for call, width in enumerate((4, 4, 2)):
        if table is not None:
          assert all(table.grow(s, len(prompt) - 1 + 3 * (call + 1)) for s in slots)
        before = len(compiles)
        state, out = e.generate(e.params, state, 64, width,
                                pages=None if table is None else table.table)
        outs.append(jax.device_get(out))
        if e is eng:  # the widest program was compiled with the engine; width 2 compiles now
          assert len(compiles) - before == (call == 2), (call, compiles[before:])
      runs.append(outs)
  finally:
    monitoring.unregister_event_duration_listener(listener)
  # that one, the prefill, the insert and the generate of width 2
  assert eng.compile_stats["compiles"] == 4 == eng.num_compiled()
  for a, b in zip(*runs):
    for x, y in zip(a, b):
      np.testing.assert_allclose(y, x, atol=1e-6)


@pytest.mark.slow
def test_the_host_picks_the_program_that_sorts_for_top_k_and_top_p(model, monkeypatch):
  """Where the engine decides on the host whether a call's slots truncate (a GPU's default,
  ``choice.truncation_on_host``; forced here): a call whose slots in its width all keep every
  token runs the program without the sort, one with a top-p or top-k slot the one with it (no
  branch in either); the host's copy follows insert, move and a slot armed again; the tokens
  and logprobs are bit for bit those of the engine deciding in the step; warm-up compiles
  both programs and leaves no slot truncating."""
  from areal_jax.kernels import choice
  from areal_jax.sampler import engine as engine_lib

  config = EngineConfig(num_slots=4, max_len=64, prefill_buckets=(8,), steps_per_call=3,
                        width_buckets=(2,))
  monkeypatch.setattr(engine_lib, "_COMPILED", {})  # (each engine's programs its own)
  in_step = DecodeEngine(model, config)
  monkeypatch.setattr(engine_lib, "_COMPILED", {})
  monkeypatch.setenv(choice.TRUNCATION_ENV, "1")
  on_host = DecodeEngine(model, config)
  assert on_host.truncation_on_host and not in_step.truncation_on_host
  prompt = [5, 7, 9, 11, 3, 1, 2]

  def arm(e, state, slots, seed, **params):
    keys = np.stack([np.asarray(sampling.slot_key(seed, i)) for i in range(len(slots))])
    n = len(slots)
    return e.insert(state, e.prefill(e.params, prompt[:-1]), slots, token=[prompt[-1]] * n,
                    pos=[len(prompt) - 1] * n, end=[64] * n, keys=keys, stop_ids=[],
                    **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "greedy": False, **params})

  runs, programs = [], []
  for e in (in_step, on_host):
    state = arm(e, e.init_state(), [0, 1], 1, temperature=1.3)
    state = arm(e, state, [3], 2, top_p=0.6)
    outs = []
    for width in (4, 2, 4):
      state, out = e.generate(e.params, state, 64, width)
      outs.append(out)
      programs.append(sorted(e._generate_fns))  # noqa: SLF001
    state = e.move(state, [3], [2])  # the top-p sequence moves down
    if e is on_host:
      np.testing.assert_array_equal(state[engine_lib.TRUNCATES], [False, False, True, False])
    state = arm(e, state, [3], 3, top_p=0.8, greedy=True)  # slot 3 armed again, greedy
    if e is on_host:
      np.testing.assert_array_equal(state[engine_lib.TRUNCATES], [False, False, True, False])
    state, out = e.generate(e.params, state, 64, 4)
    outs.append(out)
    state = arm(e, state, [2], 4, top_k=0)  # slot 2 armed again without truncation
    state, out = e.generate(e.params, state, 64, 4)
    outs.append(out)
    programs.append(sorted(e._generate_fns))  # noqa: SLF001
    if e is on_host:
      np.testing.assert_array_equal(state[engine_lib.TRUNCATES], [False] * 4)
    runs.append(jax.device_get(outs))
  for a, b in zip(*runs):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(y, x)
  both = [(64, 2, None), (64, 4, None)]  # a program per width, the step deciding
  assert programs[:4] == [[(64, 4, None)], both, both, both]
  assert programs[4:] == [[(64, 4, True)], [(64, 2, False), (64, 4, True)],
                          [(64, 2, False), (64, 4, True)],
                          [(64, 2, False), (64, 4, False), (64, 4, True)]]
  # a slot whose sequence is over no longer counts: deactivated, or retired (host only)
  state = arm(on_host, on_host.init_state(), [0, 1, 2], 5, top_k=3)
  state = on_host.deactivate(state, [0])
  np.testing.assert_array_equal(state[engine_lib.TRUNCATES], [False, True, True, False])
  device = {k: v for k, v in state.items() if k != engine_lib.TRUNCATES}
  state = on_host.retire(state, [1, 2])
  assert not state[engine_lib.TRUNCATES].any()
  assert all(state[k] is v for k, v in device.items())
  ticks = []
  state = on_host.warmup(on_host.init_state(), lambda done, total, what: ticks.append(what))
  generates = [w for w in ticks if w.startswith("generate")]
  assert len(generates) == 2 * len(on_host.kv_buckets) * len(on_host.width_buckets)
  assert sum("top-k/top-p" in w for w in generates) == len(generates) // 2
  assert not state[engine_lib.TRUNCATES].any()


def test_an_inactive_slot_draws_greedily_so_its_top_p_never_makes_the_step_sort(model):
  """A slot whose sequence stopped keeps its sampling parameters on the device. Where the step
  decides whether to sort (CPU's default), it draws for an inactive slot greedily (a token that
  is dropped), so the slot's top-p does not make the step sort: its tokens are its argmax, and
  the active slots draw what they draw beside an inactive slot without top-p (3 calls of 3
  steps: every step of a call draws the argmax for it)."""
  config = EngineConfig(**_SMALL)
  eng = DecodeEngine(model, config)
  prompt = [5, 7, 9, 11, 3, 1, 2]
  prefix = eng.prefill(eng.params, prompt[:-1])
  argmax = _naive_greedy(model, prompt, 1)[0]
  runs = []
  for stale_top_p in (0.3, 1.0):
    state = eng.init_state()
    for slots, seed, temperature, top_p in (([3], 9, 5.0, stale_top_p), ([0, 1], 1, 1.0, 1.0)):
      keys = np.stack([np.asarray(sampling.slot_key(seed, i)) for i in range(len(slots))])
      state = eng.insert(state, prefix, slots, token=[prompt[-1]] * len(slots),
                         pos=[len(prompt) - 1] * len(slots), end=[64] * len(slots), keys=keys,
                         temperature=temperature, top_k=0, top_p=top_p, greedy=False, stop_ids=[])
    state = eng.deactivate(state, [3])
    outs = []
    for _ in range(3):
      state, out = eng.generate(eng.params, state, 64)
      outs.append(jax.device_get(out))
    runs.append(outs)
  for a, b in zip(*runs):
    assert not a[2][:, 3].any() and (a[0][:, 3] == argmax).all()
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x[:, :2], y[:, :2])


def test_an_engine_asks_whether_its_devices_run_pallas_gpu_kernels(model, monkeypatch):
  """The engine takes ``choice.triton_unusable`` of its mesh's devices into its kernel choices: told
  its devices are too old for Triton, a requested Pallas GPU kernel stops the build with the
  reason (on this CPU the kernel would otherwise run in interpret mode)."""
  from areal_jax.kernels import choice
  seen = []
  monkeypatch.setattr(choice, "triton_unusable",
                      lambda devices: seen.append(list(devices)) or "a Tesla T4 (7.5)")
  with pytest.raises(ValueError, match=r"'pallas_gpu' cannot run here: a Tesla T4"):
    DecodeEngine(model, EngineConfig(num_slots=2, max_len=64, decode_attention="pallas_gpu"))
  assert seen == [list(jax.devices()[:1])]
