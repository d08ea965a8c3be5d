"""LoRA adapters: merge arithmetic, side path vs merged forward, PEFT export/import and parity."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import models
from areal_jax.models import hf, lora, transformer

VOCAB = 300


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _random_adapters(params, lcfg, seed=0):
  """Adapters with nonzero ``b`` (fresh ones are the identity)."""
  ad = lora.init_adapters(params, lcfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(ad)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@nnx.jit
def forward(model, tokens_BxL):
  return model(tokens_BxL)


def test_merge_is_base_plus_scaled_product():
  model = transformer.Transformer(transformer.ModelConfig(vocab_size=64), nnx.Rngs(0))
  params = _params(model)
  lcfg = lora.LoraConfig(rank=4, alpha=6.0, targets=("q_proj", "down_proj"))
  ad = _random_adapters(params, lcfg)
  merged = jax.jit(lambda p, a: lora.merge(p, a, lcfg))(params, ad)
  for i in params["layers"]:
    for mod, name in (("attn", "q"), ("mlp", "down")):
      w = np.asarray(params["layers"][i][mod][name], np.float64)
      a, b = (np.asarray(ad["layers"][i][mod][name][k], np.float64) for k in "ab")
      want = np.float32(w + 1.5 * a @ b)
      np.testing.assert_allclose(merged["layers"][i][mod][name], want, rtol=0, atol=2e-7)
    for mod, name in (("attn", "k"), ("attn", "v"), ("attn", "o"), ("mlp", "gate"), ("mlp", "up")):
      np.testing.assert_array_equal(merged["layers"][i][mod][name], params["layers"][i][mod][name])
  np.testing.assert_array_equal(merged["embed"], params["embed"])


def test_abstract_adapters_and_the_frozen_base_of_a_model():
  """What a rollout worker builds on its own: restore targets shaped like the learner's adapters,
  and its model's base frozen in the learner's dtype."""
  model = transformer.Transformer(transformer.ModelConfig(vocab_size=64), nnx.Rngs(0))
  lcfg = lora.LoraConfig(rank=2, targets=("k_proj", "up_proj"))
  real = lora.init_adapters(_params(model), lcfg, jax.random.key(3))
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shapes = lora.abstract_adapters(_params(model), lcfg, sh)
  assert jax.tree.structure(shapes) == jax.tree.structure(real)
  for x, y in zip(jax.tree.leaves(shapes), jax.tree.leaves(real)):
    assert isinstance(x, jax.ShapeDtypeStruct) and x.sharding == sh
    assert (x.shape, x.dtype) == (y.shape, y.dtype)
  want = lora.frozen_base(_params(model), "bfloat16")
  lora.freeze_model_base(model, "bfloat16")
  for x, y in zip(jax.tree.leaves(_params(model)), jax.tree.leaves(want)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)
  assert model.layers[0].attn.q[...].dtype == jnp.bfloat16


def test_side_path_equals_merged_forward_and_fresh_adapters_change_nothing():
  model = transformer.Transformer(transformer.ModelConfig(vocab_size=64, qk_norm=True,
                                                          arch="qwen3"), nnx.Rngs(1))
  graphdef, params = nnx.graphdef(model), _params(model)
  lcfg = lora.LoraConfig(rank=4, alpha=8.0)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 9)), jnp.int32)
  run = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))
  fresh = lora.init_adapters(params, lcfg, jax.random.key(0))
  np.testing.assert_array_equal(run(lora.wrap(params, fresh, lcfg)), run(params))
  ad = _random_adapters(params, lcfg)
  side, merged = run(lora.wrap(params, ad, lcfg)), run(lora.merge(params, ad, lcfg))
  assert np.abs(np.asarray(merged) - np.asarray(run(params))).max() > 1e-2  # adapters matter
  np.testing.assert_allclose(side, merged, atol=1e-5, rtol=0)
  # dropout: only the adapters' input is dropped, so with b = 0 nothing changes
  drop = lora.LoraConfig(rank=4, alpha=8.0, dropout=0.5)
  np.testing.assert_array_equal(run(lora.wrap(params, fresh, drop, jax.random.key(3))), run(params))
  assert not np.allclose(run(lora.wrap(params, ad, drop, jax.random.key(3))), side, atol=1e-3)


@pytest.mark.slow
def test_peft_loads_our_adapters_with_the_same_logits(hf_checkpoint, torch_logits, tmp_path):
  peft = pytest.importorskip("peft")
  arch, path, torch_model = hf_checkpoint
  if arch == "llama":
    pytest.skip("Qwen2 and Qwen3 cover the attention variants")
  model, _ = hf.load_hf(path)
  lcfg = lora.LoraConfig(rank=4, alpha=12.0, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"))
  ad = _random_adapters(_params(model), lcfg, seed=2)
  out = lora.save_peft(ad, lcfg, tmp_path / "adapter", base_model=str(path))
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  assert json.load(open(os.path.join(out, "adapter_config.json")))["r"] == 4

  base = type(torch_model)(torch_model.config)
  base.load_state_dict(torch_model.state_dict())
  peft_model = peft.PeftModel.from_pretrained(base.eval(), out).eval()
  tokens = np.random.RandomState(5).randint(0, VOCAB, (2, 13)).astype(np.int32)
  ours = np.asarray(forward(lora.merged_model(model, ad, lcfg), jnp.asarray(tokens)))
  theirs = torch_logits(peft_model, tokens)
  assert np.abs(theirs - torch_logits(torch_model, tokens)).max() > 1e-2  # adapters are applied
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

  # the merged export is a plain checkpoint: transformers reads it, with PEFT's merged logits
  import transformers
  merged_dir = models.save_hf(lora.merged_model(model, ad, lcfg), models.byte_tokenizer(),
                              tmp_path / "merged")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
  np.testing.assert_allclose(torch_logits(reloaded, tokens), theirs, atol=1e-4, rtol=0)

  # and our reader gets the adapters back bit for bit
  back, lcfg2 = lora.load_peft(out, _params(model))
  assert lcfg2 == dataclasses.replace(lcfg, targets=tuple(sorted(lcfg.targets)))
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(ad)):
    np.testing.assert_array_equal(x, y)


def test_bad_config_and_adapter_dirs_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match=r"actor\.lora\.targets.*unknown \['qkv_proj'\]"):
    lora.LoraConfig(targets=("q_proj", "qkv_proj"))
  with pytest.raises(ValueError, match=r"actor\.lora\.dropout=1\.0"):
    lora.LoraConfig(dropout=1.0)
  assert lora.LoraConfig.from_config({"rank": 0, "alpha": 1, "dropout": 0, "targets": ()}) is None
  model = transformer.Transformer(transformer.ModelConfig(vocab_size=64), nnx.Rngs(0))
  with pytest.raises(hf.CheckpointError, match=r"adapter_config\.json not found"):
    lora.load_peft(tmp_path, _params(model))
  lcfg = lora.LoraConfig(rank=2, alpha=2.0, targets=("v_proj",))
  out = lora.save_peft(lora.init_adapters(_params(model), lcfg, jax.random.key(0)), lcfg,
                       tmp_path / "a")
  other = transformer.Transformer(transformer.ModelConfig(vocab_size=64, d_model=32), nnx.Rngs(0))
  with pytest.raises(hf.CheckpointError, match=r"v_proj adapters fit a \[64, 32\].*\[32, 32\]"):
    lora.load_peft(out, _params(other))
