"""Builds the vLLM rollout engine from the run config (``rollout.backend = "vllm"``).

Settings, all optional, under ``rollout.vllm`` (defaults when the block or a key is absent):

* ``mode``: ``"inprocess"`` (vLLM's engine in this process) or ``"server"`` (an OpenAI-compatible
  vLLM server on 127.0.0.1);
* ``server_url``: attach to a running server (started with ``VLLM_SERVER_DEV_MODE=1`` and
  ``worker_extension_cls`` as ``server.py`` does) instead of starting one;
* ``kv_cache_gib`` (0: 1 GiB on CPU, on a GPU vLLM's own size, from its memory share),
  ``num_threads`` (0: all cores; CPU), ``workdir`` ("": a temporary directory);
* ``dtype`` (``"auto"``: float32 on CPU, bfloat16 on a GPU; or one of ``DTYPES``) and
  ``gpu_memory_utilization`` (on a GPU vLLM's share of its memory; 0: what is free when it starts,
  less 2 GiB): ``settings.py``, which picks what vLLM runs with by the platform of its build.

Shared with the JAX backend: ``rollout.num_slots`` (vLLM's ``max_num_seqs``),
``rollout.max_prompt_len + rollout.max_new_tokens`` (``max_model_len``), ``weights.keep``, ``seed``.
vLLM places itself (the host CPU with its own threads, or the GPU its build runs on); the sampler
mesh is not used. With LoRA (``actor.lora.rank > 0``) the in-process engine loads the published
adapters through vLLM's LoRA support; the server engine gets merged weights
(``runtime/engines.py``'s ``MergingEngine``).
"""

from __future__ import annotations

import os

from areal_jax.vllm_rollout import env as env_lib

MODES = ("inprocess", "server")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _option(config, key, default):
  block = config.rollout.get("vllm", None)
  if block is None:
    return default
  value = block.get(key, default)
  return default if value is None else value


def build(config, model, tokenizer, sampler_mesh=None):
  """The vLLM ``RolloutEngine`` for ``config``; raises ``VllmNotInstalledError`` without vLLM."""
  del sampler_mesh  # vLLM places itself (the host CPU or its GPU)
  r = config.rollout
  mode = _option(config, "mode", "inprocess")
  if mode not in MODES:
    raise ValueError(f"rollout.vllm.mode={mode!r} is not one of {MODES}")
  dtype = str(_option(config, "dtype", "auto"))
  if dtype not in DTYPES:
    raise ValueError(f"rollout.vllm.dtype={dtype!r} is not one of {DTYPES}")
  env_lib.require_vllm()
  workdir = _option(config, "workdir", "")
  if not workdir and config.weights.path:
    workdir = os.path.join(config.weights.path, "vllm")
  common = dict(
      workdir=workdir or None, num_slots=r.num_slots,
      max_model_len=r.max_prompt_len + r.max_new_tokens,
      kv_cache_gib=float(_option(config, "kv_cache_gib", 0.0)),
      num_threads=int(_option(config, "num_threads", 0)) or None,
      keep_weights=max(2, int(config.weights.keep)), seed=int(config.seed), dtype=dtype,
      gpu_memory_utilization=float(_option(config, "gpu_memory_utilization", 0.0)))
  if mode == "inprocess":
    from areal_jax.models import lora as lora_lib
    from areal_jax.vllm_rollout.inprocess import VllmInProcessEngine
    lora = lora_lib.LoraConfig.from_config(config.actor.get("lora"))
    return VllmInProcessEngine(model, tokenizer, lora=lora, **common)
  from areal_jax.vllm_rollout.server import VllmServerEngine
  return VllmServerEngine(model, tokenizer, server_url=_option(config, "server_url", "") or None,
                          **common)
