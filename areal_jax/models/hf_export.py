"""Writes a Hugging Face directory one tensor at a time, from weights that are not a model in memory.

``save_hf`` (hf.py) writes a ``Transformer`` held whole. Here the weights come from a reader,
``read(path) -> array`` of our parameter path (e.g. ``("layers", 0, "attn", "q")``), called once per
tensor while it is written: the shards are planned from the shapes alone (each file's header
is written first, then its tensors one after the other), so the host holds one tensor (and its
cast and transposed copies) at a time, never the model. :func:`describe` gives a model source's
config and tokenizer without reading its weights.

Knows nothing of where the reader's arrays come from (a run checkpoint: ``areal_jax.export``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from areal_jax.models.hf import (SAVE_DTYPES, CheckpointError, Path, _ST_DTYPES, _get, _save_dtype,
                                 abstract_model, load_hf_config, param_names, write_configs,
                                 write_dir_atomically, write_safetensors_header)
from areal_jax.models.tokenizer import Tokenizer, byte_tokenizer
from areal_jax.models.transformer import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")


@dataclasses.dataclass(frozen=True)
class TensorPlan:
  """One tensor of the directory: its Hugging Face name and shape, and where it comes from."""

  name: str
  shape: tuple[int, ...]  # Hugging Face layout
  path: Path  # our parameter path
  transpose: bool  # the Hugging Face tensor is our array transposed


def tensor_plans(cfg: ModelConfig) -> list[TensorPlan]:
  """Every parameter of a model of ``cfg``, in ``save_hf``'s order."""
  _, params, _ = abstract_model(cfg)
  pure = nnx.to_pure_dict(params)
  plans = []
  for path, (name, transpose) in param_names(cfg).items():
    shape = tuple(int(s) for s in _get(pure, path).shape)
    plans.append(TensorPlan(name, shape[::-1] if transpose else shape, path, transpose))
  return plans


def plan_shards(plans: list[TensorPlan], itemsize: int, max_bytes: int) -> list[list[TensorPlan]]:
  """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
  groups: list[list[TensorPlan]] = [[]]
  size = 0
  for plan in plans:
    nbytes = int(np.prod(plan.shape, dtype=np.int64)) * itemsize
    if groups[-1] and size + nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(plan)
    size += nbytes
  return groups


def _write_shard(path: str, plans: list[TensorPlan], read: Callable[[Path], Any],
                 dtype: np.dtype) -> int:
  """Writes one safetensors file: the header from the shapes, then each tensor as it is read.
  Returns the bytes of tensor data."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  st_name = {v: k for k, v in _ST_DTYPES.items()}[dtype]
  for plan in plans:
    nbytes = int(np.prod(plan.shape, dtype=np.int64)) * dtype.itemsize
    header[plan.name] = {"dtype": st_name, "shape": list(plan.shape),
                         "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  with open(path, "wb") as f:
    write_safetensors_header(f, header)
    for plan in plans:
      value = np.asarray(read(plan.path))
      want = plan.shape[::-1] if plan.transpose else plan.shape
      if tuple(value.shape) != want:
        raise CheckpointError(f"tensor {plan.name!r}: read shape {list(value.shape)}, expected "
                              f"{list(want)}")
      if value.dtype != dtype:
        value = value.astype(dtype)
      arr = np.ascontiguousarray(value.T if plan.transpose else value)
      del value
      f.write(memoryview(arr.reshape(-1).view(np.uint8)))
      del arr
    f.flush()
    os.fsync(f.fileno())
  return offset


def save_hf_streamed(cfg: ModelConfig, tokenizer: Tokenizer | None, read: Callable[[Path], Any],
                     path: str | os.PathLike, *, dtype: str = "float32",
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
  """Writes the Hugging Face directory of a model of ``cfg`` whose parameter at our ``path`` is
  ``read(path)`` (any float dtype; cast to ``dtype``), atomically, like ``save_hf``: the same
  files, shards of at most ``max_shard_bytes`` (a larger tensor alone) with
  ``model.safetensors.index.json`` when there are several. Returns ``path`` (absolute)."""
  np_dtype = _save_dtype(dtype)
  plans = tensor_plans(cfg)
  groups = plan_shards(plans, np_dtype.itemsize, max_shard_bytes)

  def write(out: str) -> None:
    write_configs(cfg, tokenizer, out, dtype)
    if len(groups) == 1:
      _write_shard(os.path.join(out, "model.safetensors"), groups[0], read, np_dtype)
      return
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
      fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
      total += _write_shard(os.path.join(out, fname), group, read, np_dtype)
      weight_map.update({plan.name: fname for plan in group})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

  return write_dir_atomically(path, write)


def describe(source: str, dtype: str = "float32") -> tuple[ModelConfig, Tokenizer]:
  """The config and tokenizer of model source ``source`` (as ``models.load`` takes it), without
  reading its weights."""
  source = os.fspath(source)
  if source in ("tiny", "small"):
    from areal_jax.models import small_config, tiny_config  # pylint: disable=import-outside-toplevel
    tokenizer = byte_tokenizer()
    return (tiny_config if source == "tiny" else small_config)(tokenizer, dtype), tokenizer
  if source == "smollm2" or source.startswith("gguf:"):
    from areal_jax.models import gguf  # pylint: disable=import-outside-toplevel
    f = gguf.GGUFFile(gguf.smollm2_path() if source == "smollm2" else source[len("gguf:"):])
    tokenizer, cfg = gguf.tokenizer_from_gguf(f), gguf.config_from_gguf(f, dtype)
    if tokenizer.eos_token_ids:
      cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_token_ids))
    return cfg, tokenizer
  if os.path.isdir(source):
    if not os.path.exists(os.path.join(source, "tokenizer.json")):
      raise CheckpointError(f"{source}: no tokenizer.json next to the weights")
    return load_hf_config(source, dtype), Tokenizer.from_dir(source)
  raise CheckpointError(f"model source {source!r}: no such directory (expected a Hugging Face "
                        "model directory, 'gguf:<path>', 'smollm2', 'tiny' or 'small')")


def source_dtype(source: str) -> str:
  """The dtype the weights of ``source`` are stored in, when it is one of ``SAVE_DTYPES``: a
  Hugging Face directory's ``config.json`` says it (``torch_dtype`` or ``dtype``); float32
  otherwise (the random presets; GGUF files are dequantized to float32)."""
  config_file = os.path.join(os.fspath(source), "config.json")
  if os.path.isfile(config_file):
    with open(config_file, encoding="utf-8") as f:
      hf = json.load(f)
    for key in ("dtype", "torch_dtype"):
      if hf.get(key) in SAVE_DTYPES:
        return hf[key]
  return "float32"
