"""Hugging Face checkpoint directories (Llama, Qwen2, Qwen3 dense) <-> the NNX ``Transformer``.

``load_hf(path)`` reads ``config.json`` and ``model.safetensors`` (or the shards listed in
``model.safetensors.index.json``); ``save_hf(model, tokenizer, path)`` writes a directory that
``transformers`` (and vLLM) load: config, float32 safetensors (or ``dtype``'s: bfloat16 halves
what a weight version writes for a reader that computes in it) with Hugging Face parameter names
(sharded above a size limit), tokenizer files and ``generation_config.json``. Saving is atomic: the
files go to a temporary directory next to the target, which is renamed into place when complete.

Safetensors files are parsed here (header, then memory-mapped data) so that a truncated or corrupt
file gives an error naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from areal_jax.models.tokenizer import Tokenizer
from areal_jax.models.transformer import ModelConfig, Transformer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
DEFAULT_MAX_SHARD_BYTES = 2 << 30

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded; the message names the file and, when known, the tensor."""


# --- parameter names ------------------------------------------------------------------------------

Path = tuple[Any, ...]  # a path in the model's pure state dict, e.g. ("layers", 0, "attn", "q")


def param_names(cfg: ModelConfig) -> dict[Path, tuple[str, bool]]:
  """Our parameter path -> (Hugging Face name, whether the HF tensor is our kernel transposed)."""
  names: dict[Path, tuple[str, bool]] = {("embed",): ("model.embed_tokens.weight", False)}
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}"
    layer = ("layers", i)
    names[layer + ("attn_norm", "scale")] = (f"{pre}.input_layernorm.weight", False)
    names[layer + ("mlp_norm", "scale")] = (f"{pre}.post_attention_layernorm.weight", False)
    for p in "qkvo":
      names[layer + ("attn", p)] = (f"{pre}.self_attn.{p}_proj.weight", True)
    if cfg.qkv_bias:
      for p in "qkv":
        names[layer + ("attn", f"{p}_bias")] = (f"{pre}.self_attn.{p}_proj.bias", False)
    if cfg.qk_norm:
      for p in "qk":
        names[layer + ("attn", f"{p}_norm", "scale")] = (f"{pre}.self_attn.{p}_norm.weight", False)
    for p in ("gate", "up", "down"):
      names[layer + ("mlp", p)] = (f"{pre}.mlp.{p}_proj.weight", True)
  names[("final_norm", "scale")] = ("model.norm.weight", False)
  if not cfg.tie_embeddings:
    names[("lm_head",)] = ("lm_head.weight", True)
  return names


# --- config ---------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path} not found") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def config_from_hf(hf: Mapping[str, Any], *, source: str = "config.json",
                   dtype: str = "float32") -> ModelConfig:
  """Maps a Hugging Face ``config.json`` dict (Llama, Qwen2 or Qwen3) to a ``ModelConfig``."""
  archs = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type"), "")]
  arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if arch is None:
    raise CheckpointError(f"{source}: unknown architecture {archs} (model_type "
                          f"{hf.get('model_type')!r}); supported: {sorted(ARCHITECTURES)}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise CheckpointError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
  if arch == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise CheckpointError(f"{source}: Llama with attention_bias/mlp_bias is not supported")
  if arch == "qwen3" and hf.get("attention_bias"):
    raise CheckpointError(f"{source}: Qwen3 with attention_bias=True is not supported")
  layer_types = set(hf.get("layer_types") or ()) - {"full_attention"}
  if hf.get("use_sliding_window") or layer_types:
    raise CheckpointError(f"{source}: sliding-window attention is not supported")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", None):
    raise CheckpointError(f"{source}: rope scaling {rope_type!r} is not supported")
  theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
  try:
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return ModelConfig(
        arch=arch, vocab_size=int(hf["vocab_size"]), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads), d_ff=int(hf["intermediate_size"]),
        rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=int(hf.get("max_position_embeddings", 4096)), dtype=dtype,
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=_ids(hf.get("eos_token_id")))
  except KeyError as e:
    raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The ``config.json`` dict of ``cfg`` (float32 weights)."""
  eos = list(cfg.eos_token_ids)
  out = {
      "architectures": [MODEL_TYPES[cfg.arch]], "model_type": cfg.arch,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.d_ff, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": 0.02,
      "attention_dropout": 0.0, "use_cache": True, "dtype": "float32",
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
  }
  if cfg.arch == "llama":
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
  if cfg.arch == "qwen3":
    out.update(attention_bias=False)
  return out


# --- safetensors ----------------------------------------------------------------------------------


class SafetensorsFile:
  """Read-only view of one ``.safetensors`` file; validates the header against the file size."""

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
    except FileNotFoundError:
      raise CheckpointError(f"{path} not found") from None
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
      (n,) = struct.unpack("<Q", raw)
      if n > size - 8:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes "
                              f"but the file has {size})")
      try:
        header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
      raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    self.metadata = header.pop("__metadata__", None) or {}
    self.entries: dict[str, dict] = header
    self._data_start, self._size = 8 + n, size
    self._mmap: np.memmap | None = None

  def keys(self) -> list[str]:
    return list(self.entries)

  def __contains__(self, name: str) -> bool:
    return name in self.entries

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.entries[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """The tensor ``name`` as a NumPy array (a view into the memory-mapped file)."""
    if name not in self.entries:
      raise CheckpointError(f"{self.path}: tensor {name!r} not found")
    entry = self.entries[name]
    where = f"{self.path}: tensor {name!r}"
    try:
      dtype = _ST_DTYPES[entry["dtype"]]
      shape = tuple(int(s) for s in entry["shape"])
      begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
      raise CheckpointError(f"{where}: corrupt header entry {entry!r}") from None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - begin != nbytes or begin < 0:
      raise CheckpointError(f"{where}: header says bytes [{begin}, {end}) but {entry['dtype']} "
                            f"{list(shape)} needs {nbytes}")
    if self._data_start + end > self._size:
      raise CheckpointError(f"{where}: file is truncated (tensor ends at byte "
                            f"{self._data_start + end}, file has {self._size})")
    if self._mmap is None:
      self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    raw = self._mmap[self._data_start + begin:self._data_start + end]
    return raw.view(dtype).reshape(shape)


def write_safetensors_header(f, header: Mapping[str, Any]) -> None:
  """Writes a safetensors header (its length, then the JSON padded so the data is 8-byte aligned);
  the tensors' bytes follow in the order of their ``data_offsets``."""
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  f.write(struct.pack("<Q", len(blob)))
  f.write(blob)


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes ``tensors`` (any dtype of the table above) as one safetensors file."""
  names = {v: k for k, v in _ST_DTYPES.items()}
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  arrays = []
  for name, value in tensors.items():
    arr = np.ascontiguousarray(value)
    header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
    arrays.append(arr)
  with open(path, "wb") as f:
    write_safetensors_header(f, header)
    for arr in arrays:
      f.write(arr.tobytes())
    f.flush()
    os.fsync(f.fileno())


def open_weights(path: str) -> Callable[[str], tuple[str, SafetensorsFile]]:
  """For a checkpoint directory: a lookup ``name -> (file, SafetensorsFile)`` over all shards."""
  index_file = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index_file):
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_file}: no 'weight_map'")
  elif os.path.exists(single):
    weight_map = None
  else:
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
  files: dict[str, SafetensorsFile] = {}

  def get_file(fname: str) -> SafetensorsFile:
    if fname not in files:
      files[fname] = SafetensorsFile(os.path.join(path, fname))
    return files[fname]

  def lookup(name: str) -> tuple[str, SafetensorsFile]:
    if weight_map is None:
      return single, get_file("model.safetensors")
    if name not in weight_map:
      raise CheckpointError(f"{index_file}: tensor {name!r} is missing from the weight_map")
    f = get_file(weight_map[name])
    return f.path, f

  return lookup


# --- model <-> tensors ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _abstract_split(cfg: ModelConfig):
  # Tracing the constructor takes seconds for a 30-layer model: do it once per config.
  return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param, ...)


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, params, rest) of a model whose parameters are shape placeholders (not initialized).

  The states are fresh copies, so callers may fill them in place.
  """
  graphdef, params, rest = _abstract_split(cfg)
  copy = lambda state: jax.tree.map(lambda x: x, state)
  return graphdef, copy(params), copy(rest)


def _get(tree, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path: Path, value):
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def model_from_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray], *,
                       source: str = "checkpoint") -> Transformer:
  """Builds a ``Transformer`` whose parameters come from ``get_tensor(hf_name)`` (HF layout).

  ``get_tensor`` raises ``CheckpointError`` for a missing tensor; shapes are checked here.
  """
  graphdef, params, rest = abstract_model(cfg)
  pure = nnx.to_pure_dict(params)
  for path, (name, transpose) in param_names(cfg).items():
    want = tuple(_get(pure, path).shape)
    value = get_tensor(name)
    got = tuple(value.shape[::-1] if transpose else value.shape)
    if got != want:
      hf_want = list(want[::-1] if transpose else want)
      raise CheckpointError(f"{source}: tensor {name!r} has shape {list(value.shape)}, "
                            f"expected {hf_want} for this config")
    arr = np.array(value, dtype=np.float32)  # a copy: never alias the memory-mapped file
    _set(pure, path, jax.numpy.asarray(arr.T if transpose else arr))
  nnx.replace_by_pure_dict(params, pure)
  return nnx.merge(graphdef, params, rest)


SAVE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
               "float16": np.dtype(np.float16)}


def _save_dtype(dtype: str) -> np.dtype:
  """The NumPy dtype of ``SAVE_DTYPES``'s name ``dtype``; a ValueError naming it otherwise."""
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {list(SAVE_DTYPES)}")
  return SAVE_DTYPES[dtype]


def model_tensors(model: Transformer, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host array in HF layout, of ``dtype``: ``SAVE_DTYPES``) for every parameter; gathers
  sharded arrays (cast where they are, so only ``dtype``'s bytes come to the host)."""
  np_dtype = _save_dtype(dtype)
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for path, (name, transpose) in param_names(model.cfg).items():
    value = _get(pure, path)
    if value.dtype != np_dtype:  # (only then an operation where the array is held)
      value = value.astype(np_dtype)
    arr = np.asarray(jax.device_get(value), dtype=np_dtype)
    yield name, np.ascontiguousarray(arr.T if transpose else arr)


# --- directories ----------------------------------------------------------------------------------


def load_hf_config(path: str, dtype: str = "float32") -> ModelConfig:
  config_file = os.path.join(path, "config.json")
  cfg = config_from_hf(_read_json(config_file), source=config_file, dtype=dtype)
  gen_file = os.path.join(path, "generation_config.json")
  if os.path.exists(gen_file):
    gen = _read_json(gen_file)
    eos = _ids(gen.get("eos_token_id")) or cfg.eos_token_ids
    bos = gen.get("bos_token_id", cfg.bos_token_id)
    cfg = dataclasses.replace(cfg, eos_token_ids=eos, bos_token_id=bos)
  return cfg


def load_hf(path: str | os.PathLike, *, dtype: str = "float32",
            seed: int = 0) -> tuple[Transformer, Tokenizer | None]:
  """Loads a Hugging Face Llama / Qwen2 / Qwen3 directory; the tokenizer is None without tokenizer.json.

  ``seed`` is unused (every parameter comes from the files).
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a directory")
  cfg = load_hf_config(path, dtype)
  lookup = open_weights(path)

  def get_tensor(name: str) -> np.ndarray:
    fname, f = lookup(name)
    if name not in f:
      raise CheckpointError(f"{fname}: tensor {name!r} not found")
    return f.get(name)

  model = model_from_tensors(cfg, get_tensor, source=path)
  tokenizer = None
  if os.path.exists(os.path.join(path, "tokenizer.json")):
    tokenizer = Tokenizer.from_dir(path)
  return model, tokenizer


def _shards(tensors: list[tuple[str, np.ndarray]], max_bytes: int) -> list[list[tuple[str, Any]]]:
  groups: list[list] = [[]]
  size = 0
  for item in tensors:
    if groups[-1] and size + item[1].nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(item)
    size += item[1].nbytes
  return groups


def save_hf(model: Transformer, tokenizer: Tokenizer | None, path: str | os.PathLike, *,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: str = "float32") -> str:
  """Writes ``model`` (and ``tokenizer``) as a Hugging Face directory at ``path``, atomically.

  Tensors are ``dtype`` (``SAVE_DTYPES``; the config's ``dtype`` says it) with Hugging Face
  names; above ``max_shard_bytes`` they are split into ``model-0000i-of-0000n.safetensors`` with
  ``model.safetensors.index.json``. An existing ``path`` is replaced only once the new directory
  is complete. Returns ``path``.
  """
  _save_dtype(dtype)  # (checked before anything is written)
  return write_dir_atomically(
      path, lambda tmp: _write_dir(model, tokenizer, tmp, max_shard_bytes, dtype))


def write_dir_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> str:
  """Calls ``write(tmp)`` on a fresh temporary directory next to ``path``, then renames it to
  ``path`` (an existing ``path`` is replaced only then); on failure nothing is left. Returns
  ``path`` (absolute)."""
  path = os.path.abspath(os.fspath(path))
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
  os.mkdir(tmp)  # the umask's mode, as the directory will have (mkdtemp's is private to its user)
  try:
    write(tmp)
    if os.path.exists(path):
      old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
      os.rename(path, os.path.join(old, name))
      os.rename(tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path


def write_configs(cfg: ModelConfig, tokenizer: Tokenizer | None, out: str, dtype: str) -> None:
  """Writes the tokenizer files, ``config.json`` (weights of ``dtype``) and
  ``generation_config.json`` of ``cfg`` into the directory ``out``."""
  if tokenizer is not None:
    tokenizer.save(out)
    if tokenizer.eos_token_ids and not cfg.eos_token_ids:
      cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_token_ids))
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(dict(config_to_hf(cfg), dtype=dtype), f, indent=2)
  gen = {"bos_token_id": cfg.bos_token_id,
         "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1
         else cfg.eos_token_ids[0]}
  if tokenizer is not None:
    gen = {**tokenizer.generation_config(), **{k: v for k, v in gen.items() if v not in (None, [])}}
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(gen, f, indent=2)


def _write_dir(model: Transformer, tokenizer: Tokenizer | None, out: str, max_bytes: int,
               dtype: str) -> None:
  write_configs(model.cfg, tokenizer, out, dtype)
  groups = _shards(list(model_tensors(model, dtype)), max_bytes)
  if len(groups) == 1:
    write_safetensors(os.path.join(out, "model.safetensors"), dict(groups[0]))
    return
  weight_map, total = {}, 0
  for i, group in enumerate(groups):
    fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    write_safetensors(os.path.join(out, fname), dict(group))
    for tensor_name, arr in group:
      weight_map[tensor_name] = fname
      total += arr.nbytes
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
