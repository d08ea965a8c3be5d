"""Transformer: logit parity with ``transformers``, KV-cache extend, packed segments, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import sharding
from areal_jax.models import attention_forms, hf, init_cache, transformer

VOCAB = 300


@nnx.jit
def forward(model, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
  return model(tokens_BxL, positions_BxL, segment_ids_BxL)


@nnx.jit(static_argnames=("kv_len", "heads_major", "impl", "scatter_writes"))
def extend(model, tokens_BxL, start_B, cache, kv_len=None, heads_major=False, impl=None,
           scatter_writes=False):
  return model.extend(tokens_BxL, start_B, cache, kv_len, attention_impl=impl,
                      heads_major=heads_major, scatter_writes=scatter_writes)


# the positions-first cache (the CPU's), the heads-major one (a GPU's, read by the dense form) and
# the positions-first one written by one scatter a layer (a TPU's)
LAYOUTS = {"rows": {}, "heads": {"heads_major": True, "impl": "dense"},
           "scatter": {"scatter_writes": True, "impl": "dense"}}


def _tokens(b, l, seed=0):
  return np.random.RandomState(seed).randint(0, VOCAB, (b, l)).astype(np.int32)


@pytest.mark.parametrize("causal_block", [64, 4], ids=["dense", "blocked"])
@pytest.mark.slow
def test_full_forward_matches_transformers(hf_checkpoint, torch_logits, causal_block, monkeypatch):
  monkeypatch.setattr(attention_forms, "CAUSAL_BLOCK", causal_block)
  jax.clear_caches()  # the block size is fixed at trace time
  arch, path, torch_model = hf_checkpoint
  model, _ = hf.load_hf(path)
  assert model.cfg.arch == arch and model.cfg.qkv_bias == (arch == "qwen2")
  assert model.cfg.qk_norm == (arch == "qwen3")
  assert model.cfg.tie_embeddings == torch_model.config.tie_word_embeddings
  tokens = _tokens(2, 17)
  ours = np.asarray(forward(model, jnp.asarray(tokens)))
  assert ours.dtype == np.float32 and ours.shape == (2, 17, VOCAB)
  np.testing.assert_allclose(ours, torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_prefill_and_decode_match_transformers(hf_checkpoint, torch_logits, layout):
  """A prefill, a multi-token chunk onto the filled cache and single-token decode steps give
  ``transformers``' logits. The chunk is as long as the prefill (6 tokens from position 6), so
  both run one program: two per layout, not three."""
  _, path, torch_model = hf_checkpoint
  model, _ = hf.load_hf(path)
  tokens = _tokens(2, 16, seed=1)
  ref = torch_logits(torch_model, tokens)
  kw = LAYOUTS[layout]
  cache = init_cache(model.cfg, 2, 16, heads_major=layout == "heads")
  # Prefill 6 tokens, a chunk of 6, then 4 decode steps, the last in the cache's last slot.
  chunks = [(0, 6), (6, 12), (12, 13), (13, 14), (14, 15), (15, 16)]
  for begin, end in chunks:
    start = jnp.full((2,), begin, jnp.int32)
    logits, cache = extend(model, jnp.asarray(tokens[:, begin:end]), start, cache, kv_len=16,
                           **kw)
    np.testing.assert_allclose(np.asarray(logits), ref[:, begin:end], atol=1e-4, rtol=0,
                               err_msg=f"tokens [{begin}, {end})")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_extend_rows_at_different_positions(hf_checkpoint, torch_logits, layout):
  """Rows of one batch continue at different positions: a row's padding slots are overwritten or
  masked. (The prefill test's cache of 16 slots and call shapes, so its programs serve.)"""
  _, path, torch_model = hf_checkpoint
  model, _ = hf.load_hf(path)
  a, b = _tokens(1, 7, seed=2)[0], _tokens(1, 4, seed=3)[0]
  kw = LAYOUTS[layout]
  cache = init_cache(model.cfg, 2, 16, heads_major=layout == "heads")
  _, cache = extend(model, jnp.asarray([a[:6], np.r_[b[:3], 0, 0, 0]]), jnp.zeros(2, jnp.int32),
                    cache, kv_len=16, **kw)
  # Row 0 continues at 6, row 1 at 3 (its padding slots are overwritten / masked).
  logits, _ = extend(model, jnp.asarray([[a[6]], [b[3]]]), jnp.asarray([6, 3], jnp.int32), cache,
                     kv_len=16, **kw)
  np.testing.assert_allclose(np.asarray(logits[0, 0]), torch_logits(torch_model, a[None])[0, -1],
                             atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(logits[1, 0]), torch_logits(torch_model, b[None])[0, -1],
                             atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_heads_major_cache_holds_the_same_keys_and_values(hf_checkpoint):
  """Extending the first rows of a bigger cache (a decode call narrower than the slots: a scatter)
  and all of it (a per-row update), the heads-major cache ends up the positions-first one with
  heads and positions swapped, and the logits agree (to float32 rounding: the two layouts' dense
  attentions sum in different orders); written by scatters throughout, the positions-first cache
  and the logits are the same bits. (Two rows and the prefill test's 16 slots, so most of its
  programs serve: the one-row decode step is the one narrower than the slots.)"""
  _, path, _ = hf_checkpoint
  model, _ = hf.load_hf(path)
  caches = {layout: init_cache(model.cfg, 2, 16, heads_major=layout == "heads")
            for layout in LAYOUTS}
  steps = [(_tokens(2, 6, seed=4), [0, 0]), (_tokens(1, 1, seed=5), [6]),
           (_tokens(2, 1, seed=6), [7, 6])]
  for tokens, start in steps:
    out = {}
    for layout, kw in LAYOUTS.items():
      out[layout], caches[layout] = extend(model, jnp.asarray(tokens), jnp.asarray(start, jnp.int32),
                                           caches[layout], kv_len=16, **{**kw, "impl": "dense"})
    np.testing.assert_allclose(np.asarray(out["heads"]), np.asarray(out["rows"]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["scatter"]), np.asarray(out["rows"]))
  for rows, heads, scattered in zip(caches["rows"], caches["heads"], caches["scatter"]):
    for name in ("k", "v"):
      np.testing.assert_allclose(np.swapaxes(np.asarray(rows[name]), 1, 2),
                                 np.asarray(heads[name]), atol=1e-5, rtol=0)
      np.testing.assert_array_equal(np.asarray(scattered[name]), np.asarray(rows[name]))


def test_packed_segments_equal_separate_forwards(hf_checkpoint):
  _, path, _ = hf_checkpoint
  model, _ = hf.load_hf(path)
  lengths = [5, 3, 6]
  seqs = [_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
  pad = 2
  tokens = np.concatenate(seqs + [np.zeros(pad, np.int32)])[None]
  segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])
  positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad)])
  packed = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(positions[None], jnp.int32),
                              jnp.asarray(segments[None], jnp.int32)))
  # Each sequence alone, right-padded to one length (padding cannot affect earlier positions).
  alone_BxL = np.zeros((len(seqs), max(lengths)), np.int32)
  for i, seq in enumerate(seqs):
    alone_BxL[i, :len(seq)] = seq
  alone = np.asarray(forward(model, jnp.asarray(alone_BxL)))
  offset = 0
  for i, seq in enumerate(seqs):
    np.testing.assert_allclose(packed[0, offset:offset + len(seq)], alone[i, :len(seq)],
                               atol=1e-5, rtol=0)
    offset += len(seq)
  assert np.isfinite(packed).all()


@pytest.mark.parametrize("layout", [{"fsdp": 8}, {"fsdp": 2, "tensor": 4}], ids=["fsdp", "tensor"])
@pytest.mark.slow
def test_sharded_forward_matches_single_device(hf_checkpoint, layout):
  arch, path, torch_model = hf_checkpoint
  if arch == "llama" or torch_model.config.tie_word_embeddings:
    pytest.skip("Qwen2 (q/k/v biases) and untied Qwen3 (q/k norm) are enough here")
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  model, _ = hf.load_hf(path)
  tokens = jnp.asarray(_tokens(8, 9, seed=4))
  expected = np.asarray(forward(model, tokens))
  expected_step, _ = extend(model, tokens, jnp.zeros(8, jnp.int32), init_cache(model.cfg, 8, 16))
  mesh = sharding.make_mesh(layout)
  sharded, _ = hf.load_hf(path)
  sharding.shard_model(sharded, mesh)
  assert any(len(p.sharding.device_set) > 1 and not p.sharding.is_fully_replicated
             for p in jax.tree.leaves(nnx.state(sharded, nnx.Param)))
  with sharding.use(mesh):
    # Constraints are read while tracing: fresh jits, so nothing is reused from outside the mesh.
    logits = nnx.jit(lambda m, t: m(t))(sharded, tokens)
    cache = init_cache(sharded.cfg, 8, 16)
    step, _ = nnx.jit(lambda m, t, c: m.extend(t, jnp.zeros(8, jnp.int32), c))(sharded, tokens,
                                                                                cache)
  np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(step), np.asarray(expected_step), atol=1e-5, rtol=0)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["x@w", "x@w.T"])
def test_linear_gradients_equal_autodiff(transpose_w):
  """The hand-written backward of ``linear`` gives autodiff's gradients for both weight layouts."""
  rng = np.random.default_rng(0)
  f32 = lambda a: jnp.asarray(a.astype(np.float32))  # (cast by NumPy: no conversion program)
  x = f32(rng.normal(size=(2, 5, 6)))
  w = f32(rng.normal(size=(4, 6) if transpose_w else (6, 4)))
  g = f32(rng.normal(size=(2, 5, 4)))
  plain = lambda x, w: jnp.sum(g * (x @ (w.T if transpose_w else w)))
  ours = lambda x, w: jnp.sum(g * transformer.linear(x, w, transpose_w))
  np.testing.assert_allclose(jax.jit(ours)(x, w), jax.jit(plain)(x, w), rtol=1e-6)
  for got, want in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w),
                       jax.jit(jax.grad(plain, (0, 1)))(x, w)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_model_gradient_equals_plain_autodiff(monkeypatch):
  """A whole model's parameter gradient with ``linear``'s backward equals plain autodiff's. (The
  fused-projections test's shapes: its models' initialisation programs serve.)"""
  cfg = transformer.ModelConfig(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                                head_dim=8, d_ff=96, qkv_bias=True)
  model = transformer.Transformer(cfg, nnx.Rngs(3))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(_tokens(2, 9))

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(9))

  ours = jax.jit(jax.grad(loss))(params)  # (one program: op by op, each op compiles alone)
  monkeypatch.setattr(transformer, "linear", lambda x, w, transpose_w=False, out_dtype=None: (
      x @ (w.T if transpose_w else w)).astype(out_dtype or x.dtype))
  plain = jax.jit(jax.grad(loss))(params)  # (a fresh trace: the patched ``linear``)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def _prefill_and_step(model, cfg, tokens_2x12):
  """``model``'s logits from a prefill of 9 tokens and from a decode step after it."""
  cache = init_cache(cfg, 2, 16)
  logits, cache = extend(model, tokens_2x12[:, :9], jnp.zeros((2,), jnp.int32), cache)
  step, _ = extend(model, tokens_2x12[:, 9:10], jnp.full((2,), 9, jnp.int32), cache)
  return logits, step


@pytest.mark.parametrize("tied", [True, False])
def test_vocab_major_logits_are_the_same_logits(tied):
  """``vocab_major_logits`` (the head's matmul as weight x activations, a TPU's form) gives the
  same logits as activations x weight, from the full forward, a prefill and a decode step, with a
  tied embedding and with an LM head of its own. (The fused-projections test's llama shapes: the
  tied model's programs serve it.)"""
  import dataclasses

  cfg = transformer.ModelConfig(vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                                head_dim=8, d_ff=96, tie_embeddings=tied)
  model = transformer.Transformer(cfg, nnx.Rngs(0))
  major = nnx.eval_shape(lambda: transformer.Transformer(
      dataclasses.replace(cfg, vocab_major_logits=True), nnx.Rngs(0)))
  nnx.update(major, nnx.state(model, nnx.Param))
  tokens = _tokens(2, 12)
  np.testing.assert_allclose(forward(major, tokens), forward(model, tokens), atol=1e-5)
  for a, b in zip(_prefill_and_step(model, cfg, tokens), _prefill_and_step(major, cfg, tokens)):
    assert a.shape == b.shape and b.dtype == jnp.float32
    np.testing.assert_allclose(b, a, atol=1e-5)


@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen2", {"qkv_bias": True}),
                                        ("qwen3", {"qk_norm": True})])
@pytest.mark.slow
def test_fused_projections_are_the_same_model(arch, extra):
  """``fuse_projections``' layout in a model built with ``fused_projections``: the full forward and
  prefill + decode give the separate model's logits (GQA, q/k/v biases, Qwen3's q/k norms)."""
  import dataclasses

  cfg = transformer.ModelConfig(arch=arch, vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6,
                                n_kv_heads=2, head_dim=8, d_ff=96, **extra)
  model = transformer.Transformer(cfg, nnx.Rngs(0))

  @jax.jit
  def perturb_and_fuse(params):  # (one program, not each op compiled on its own)
    params = jax.tree.map(lambda x: x + 0.1 * jnp.cos(jnp.arange(x.size).reshape(x.shape))
                          if x.ndim == 1 else x, params)
    return params, transformer.fuse_projections(params, cfg)

  params, fused_params = perturb_and_fuse(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  nnx.update(model, params)  # nonzero biases, uneven norm scales
  fused_cfg = dataclasses.replace(cfg, fused_projections=True)
  fused = nnx.eval_shape(lambda: transformer.Transformer(fused_cfg, nnx.Rngs(0)))
  nnx.update(fused, fused_params)
  layer = nnx.to_pure_dict(nnx.state(fused, nnx.Param))["layers"][0]
  assert layer["attn"]["qkv"].shape == (48, (6 + 2 * 2) * 8) and "q" not in layer["attn"]
  assert layer["mlp"]["gate_up"].shape == (48, 2 * 96)
  tokens = _tokens(2, 12)
  np.testing.assert_allclose(forward(fused, tokens), forward(model, tokens), atol=1e-6)
  for a, b in zip(_prefill_and_step(model, cfg, tokens), _prefill_and_step(fused, cfg, tokens)):
    np.testing.assert_allclose(b, a, atol=1e-6)
