r"""Exports a LoRA run's adapters as a Hugging Face PEFT directory (and optionally merged weights).

  python -m areal_jax.export --config=configs/gsm8k.py:qwen3_lora --checkpoint=$HOME/runs/q3lora \
      --output=$HOME/exports/q3lora_adapter [--merged=$HOME/exports/q3lora_merged]

``--checkpoint`` is a run workdir (its latest checkpoint) or ``<workdir>/checkpoints/<step>``; the
config must be the run's (``actor.lora`` and ``model.source`` say what the adapters fit). The
adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) loads with
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<model.source>), output)``;
``--merged`` also writes the base with the adapters merged, as a plain Hugging Face directory.
"""

from __future__ import annotations

import logging
import os
import sys

from areal_jax import cli
from areal_jax import config as config_lib
from areal_jax import models
from areal_jax.evaluate import resolve_checkpoint, restore_adapters
from areal_jax.models import lora as lora_lib


def export(config, checkpoint: str, output: str, merged: str = "") -> dict:
  """Writes the PEFT adapter dir ``output`` (and the merged model dir ``merged``); returns paths."""
  lcfg = lora_lib.LoraConfig.from_config(config.actor.lora)
  if lcfg is None:
    raise config_lib.ConfigError(
        "actor.lora.rank=0: this config trains every weight, there are no adapters to export (its "
        "checkpoints load with `areal_jax.evaluate --checkpoint`)")
  spec = resolve_checkpoint(checkpoint, config.model.source)
  if spec.kind != "run_checkpoint":
    raise models.CheckpointError(f"--checkpoint={checkpoint} is not a run checkpoint (a workdir or "
                                 "<workdir>/checkpoints/<step>)")
  model, tokenizer = models.load(config.model.source, dtype=config.model.dtype, seed=config.seed)
  adapters = restore_adapters(spec.path, model, lcfg)
  out = {"adapter": lora_lib.save_peft(adapters, lcfg, output, base_model=config.model.source)}
  if merged:
    out["merged"] = models.save_hf(lora_lib.merged_model(model, adapters, lcfg), tokenizer, merged)
  return out


def main(argv) -> None:
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected arguments {argv[1:]}")
  cli.set_up_logging(logging.INFO)
  with cli.reported_faults(quiet_exit=True):  # what to fix, in one line
    paths = export(_CONFIG.value, _CHECKPOINT.value, _OUTPUT.value, _MERGED.value)
  for kind, path in paths.items():
    print(f"{kind}: {path}", flush=True)


if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from absl import app, flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", None, "path/to/config.py[:preset]")
  _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a run workdir or <workdir>/checkpoints/<step>")
  _OUTPUT = flags.DEFINE_string("output", None, "the PEFT adapter directory to write")
  _MERGED = flags.DEFINE_string("merged", "", "also write the merged model here (optional)")
  flags.mark_flags_as_required(["config", "checkpoint", "output"])
  config_lib.check_overrides(sys.argv)
  app.run(main)
