"""How a decode step holds and writes its state on each platform.

Each choice here keeps a compiler from copying or relaying out the step's largest buffers (the
cache, the weights, the logits) every step; the counts quoted are from programs compiled for the
platform on a CPU machine (``bench/aot_decode.py``, ``bench/aot_cache_layout.py``), which show the
copies without needing the device.

``kernels.choice`` re-exports every name here; callers import them from there.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax.numpy as jnp

HELD_LAYOUTS_ENV = "AREAL_JAX_HELD_LAYOUTS"
QUERY_ROWS_ENV = "AREAL_JAX_DECODE_QUERY_ROWS"
HELD_LAYOUTS = ("compiler", "default")


def heads_major_per_layer(attention_impl: str, platform: str) -> bool:
  """Whether the unrolled layers' per-layer cache is held heads before positions for
  ``attention_impl`` on ``platform``: the forms that read that layout in place (the dense read, the
  Pallas GPU kernel's ``mqa``); compiled for a GPU the positions-first cache is copied into
  heads-major order on entering each decode call and back on leaving it
  (``bench/aot_cache_layout.py``). The CPU and chunked forms read positions first; so does a TPU:
  compiled for a TPU v5e chip, the positions-first cache written by one scatter a layer
  (:func:`scatter_cache_writes`) is neither copied nor looped over, the heads-major one written so
  is copied (354 MB a step at the Qwen2.5-1.5B shape)."""
  return attention_impl in ("dense", "pallas_gpu") and platform != "tpu"


def scatter_cache_writes(platform: str) -> bool:
  """Whether a decode step over every slot writes each layer's new keys and values with one
  scatter (``Transformer.extend``'s ``scatter_writes``) rather than a per-row update (a ``vmap`` of
  ``dynamic_update_slice``): on TPU, whose compiler turns the per-row update into a loop over the
  rows (compiled for a TPU v5e chip at the Qwen2.5-1.5B shape: ~57,600 operations a step against
  285 with the scatter, ``bench/aot_cache_layout.py``). CPU and GPU keep the per-row update (on a
  GPU the compiled step shows no loop for it: 481 operations a step at that shape)."""
  return platform == "tpu"


def vocab_major_logits(platform: str) -> bool:
  """Whether the sampler's decode programs produce the logits with the vocabulary axis major
  (``ModelConfig.vocab_major_logits``: the LM head as head weight x activations) and take each
  slot's block of the vocabulary by a masked sum rather than a gather (``sampling.sample``'s
  ``select_by_mask``): on TPU, whose compiler otherwise relays out the float32 logits twice a
  step, once for the reductions over the vocabulary and once for the gather (compiled for a TPU
  v5e chip at the Qwen2.5-1.5B shape, 128 slots: 2 x 78 MB copied a step; with both, neither,
  ``bench/aot_decode.py``). CPU and GPU keep the gather and the activations x head form (their
  compiled steps copy neither)."""
  return platform == "tpu"


def held_layouts(platform: str) -> str:
  """Whether the sampler holds its weights and decode state in the layouts its widest decode
  program picks (``"compiler"``: compiled once with ``Layout.AUTO``, then every program takes and
  returns them so) or in the default ones (``"default"``): the compiler's on TPU, whose compiler
  otherwise relays them out on entering and leaving each decode call (compiled for a TPU v5e chip,
  ``bench/aot_decode.py --held-layouts default,compiler``: at the Qwen2.5-1.5B shape the gate_up
  and qkv weights, 145 -> 38 MB copied a step; at the SmolLM2 shape, head size 64, each layer's
  cache, 104 -> 21 MB); the default ones on CPU and GPU (their compiled steps copy neither: the
  layouts there are the default ones). ``$AREAL_JAX_HELD_LAYOUTS`` forces either (tests run the
  compiler's on CPU, where it picks the default ones)."""
  value = os.environ.get(HELD_LAYOUTS_ENV, "") or ("compiler" if platform == "tpu" else "default")
  if value not in HELD_LAYOUTS:
    raise ValueError(f"${HELD_LAYOUTS_ENV}={value!r}: expected one of {HELD_LAYOUTS}")
  return value


_MATMULS: contextvars.ContextVar[str | None] = contextvars.ContextVar("matmuls", default=None)


@contextlib.contextmanager
def matmuls(matmul_impl: str):
  """Inside it (the trace of a program compiled with ``compiler_options(matmul_impl)``), the
  kernels know how that program's matmuls run (``MATMUL``): what ``query_rows`` reads."""
  token = _MATMULS.set(matmul_impl)
  try:
    yield
  finally:
    _MATMULS.reset(token)


def query_rows(cache_dtype) -> int:
  """The multiple the dense decode attention pads each K/V head's group of queries to (zero
  queries, whose rows it drops): 8 for a 16-bit cache inside ``matmuls("blas")``, else 1.
  XLA's GPU compiler pads a 16-bit matmul's dimensions to multiples of 8 for the vendor library's
  GEMMs; with a query group of fewer rows (GQA: SmolLM2's 3, Qwen2.5-1.5B's 6) the probabilities x
  values matmul then gets a padded copy of the probabilities, every layer and step. Padded in the
  queries instead, the padding joins the queries' own fusion (rotary embedding, scale, cast) and
  the softmax writes the probabilities already padded: compiled for an H100 with ``"blas"``, the
  layers unrolled, a step copies 0.1 MB instead of 35.4 MB at the SmolLM2 shape and 0.6 MB
  instead of 88.7 MB at the Qwen2.5-1.5B shape, in ~30 launches fewer
  (``bench/results/cpu-aot-h100-2026-11-27``). Its price, the softmax reading and writing the
  padding rows, is smaller than the copy it replaces. Not with XLA's own (Triton) GEMMs, which
  take the group as it is (there the padding adds launches), nor on TPU (compiled for a v5e chip
  it copied more a step than unpadded) or CPU. On an H100 the padded step ran within the noise of
  the unpadded one (``bench/results/h100-2026-11-27-8a1f9a5``).
  ``$AREAL_JAX_DECODE_QUERY_ROWS`` forces the multiple (1: no padding), read when a program is
  traced (set it before the process builds its engines: compiled programs are shared by engines of
  one configuration)."""
  forced = os.environ.get(QUERY_ROWS_ENV, "")
  if forced:
    if not forced.isdigit() or int(forced) < 1:
      raise ValueError(f"${QUERY_ROWS_ENV}={forced!r}: expected a positive integer")
    return int(forced)
  return 8 if _MATMULS.get() == "blas" and jnp.dtype(cache_dtype).itemsize == 2 else 1
