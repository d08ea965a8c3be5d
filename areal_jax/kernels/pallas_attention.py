"""Decode attention through the Pallas GPU kernel JAX ships
(``jax.experimental.pallas.ops.gpu.decode_attention.gqa``): each (row, K/V head) reads its cache
only up to its own length, split over ``k_splits`` blocks of positions combined at the end.

On a CPU device the same kernel runs in Pallas interpret mode (slow; for tests of the GPU path).
The kernel needs the static bound ``t`` cut into ``k_splits`` pieces of at least 16 positions,
each a multiple of a power-of-two block; ``usable`` says whether some split fits, else the caller takes the
dense form.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode
from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

from areal_jax.kernels import stacked_pages

BLOCK_K = 128  # largest block of positions per kernel step


def _split(t: int) -> tuple[int, int] | None:
  """``(k_splits, block_k)`` for a bound of ``t`` positions, or None when none fits."""
  for k_splits in (16, 8, 4, 2, 1):
    piece = t // k_splits
    if t % k_splits or piece < 16:
      continue
    for block_k in (BLOCK_K, 64, 32, 16):  # a power of two (Triton's blocks), dividing the piece
      if block_k <= piece and piece % block_k == 0:
        return k_splits, block_k
  return None


def usable(t: int) -> bool:
  return _split(t) is not None


def decode_attention(q_BxKxGxD, k_RxTxKxD, v_RxTxKxD, pos_B, t: int, interpret: bool = False):
  """Pre-scaled queries ``[B, K, G, D]`` against cache rows ``[0, B)`` and positions
  ``[0, pos_B[b]]``; float32 ``[B, K, G, D]``. ``interpret``: Pallas interpret mode (CPU)."""
  b, kv, g, d = q_BxKxGxD.shape
  k_splits, block_k = _split(t)
  k_BxTxKxD, v_BxTxKxD = k_RxTxKxD[:b, :t], v_RxTxKxD[:b, :t]
  q_BxHxD = q_BxKxGxD.reshape(b, kv * g, d).astype(k_BxTxKxD.dtype)
  out_BxHxD = pallas_decode.gqa(q_BxHxD, k_BxTxKxD, v_BxTxKxD, kv_seq_len=pos_B + 1, sm_scale=1.0,
                                block_h=16, block_k=block_k, k_splits=k_splits,
                                interpret=interpret)
  return out_BxHxD.reshape(b, kv, g, d).astype(jnp.float32)


def decode_attention_heads_major(q_BxKxGxD, k_RxKxTxD, v_RxKxTxD, pos_B, t: int,
                                 interpret: bool = False):
  """The same over a heads-major cache ``[R, K, T, D]``: every (row, K/V head) pair is one
  single-head problem of JAX's ``mqa`` entry point, so the cache is read in place (``gqa`` would
  transpose a ``[B, T, K, D]`` cache first)."""
  b, kv, g, d = q_BxKxGxD.shape
  k_splits, block_k = _split(t)
  k_NxTxD = k_RxKxTxD[:b, :, :t].reshape(b * kv, t, d)
  v_NxTxD = v_RxKxTxD[:b, :, :t].reshape(b * kv, t, d)
  q_NxGxD = q_BxKxGxD.reshape(b * kv, g, d).astype(k_NxTxD.dtype)
  out_NxGxD = pallas_decode.mqa(q_NxGxD, k_NxTxD, v_NxTxD, kv_seq_len=jnp.repeat(pos_B + 1, kv),
                                sm_scale=1.0, block_h=16, block_k=block_k, k_splits=k_splits,
                                interpret=interpret)
  return out_NxGxD.reshape(b, kv, g, d).astype(jnp.float32)


def stacked_usable(max_len: int) -> bool:
  """Whether ``decode_attention_stacked`` can take a stacked cache of ``max_len`` positions."""
  return stacked_pages.page_size(max_len) is not None


@dataclasses.dataclass(frozen=True)
class PagedTuning:
  """How JAX's Pallas GPU paged-attention kernel is launched (``paged``): ``block_pages`` pages
  read per step of its loop (``pages_per_compute_block``; at most, the most that divides a part);
  ``parts`` (``k_splits``) pieces each sequence's pages are cut into, read in parallel and combined
  after (0: the gcd of the pages given and 16; otherwise the table is padded to a multiple of it
  with entries past every length, which the kernel skips); ``warps`` and ``stages``: its Triton
  ``num_warps`` and ``num_stages``; ``bound``: hand the kernel only the pages up to the program's
  static kv bound (``False``: the whole page table, its programs past every row's length exit
  at once); ``writes``: a decode step over a paged cache runs ``pallas_paged_step`` instead, our
  kernel that also writes the step's keys and values (of the fields above it takes ``warps``,
  ``stages``, ``parts``, 0 there: ``pallas_paged_step.auto_parts``, and ``block_pages``, the
  pages a step of its loop reads); ``dot``: that kernel
  computes a page's scores and output with tensor-core dots over its queries padded to 16 rows
  in registers, where ``pallas_paged_step.dot_usable`` (else products summed per query). The
  defaults are what ``bench/results/h100-2026-11-27-8a1f9a5`` measured; ``bench/paged_kernel.py``
  times the others."""

  block_pages: int = 1
  parts: int = 0
  warps: int = 8
  stages: int = 2
  bound: bool = False
  writes: bool = False
  dot: bool = False

  def __post_init__(self):
    for name in ("block_pages", "warps", "stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"PagedTuning.{name}={getattr(self, name)}: expected >= 1")
    if self.parts < 0:
      raise ValueError(f"PagedTuning.parts={self.parts}: expected >= 0 (0: automatic)")


def decode_attention_stacked(q_BxKxGxD, k_LxRxKxTxD, v_LxRxKxTxD, layer, pos_B, cache_axes,
                             interpret: bool = False, tuning: PagedTuning = PagedTuning(),
                             bound: int | None = None):
  """Layer ``layer`` of the scan's stacked cache ``[L, R, K, T, D]`` through JAX's paged GPU
  kernel (``jax.experimental.pallas.ops.gpu.paged_attention``), the cache read in place as pages
  (``stacked_pages``): no copy of the layer's cache (a slice handed to ``mqa`` is one, at every
  layer and step), each (row, K/V head) read up to its own length, in parts combined at the end,
  launched as ``tuning`` says (``paged``; ``bound``: the static kv bound)."""
  kernel = functools.partial(paged, interpret=interpret, tuning=tuning, bound=bound)
  return stacked_pages.attend(kernel,
                              q_BxKxGxD.astype(k_LxRxKxTxD.dtype), k_LxRxKxTxD, v_LxRxKxTxD,
                              layer, pos_B, cache_axes)


def paged(q_NxHxD, k_pool, v_pool, lengths_N, pages_NxP, page: int, interpret: bool = False,
          tuning: PagedTuning = PagedTuning(), bound: int | None = None):
  """JAX's paged GPU kernel on N sequences' queries ``[N, H, D]`` over a pool
  ``[Kp, pages, page, D]`` (H a multiple of Kp) and their page tables
  ``[N, pages per sequence]``, launched as ``tuning`` says (``bound``: the static kv bound, for
  ``tuning.bound``; every length is at most it)."""
  if tuning.bound and bound is not None:
    pages_NxP = pages_NxP[:, :max(1, min(-(-bound // page), pages_NxP.shape[1]))]
  n = pages_NxP.shape[1]
  k_splits = tuning.parts or math.gcd(n, 16)
  if n % k_splits:  # entries past every length (the kernel reads no page past a length)
    pad_NxE = jnp.broadcast_to(pages_NxP[:, :1], (pages_NxP.shape[0], k_splits - n % k_splits))
    pages_NxP = jnp.concatenate([pages_NxP, pad_NxE], axis=1)
  part = pages_NxP.shape[1] // k_splits
  per_block = max(b for b in range(1, min(tuning.block_pages, part) + 1) if part % b == 0)
  return pallas_paged.paged_attention(q_NxHxD, k_pool, v_pool, pages_NxP, lengths_N,
                                      block_h=16, pages_per_compute_block=per_block,
                                      k_splits=k_splits, num_warps=tuning.warps,
                                      num_stages=tuning.stages, interpret=interpret)
