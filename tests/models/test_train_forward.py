"""The training forward: rematerialised and scanned layers compute what the model's forward does."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import train_forward, transformer

VOCAB = 300


def _tokens(b, l, seed=0):
  return np.random.RandomState(seed).randint(0, VOCAB, (b, l)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _logits(graphdef, params, tokens, positions, segments, attention):
  """The model's own forward: one program per attention form, which the flash tests' equal models
  share (not each op compiled on its own)."""
  return nnx.merge(graphdef, params)(tokens, positions, segments, attention=attention)


@pytest.fixture(scope="module")
def forward_and_loss():
  """(model, its parameters, ``value_and_grad(params, remat, scan)`` of a loss over the logits
  (``remat=None``: through ``model(...)``), the model forward's value and gradients), computed
  once for the tests below. Compiled by XLA:CPU's default fusion emitters, not the tests' faster
  ones (tests/conftest.py): those sum one embedding gradient's terms in another order, 2.3e-4
  apart (relative), past the 1e-4 the comparison allows."""
  cfg = transformer.ModelConfig(vocab_size=VOCAB, n_layers=3, qkv_bias=True, tie_embeddings=False)
  model = transformer.Transformer(cfg, nnx.Rngs(5))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(_tokens(2, 12))
  segments = jnp.asarray([[1] * 7 + [2] * 5] * 2, jnp.int32)
  positions = jnp.asarray([list(range(7)) + list(range(5))] * 2, jnp.int32)
  weights = jax.random.normal(jax.random.key(0), (2, 12, VOCAB))

  def loss(p, remat, scan):
    m = nnx.merge(graphdef, p)
    if remat is not None:
      w, transpose_w = train_forward.head_weight(m)
      h = train_forward.hidden(m, tokens, positions, segments, remat=remat, scan=scan)
      logits = transformer.linear(h, w, transpose_w, jnp.float32)
    else:
      logits = m(tokens, positions, segments)
    return jnp.sum(jnp.tanh(logits) * weights)

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2),
                           compiler_options={"xla_cpu_use_fusion_emitters": True})
  return model, params, value_and_grad, value_and_grad(params, None, None)


@pytest.mark.parametrize("remat,scan", [("none", True), ("full", True), ("dots", False),
                                        ("offload", True)])
@pytest.mark.slow
def test_hidden_with_remat_and_scan_equals_the_forward(forward_and_loss, remat, scan):
  """``hidden`` + the LM head is ``model(...)``, values and parameter gradients, whatever the
  rematerialisation policy and whether the layers run under a scan; the parameters stay a list
  of Blocks. (The model forward's side is computed once, by the module's fixture.)"""
  model, params, value_and_grad, want = forward_and_loss
  got = value_and_grad(params, remat, scan)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  assert isinstance(model.layers, nnx.List) and len(model.layers) == 3
  with pytest.raises(ValueError, match="remat='some'"):
    train_forward.remat_policy("some")


@pytest.mark.parametrize("impl,scan", [("pallas_gpu", False), ("pallas_gpu", True),
                                       ("pallas_tpu", False)])
@pytest.mark.slow
def test_flash_attention_trains_what_the_dense_attention_trains(impl, scan):
  """``attention``: the flash kernels (Pallas interpret mode on CPU) over packed rows give the
  dense form's loss and parameter gradients (the loss over real tokens: padding's outputs differ
  and are never trained on), with the layers unrolled or under the scan, rematerialised (not the
  TPU kernel's interpret mode, whose callbacks remat refuses); and the model's own forward takes
  the same choice."""
  cfg = transformer.ModelConfig(vocab_size=VOCAB, n_layers=2, n_heads=4, n_kv_heads=2,
                                head_dim=16, d_model=64, d_ff=128)
  model = transformer.Transformer(cfg, nnx.Rngs(3))
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(_tokens(2, 20, seed=1))
  segments = jnp.asarray([[1] * 9 + [2] * 8 + [0] * 3, [1] * 16 + [0] * 4], jnp.int32)
  positions = jnp.asarray([list(range(9)) + list(range(8)) + [0] * 3,
                           list(range(16)) + [0] * 4], jnp.int32)
  weights = jax.random.normal(jax.random.key(1), (2, 20, cfg.d_model)) * (segments > 0)[..., None]

  def loss(p, attention):
    m = nnx.merge(graphdef, p)
    h = train_forward.hidden(m, tokens, positions, segments, scan=scan, attention=attention,
                             remat="none" if impl == "pallas_tpu" else "full")
    return jnp.sum(jnp.tanh(h) * weights)

  want, got = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, a)
               for a in ("dense", impl))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
    # float32 sums in another order: 1e-6 of it, measured (NumPy's max: no program per shape)
    scale = float(np.max(np.abs(np.asarray(b))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale,
                               err_msg=jax.tree_util.keystr(path))
  real = np.asarray(segments > 0)
  logits = [np.asarray(_logits(graphdef, params, tokens, positions, segments, a))[real]
            for a in ("dense", impl)]
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-4)


def test_scanned_program_does_not_grow_with_depth():
  """Under the scan the lowered train forward holds one layer: an added layer only adds its
  parameters to the stack (a few lines), unrolled it adds a whole layer's forward and backward."""

  def size(n_layers, scan):
    cfg = transformer.ModelConfig(vocab_size=VOCAB, n_layers=n_layers)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: transformer.Transformer(cfg, nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    loss = lambda p, t: jnp.sum(train_forward.hidden(nnx.merge(graphdef, p), t, remat="full",
                                                     scan=scan))
    return len(jax.jit(jax.grad(loss)).lower(params, tokens).as_text())

  per_layer_scanned = (size(8, True) - size(2, True)) / 6
  per_layer_unrolled = (size(8, False) - size(2, False)) / 6
  assert per_layer_scanned < per_layer_unrolled / 5, (per_layer_scanned, per_layer_unrolled)
