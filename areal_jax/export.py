r"""Exports a run checkpoint as a Hugging Face directory (a full-weight run) or PEFT adapters (LoRA).

  python -m areal_jax.export --config=configs/gsm8k.py:tiny --checkpoint=/tmp/gsm8k_tiny \
      --output=/tmp/gsm8k_tiny_hf [--step=N] [--dtype=bfloat16] [--max_shard_size=5GB]
  python -m areal_jax.export --config=configs/gsm8k.py:qwen3_lora --checkpoint=$HOME/runs/q3lora \
      --output=$HOME/exports/q3lora_adapter [--merged=$HOME/exports/q3lora_merged]

``--checkpoint`` is a run workdir (its latest finished checkpoint, or ``--step``'s) or
``<workdir>/checkpoints/<step>``; the config must be the run's (``model.source`` gives the
architecture and tokenizer, ``actor.lora`` says whether the run trained adapters).

* A full-weight run (``actor.lora.rank=0``): ``--output`` becomes a plain Hugging Face directory
  (``config.json``, safetensors, tokenizer files with the chat template,
  ``generation_config.json``) that ``transformers``, vLLM and ``model.source=<dir>`` load. The
  parameters are read from the checkpoint one array at a time (whatever mesh the run sharded them
  over) and written as they are read, in shards of at most ``--max_shard_size`` with a
  ``model.safetensors.index.json``: the host holds one tensor at a time, not the model.
* A LoRA run: ``--output`` becomes a PEFT adapter directory that
  ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<model.source>), output)``
  loads; ``--merged`` also writes the base with the adapters merged, as a plain Hugging Face
  directory (built in memory: the base model is loaded whole).

``--dtype`` (float32, bfloat16 or float16) is the dtype of the weights written; by default the
model source's (what a Hugging Face directory's ``config.json`` declares; float32 for the random
presets and GGUF files).
"""

from __future__ import annotations

import logging
import os
import re
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from areal_jax import cli
from areal_jax import config as config_lib
from areal_jax import models
from areal_jax.evaluate import key_name, resolve_checkpoint, restore_adapters
from areal_jax.models import hf, hf_export
from areal_jax.models import lora as lora_lib
from areal_jax.runtime import weight_transfer

DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str) -> int:
  """Bytes of ``"5GB"``, ``"500MB"``, ``"2GiB"`` or ``"1000000"`` (GB = 10^9, GiB = 2^30)."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
  if not m or float(m.group(1)) <= 0:
    raise config_lib.ConfigError(f"--max_shard_size={text}: expected a size such as 5GB, 500MB "
                                 "or 2GiB")
  return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def step_dir(checkpoint: str, model_source: str, step: int | None = None) -> tuple[str, int]:
  """(directory, step) of the run checkpoint ``checkpoint`` names: a workdir's latest finished
  step or ``step``, or a step directory (whose step ``step`` must then be)."""
  spec = resolve_checkpoint(checkpoint, model_source)
  if spec.kind != "run_checkpoint":
    raise models.CheckpointError(f"--checkpoint={checkpoint} is not a run checkpoint (a workdir or "
                                 "<workdir>/checkpoints/<step>)")
  if step is None or step == spec.step:
    return spec.path, spec.step
  ckpt_dir = os.path.dirname(spec.path)
  if os.path.basename(os.path.abspath(os.path.expanduser(checkpoint))) == str(spec.step):
    raise models.CheckpointError(f"--checkpoint={checkpoint} is checkpoint step {spec.step}, "
                                 f"not --step={step}; pass the workdir to choose a step")
  steps = weight_transfer.list_versions(ckpt_dir)
  if step not in steps:
    raise models.CheckpointError(f"--step={step}: {ckpt_dir} holds no finished checkpoint of that "
                                 f"step; its steps: {steps}")
  return os.path.join(ckpt_dir, str(step)), step


class CheckpointParams:
  """Reads the parameters of a run checkpoint (``Learner.state["params"]``) one array at a time,
  as host NumPy arrays, whatever shardings the run saved them with."""

  def __init__(self, step_path: str, cfg: models.ModelConfig):
    self.state_dir = os.path.join(step_path, "state")
    if not os.path.isdir(self.state_dir):
      raise models.CheckpointError(f"{step_path}: no 'state' item (is it a run checkpoint step?)")
    handler = ocp.PyTreeCheckpointHandler()  # item-level metadata: no step metadata file wanted
    try:
      tree = handler.metadata(epath.Path(self.state_dir))
    finally:
      handler.close()
    if "params" not in tree:
      raise models.CheckpointError(f"{self.state_dir}: the checkpointed state has no 'params' "
                                   f"(keys: {sorted(tree)}); expected the learner's state layout")
    found = {key_name(p): tuple(m.shape)
             for p, m in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}
    expected = {".".join(map(str, p.path)): p.shape[::-1] if p.transpose else p.shape
                for p in hf_export.tensor_plans(cfg)}
    problems = sorted(set(expected) ^ set(found))
    problems += [f"{k}: checkpoint {found[k]} vs model {expected[k]}"
                 for k in sorted(set(expected) & set(found)) if found[k] != expected[k]]
    if problems:
      raise models.CheckpointError(
          f"{self.state_dir}: the checkpointed params do not fit the model of config.model.source "
          f"(pass the run's config; a LoRA run's needs its actor.lora): {problems[:8]}")
    self._checkpointer = ocp.PyTreeCheckpointer()

  def read(self, path) -> np.ndarray:
    """The parameter at our ``path`` (e.g. ``("layers", 0, "attn", "q")``), on the host."""
    item, args = 0, ocp.RestoreArgs(restore_type=np.ndarray)
    for key in reversed(("params", *path)):
      item, args = {key: item}, {key: args}
    out = self._checkpointer.restore(self.state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=args, partial_restore=True))
    for key in ("params", *path):
      out = out[key]
    return out

  def close(self) -> None:
    self._checkpointer.close()


def export(config, checkpoint: str, output: str, merged: str = "", *, step: int | None = None,
           dtype: str = "", max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> dict:
  """Exports run checkpoint ``checkpoint`` (see the module docstring); returns the paths written:
  ``{"model": output}`` for a full-weight run, ``{"adapter": output[, "merged": merged]}`` for a
  LoRA run."""
  source = config.model.source
  dtype = dtype or hf_export.source_dtype(source)
  if dtype not in hf.SAVE_DTYPES:
    raise config_lib.ConfigError(f"--dtype={dtype}: expected one of {list(hf.SAVE_DTYPES)}")
  max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
  lcfg = lora_lib.LoraConfig.from_config(config.actor.lora)
  if lcfg is None and merged:
    raise config_lib.ConfigError("--merged is for LoRA runs (actor.lora.rank > 0); a full-weight "
                                 "run's export (--output) is already the whole model")
  path, _ = step_dir(checkpoint, source, step)
  if lcfg is None:
    cfg, tokenizer = hf_export.describe(source, config.model.dtype)
    params = CheckpointParams(path, cfg)
    try:
      return {"model": hf_export.save_hf_streamed(cfg, tokenizer, params.read, output, dtype=dtype,
                                                  max_shard_bytes=max_bytes)}
    finally:
      params.close()
  model, tokenizer = models.load(source, dtype=config.model.dtype, seed=config.seed)
  adapters = restore_adapters(path, model, lcfg)
  out = {"adapter": lora_lib.save_peft(adapters, lcfg, output, base_model=source)}
  if merged:
    out["merged"] = models.save_hf(lora_lib.merged_model(model, adapters, lcfg), tokenizer, merged,
                                   max_shard_bytes=max_bytes, dtype=dtype)
  return out


def main(argv) -> None:
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected arguments {argv[1:]}")
  cli.set_up_logging(logging.INFO)
  with cli.reported_faults(quiet_exit=True):  # what to fix, in one line
    paths = export(_CONFIG.value, _CHECKPOINT.value, _OUTPUT.value, _MERGED.value,
                   step=_STEP.value, dtype=_DTYPE.value, max_shard_size=_MAX_SHARD_SIZE.value)
  for kind, path in paths.items():
    print(f"{kind}: {path}", flush=True)


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", None, "path/to/config.py[:preset]")
  _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a run workdir or <workdir>/checkpoints/<step>")
  _OUTPUT = flags.DEFINE_string("output", None, "the directory to write: the Hugging Face model "
                                "(a full-weight run) or the PEFT adapters (a LoRA run)")
  _MERGED = flags.DEFINE_string("merged", "", "LoRA runs: also write the merged model here")
  _STEP = flags.DEFINE_integer("step", None, "the checkpoint step to export (default: the latest)")
  _DTYPE = flags.DEFINE_enum("dtype", "", ["", *hf.SAVE_DTYPES],
                             "dtype of the weights written (default: the model source's)")
  _MAX_SHARD_SIZE = flags.DEFINE_string("max_shard_size", DEFAULT_MAX_SHARD_SIZE,
                                        "the largest safetensors file, e.g. 5GB, 500MB, 2GiB")
  flags.mark_flags_as_required(["config", "checkpoint", "output"])
  config_lib.check_overrides(sys.argv)
  app.run(main)
