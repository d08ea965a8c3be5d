"""The run's model from ``model.source``, with its weights where every process of a run wants them.

The trainer, a serve runtime and its trainer process, a rollout worker and a learner process all
load the model this one way, so none of them keeps a copy of the weights that no plan counts."""

from __future__ import annotations

from areal_jax import models
from areal_jax.models import lora as lora_lib


def load(config):
  """``(model, tokenizer)`` of ``model.source`` in ``model.dtype``. With LoRA (``actor.lora``) the
  frozen base is stored once in ``actor.dtype`` (the learner and, colocated in the same dtype, the
  sampler use these very arrays instead of copies); else the weights are moved to host memory, as
  the learner and the sampler place copies of their own (``models.load`` leaves a float32 copy on
  the first device, beside the planned memory for as long as the model lives: in the trainer the
  whole run, in a rollout worker while it plans and builds its engine)."""
  try:
    model, tokenizer = models.load(config.model.source, dtype=config.model.dtype, seed=config.seed)
  except models.CheckpointError as e:  # (launch.py prints these as one line: name the key)
    raise models.CheckpointError(f"model.source: {e}") from e
  if lora_lib.LoraConfig.from_config(config.actor.get("lora")) is not None:
    lora_lib.freeze_model_base(model, config.actor.dtype)
  else:
    models.weights_to_host(model)
  return model, tokenizer
