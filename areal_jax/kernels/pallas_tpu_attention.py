"""Decode attention through the Pallas TPU kernel JAX ships
(``jax.experimental.pallas.ops.tpu.paged_attention``), reading the layers-in-a-scan decode's
stacked cache in place as a pool of pages (``stacked_pages``), each row up to its own length, in
blocks of up to ``BLOCK`` positions.

The kernel loads K/V as bfloat16 whatever their dtype (a float32 cache would come back rounded,
~7e-3 off a float32 reference, found on CPU), so it is used only over a bfloat16 cache
(``unusable``). Its accumulation is float32 (queries and probabilities too): over the same
bfloat16 cache it equals a float64 reference to float32 rounding.

On a CPU device it runs in Pallas TPU interpret mode (tests). Compiled for a TPU it needs a head
size that is a multiple of 128 (Qwen2.5's and Qwen3's; not SmolLM2's 64: ``unusable``), which
interpret mode does not check: tests also lower it for TPU (``choice.lowering_for``). Not yet run
on a TPU, so the TPU default stays the dense read (``choice``).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

from areal_jax.kernels import stacked_pages

BLOCK = 512  # positions per kernel block (pages per compute block x page size, at most)
LANES = 128  # a TPU vector register's lanes: the kernel's head size must be a multiple


def unusable(layers: str, cache_dtype, max_len: int, head_dim: int = LANES,
             compiled: bool = False) -> str | None:
  """Why an engine cannot run this kernel (None when it can): ``unreadable``, and the stacked
  cache it reads (the layers in a scan, positions that split into pages)."""
  if layers != "scan":
    return "it reads the stacked cache of the layers in a scan: set decode_layers='scan'"
  if stacked_pages.page_size(max_len) is None:
    return f"max_len={max_len} must be a multiple of {stacked_pages.MIN_PAGE} (the kernel's pages)"
  return unreadable(cache_dtype, head_dim, compiled)


def unreadable(cache_dtype, head_dim: int, compiled: bool) -> str | None:
  """Why the kernel cannot read a cache of ``cache_dtype`` and ``head_dim`` (None when it can);
  ``compiled``: for a TPU (not in interpret mode), where the head size must be a multiple of
  ``LANES``."""
  if jnp.dtype(cache_dtype) != jnp.bfloat16:
    return (f"the kernel reads K/V as bfloat16 (a {jnp.dtype(cache_dtype).name} cache would be "
            "rounded): set cache_dtype='bfloat16' or a bfloat16 model")
  if compiled and head_dim % LANES:
    return (f"head_dim={head_dim} is not a multiple of {LANES}: the kernel's blocks of its "
            f"softmax statistics are head_dim wide, which Mosaic refuses on a TPU: set "
            "decode_attention='dense'")
  return None


def decode_attention_stacked(q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes,
                             interpret: bool = False):
  """``stacked_pages.attend`` through the TPU kernel (``interpret``: Pallas TPU interpret mode)."""
  return stacked_pages.attend(functools.partial(kernel, interpret=interpret),
                              q_BxKxGxD.astype(jnp.float32), k_LxRxKxTxD, v_LxRxKxTxD, layer,
                              pos_B, cache_axes)


def kernel(q_NxHxD, k_pool, v_pool, lengths_N, pages_NxP, page: int, interpret: bool = False):
  """The TPU kernel on N sequences' queries ``[N, H, D]`` over a pool ``[Kp, pages, page, D]``
  (H a multiple of Kp) and their page tables ``[N, pages per sequence]``."""
  with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
    return paged_attention(q_NxHxD, k_pool, v_pool, lengths_N, pages_NxP,
                           pages_per_compute_block=math.gcd(pages_NxP.shape[1],
                                                            max(BLOCK // page, 1)))
