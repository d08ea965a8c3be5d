"""Policy weights for vLLM: versioned Hugging Face safetensors directories.

``WeightDirs.write_adapters(adapters, lcfg, version)`` writes LoRA adapters as a PEFT directory
``<root>/v<version>`` instead (``adapter_config.json`` marks it), for vLLM's LoRA support.
``WeightDirs.write(params, version)`` puts the parameters into the model's structure and writes
``<root>/v<version>`` with ``areal_jax.models.save_hf`` (atomic: a directory appears only once
complete; sharded arrays are gathered from whatever mesh holds them) in ``dtype``, vLLM's compute
dtype (on a GPU bfloat16: half the float32 bytes, which vLLM would cast to anyway). vLLM then
reloads from that path. Old versions are pruned, keeping the newest ``keep`` plus any directory
still marked in use.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import Any

from flax import nnx

from areal_jax.models import lora as lora_lib
from areal_jax.models import save_hf

_VERSION_DIR = re.compile(r"^v(\d+)$")


def as_model(template: nnx.Module, params: Any) -> nnx.Module:
  """``template`` with its parameters replaced by ``params``.

  ``params`` is a model, an ``nnx.State`` of its ``nnx.Param`` variables or the NNX pure dict of
  them (what the runtime hands the engines). The template is not modified.
  """
  if isinstance(params, nnx.Module):
    return params
  graphdef, state, rest = nnx.split(template, nnx.Param, ...)
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  if not isinstance(params, dict):
    raise TypeError("params must be an nnx.Module, an nnx.State or an NNX pure dict, got "
                    f"{type(params).__name__}")
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state, rest)


class WeightDirs:
  """Writes versioned Hugging Face directories under ``root`` for vLLM to load."""

  def __init__(self, template: nnx.Module, tokenizer, root: str, keep: int = 2,
               dtype: str = "float32"):
    if keep < 1:
      raise ValueError(f"keep={keep} must be >= 1")
    self.template, self.tokenizer, self.keep, self.dtype = template, tokenizer, keep, dtype
    self.root = os.path.abspath(root)
    os.makedirs(self.root, exist_ok=True)
    self._in_use: set[str] = set()
    self._lock = threading.Lock()

  def path(self, version: int) -> str:
    return os.path.join(self.root, f"v{int(version):08d}")

  def write(self, params: Any, version: int) -> str:
    """Writes ``params`` as version ``version``; returns its directory (replaced if it existed)."""
    model = as_model(self.template, params)
    path = save_hf(model, self.tokenizer, self.path(version), dtype=self.dtype)
    self.prune()
    return path

  def write_adapters(self, adapters: Any, lcfg: lora_lib.LoraConfig, version: int) -> str:
    """Writes LoRA ``adapters`` as the PEFT directory of ``version`` (atomic); returns its path."""
    path = self.path(version)
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    lora_lib.save_peft(adapters, lcfg, tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    self.prune()
    return path

  @staticmethod
  def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, lora_lib.ADAPTER_CONFIG))

  def mark_in_use(self, path: str | None, previous: str | None = None) -> None:
    """Protects ``path`` from pruning (and releases ``previous``): vLLM is using it."""
    with self._lock:
      if previous is not None:
        self._in_use.discard(os.path.abspath(previous))
      if path is not None:
        self._in_use.add(os.path.abspath(path))

  def versions(self) -> list[int]:
    found = []
    for name in os.listdir(self.root):
      m = _VERSION_DIR.match(name)
      if m and os.path.isdir(os.path.join(self.root, name)):
        found.append(int(m.group(1)))
    return sorted(found)

  def prune(self) -> None:
    with self._lock:
      in_use = set(self._in_use)
    versions = self.versions()
    for v in versions[:-self.keep]:
      path = self.path(v)
      if path not in in_use:
        shutil.rmtree(path, ignore_errors=True)
