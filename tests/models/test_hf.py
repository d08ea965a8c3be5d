"""Hugging Face checkpoints: save/load round trips, sharded files and parameters, bad input."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import models, sharding
from areal_jax.models import hf

TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 259, (2, 11)), jnp.int32)


@nnx.jit
def forward(model, tokens_BxL):
  return model(tokens_BxL)


def _params(model):
  return {k: np.asarray(v) for k, v in hf.model_tensors(model)}


@pytest.fixture(scope="module")
def tiny():
  return models.load("tiny", seed=3)


def test_save_then_load_is_bit_exact(tiny, tmp_path):
  model, tok = tiny
  out = models.save_hf(model, tok, tmp_path / "ckpt")
  assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  loaded, tok2 = models.load(str(out))
  assert loaded.cfg == model.cfg
  assert tok2.eos_token_ids == tok.eos_token_ids and tok2.vocab_size == tok.vocab_size
  for name, value in _params(model).items():
    np.testing.assert_array_equal(_params(loaded)[name], value, err_msg=name)
  np.testing.assert_array_equal(np.asarray(forward(loaded, TOKENS)),
                                np.asarray(forward(model, TOKENS)))


def test_sharded_files_round_trip(hf_checkpoint, tmp_path):
  arch, path, _ = hf_checkpoint
  model, _ = hf.load_hf(path)
  out = models.save_hf(model, models.byte_tokenizer(), tmp_path / "sharded", max_shard_bytes=40_000)
  index = json.loads((out_path := tmp_path / "sharded" / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and all(os.path.exists(out_path.parent / f) for f in files)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in _params(model).values())
  loaded, _ = hf.load_hf(out)
  assert loaded.cfg == model.cfg and loaded.cfg.arch == arch
  for name, value in _params(model).items():
    np.testing.assert_array_equal(_params(loaded)[name], value, err_msg=name)
  tokens = TOKENS % 300
  np.testing.assert_array_equal(np.asarray(forward(loaded, tokens)),
                                np.asarray(forward(model, tokens)))


def test_transformers_reads_our_checkpoint(hf_checkpoint, tmp_path, torch_logits):
  import transformers
  _, path, _ = hf_checkpoint
  model, _ = hf.load_hf(path)
  out = models.save_hf(model, models.byte_tokenizer(), tmp_path / "for_hf", max_shard_bytes=60_000)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.asarray(TOKENS) % 300
  np.testing.assert_allclose(torch_logits(reloaded, tokens), np.asarray(forward(model, tokens)),
                             atol=1e-4, rtol=0)


def test_bfloat16_checkpoint_loads_as_float32(hf_checkpoint, tmp_path):
  import torch
  arch, _, torch_model = hf_checkpoint
  if arch != "llama":
    pytest.skip("one architecture is enough here")
  torch_model = type(torch_model)(torch_model.config)
  torch_model.to(torch.bfloat16).save_pretrained(tmp_path)
  model, _ = hf.load_hf(tmp_path)
  expected = torch_model.model.layers[0].self_attn.q_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(model.layers[0].attn.q[...]), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_saved_in_a_16_bit_dtype_the_values_are_rounded_once_and_the_bytes_halved(tiny, tmp_path,
                                                                                  dtype):
  """``save_hf(dtype=...)`` (what the vLLM backend writes on a GPU): every tensor in that dtype,
  said in the config, each value the float32 one rounded to it; cast where a mesh holds it."""
  model, tok = tiny
  full = models.save_hf(model, tok, tmp_path / "f32")
  sharded, _ = models.load(full)
  sharding.shard_model(sharded, sharding.make_mesh({"fsdp": 2, "tensor": 4}))
  out = models.save_hf(sharded, tok, tmp_path / dtype, dtype=dtype)
  header_len = int.from_bytes((tmp_path / dtype / "model.safetensors").read_bytes()[:8], "little")
  header = json.loads((tmp_path / dtype / "model.safetensors").read_bytes()[8:8 + header_len])
  assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {
      {"bfloat16": "BF16", "float16": "F16"}[dtype]}
  assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == dtype
  sizes = [os.path.getsize(d / "model.safetensors") for d in (tmp_path / "f32", tmp_path / dtype)]
  assert sizes[1] < 0.51 * sizes[0]
  loaded, _ = models.load(out)
  for name, value in _params(model).items():
    np.testing.assert_array_equal(
        _params(loaded)[name], value.astype(hf.SAVE_DTYPES[dtype]).astype(np.float32),
        err_msg=name)
  with pytest.raises(ValueError, match="dtype='int8'"):
    models.save_hf(model, tok, tmp_path / "int8", dtype="int8")
  assert not (tmp_path / "int8").exists()


def test_sharded_parameters_are_gathered_on_save(tiny, tmp_path):
  model, tok = tiny
  reference = models.save_hf(model, tok, tmp_path / "plain")
  sharded, _ = models.load(reference)
  sharding.shard_model(sharded, sharding.make_mesh({"fsdp": 2, "tensor": 4}))
  assert not sharded.layers[0].mlp.gate[...].sharding.is_fully_replicated
  out = models.save_hf(sharded, tok, tmp_path / "from_sharded")
  a = (tmp_path / "plain" / "model.safetensors").read_bytes()
  assert (tmp_path / "from_sharded" / "model.safetensors").read_bytes() == a
  assert out.endswith("from_sharded")


def test_save_replaces_existing_directory_atomically(tiny, tmp_path, monkeypatch):
  model, tok = tiny
  target = tmp_path / "ckpt"
  models.save_hf(model, tok, target)
  (target / "stale.txt").write_text("old")
  models.save_hf(model, tok, target)
  assert not (target / "stale.txt").exists()
  (target / "stale.txt").write_text("old")

  def fail(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(hf, "write_safetensors", fail)
  with pytest.raises(OSError, match="disk full"):
    models.save_hf(model, tok, target)
  assert (target / "stale.txt").read_text() == "old"  # the old checkpoint is untouched
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary leftovers


# --- bad input ----------------------------------------------------------------------------------


@pytest.fixture()
def saved(tiny, tmp_path):
  model, tok = tiny
  return models.save_hf(model, tok, tmp_path / "ckpt")


def _rewrite(path, fn):
  f = hf.SafetensorsFile(os.path.join(path, "model.safetensors"))
  tensors = fn({k: np.array(f.get(k)) for k in f.keys()})
  del f
  hf.write_safetensors(os.path.join(path, "model.safetensors"), tensors)


def test_missing_tensor_names_file_and_tensor(saved):
  name = "model.layers.1.mlp.up_proj.weight"
  _rewrite(saved, lambda t: {k: v for k, v in t.items() if k != name})
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj"):
    models.load(saved)


def test_wrong_shape_names_tensor(saved):
  name = "model.layers.0.self_attn.k_proj.weight"
  _rewrite(saved, lambda t: {**t, name: t[name][:-1]})
  with pytest.raises(hf.CheckpointError, match=r"k_proj\.weight.*shape \[31, 64\].*\[32, 64\]"):
    models.load(saved)


def test_unknown_architecture_names_config(saved):
  config_file = os.path.join(saved, "config.json")
  config = json.load(open(config_file))
  config["architectures"], config["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
  json.dump(config, open(config_file, "w"))
  with pytest.raises(hf.CheckpointError, match=r"config\.json.*unknown architecture.*GPTNeoX"):
    models.load(saved)


def test_truncated_file_names_file_and_tensor(saved):
  path = os.path.join(saved, "model.safetensors")
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(size - 1000)
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors: tensor '[^']+'.*truncated"):
    models.load(saved)
  with open(path, "r+b") as f:
    f.truncate(20)
  with pytest.raises(hf.CheckpointError, match=r"model\.safetensors: truncated or corrupt"):
    models.load(saved)


def test_tensor_missing_from_shard_index(tiny, tmp_path):
  model, tok = tiny
  out = models.save_hf(model, tok, tmp_path / "ckpt", max_shard_bytes=20_000)
  index_file = os.path.join(out, "model.safetensors.index.json")
  index = json.load(open(index_file))
  del index["weight_map"]["model.norm.weight"]
  json.dump(index, open(index_file, "w"))
  with pytest.raises(hf.CheckpointError, match=r"index\.json.*model\.norm\.weight"):
    models.load(out)


def test_config_mapping_reads_rope_parameters_and_defaults():
  cfg = hf.config_from_hf({
      "architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 32,
      "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "eos_token_id": [3, 4]})
  assert (cfg.arch, cfg.qkv_bias, cfg.n_kv_heads, cfg.head_dim) == ("qwen2", True, 4, 8)
  assert cfg.rope_theta == 1e6 and cfg.eos_token_ids == (3, 4) and not cfg.tie_embeddings
  qwen3 = hf.config_from_hf({
      "architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 32,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 8, "tie_word_embeddings": True})
  assert (qwen3.arch, qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == ("qwen3", False, True, 16)
  with pytest.raises(hf.CheckpointError, match=r"config\.json.*Qwen3 with attention_bias"):
    hf.config_from_hf({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True})
  with pytest.raises(hf.CheckpointError, match="rope scaling 'llama3'"):
    hf.config_from_hf({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "llama3"}})


def test_a_model_source_that_is_not_there_says_what_is_expected(tmp_path):
  with pytest.raises(models.CheckpointError, match="no such directory") as e:
    models.load("Qwen2.5-1.5B-Instruct")
  assert "huggingface-cli download" in str(e.value) and "'smollm2'" in str(e.value)
  with pytest.raises(models.CheckpointError, match="no such directory"):
    models.load(str(tmp_path / "missing"))
  assert issubclass(models.CheckpointError, ValueError)  # (callers that caught ValueError still do)
