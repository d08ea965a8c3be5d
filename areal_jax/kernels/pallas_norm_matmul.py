"""RMSNorm, then a matmul (and SwiGLU's ``silu(gate) * up``), as one Pallas GPU kernel of our own,
for a decode step's few rows.

Why: a decode step of a small model is bound by its kernel count, not by memory (the SmolLM2
shape on an H100, ``bench/results/h100-2026-11-27-8a1f9a5``). Compiled for an H100, a layer of the
GPU's decode step runs each RMSNorm as a kernel of its own before a vendor GEMM (cuBLAS takes no
fused prologue), and ``silu(gate) * up`` as one more after the gate/up GEMM
(``bench/results/cpu-aot-h100-2026-11-28-9cfc94d``). Here the norm before the q/k/v projection is one
kernel with it, and the norm, the gate/up projection and SwiGLU are one: 3 kernels a layer fewer.

The kernel (grid: one program per block of ``block_n`` output columns and of up to ``BLOCK_ROWS``
rows; a decode step's slots are usually one block of rows):
  1. sums each row's squares over the input in blocks of ``block_k`` (the rows are few: a decode
     step's slots, read again from L2 by every program);
  2. for each block of the input: normalizes it (``x * rsqrt(mean(x^2) + eps) * scale``, rounded to
     ``x``'s dtype, as ``transformer.RMSNorm`` rounds it) and multiplies it by the weight's block,
     accumulating in float32;
  3. rounds to ``x``'s dtype (as the model's matmul), adds the bias (rounded), or, with ``glu``,
     parts the interleaved columns ``2j`` (gate) and ``2j + 1`` (up) of the fused gate/up weight
     (``transformer.fuse_projections``; read as a whole block) after the product (``_columns``)
     and writes ``silu(gate) * up`` with ``jax.nn.silu``'s roundings.

Rows are padded to a power of two of at least 16 (``jnp.dot``'s smallest block on the GPU), or to
a multiple of ``BLOCK_ROWS`` blocks, one program each, past it. Runs in
Pallas interpret mode on a CPU device (tests); its speed on a GPU is ``bench``'s to say.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_ROWS = 128  # rows a program holds (their accumulators in registers); more: more programs


@dataclasses.dataclass(frozen=True)
class NormTuning:
  """How the kernel is launched: ``block_n`` output columns a program (0: 64 up to 64 rows, else
  32, at most the largest power of two dividing the outputs), ``warps`` and ``stages`` (Triton's
  ``num_warps`` and ``num_stages``)."""
  block_n: int = 0
  warps: int = 4
  stages: int = 3

  def __post_init__(self):
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (self.block_n == 0 or pow2(self.block_n)) or not pow2(self.warps) or self.stages < 1:
      raise ValueError(f"block_n={self.block_n}, warps={self.warps}, stages={self.stages}: "
                       "expected block_n a power of two (or 0), warps a power of two, stages >= 1")


def _pow2_dividing(n: int, most: int) -> int:
  """The largest power of two that divides ``n``, at most ``most``."""
  p = 1
  while p < most and n % (2 * p) == 0:
    p *= 2
  return p


def _rows(n: int) -> int:
  """Rows a program takes: ``n`` up to a power of two of at least 16, at most ``BLOCK_ROWS``."""
  return min(BLOCK_ROWS, max(16, 1 << max(n - 1, 0).bit_length()))


def usable(d_in: int, d_out: int) -> bool:
  """Whether the kernel takes ``d_in`` inputs to ``d_out`` outputs (after SwiGLU: half the
  weight's columns): input and output blocks of at least 16 (Triton's powers of two)."""
  return _pow2_dividing(d_in, 64) >= 16 and _pow2_dividing(d_out, 64) >= 16


def _kernel(x_ref, scale_ref, w_ref, *rest, eps: float, glu: bool, block_k: int, block_n: int):
  bias_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
  rows, d_in = x_ref.shape
  dt, f32 = x_ref.dtype, jnp.float32
  steps = d_in // block_k

  def squares(k, acc_R):
    x = x_ref[:, pl.ds(pl.multiple_of(k * block_k, block_k), block_k)].astype(f32)
    return acc_R + jnp.sum(x * x, axis=1)

  inv_R = lax.rsqrt(lax.fori_loop(0, steps, squares, jnp.zeros((rows,), f32)) / d_in + eps)

  def product(k, acc):  # (the weight's block read whole: contiguous, vectorized, pipelined)
    ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    x = (x_ref[:, ks].astype(f32) * inv_R[:, None] * scale_ref[ks].astype(f32)[None, :]).astype(dt)
    return acc + jnp.dot(x, w_ref[ks, :], preferred_element_type=f32)

  acc = lax.fori_loop(0, steps, product, jnp.zeros((rows, w_ref.shape[1]), f32))
  y = acc.astype(dt)
  if glu:  # jax.nn.silu(gate) * up, each operation rounded to the dtype as XLA rounds it
    gate, up = _columns(y, block_n)
    silu = (gate * jax.nn.sigmoid(gate).astype(dt).astype(f32)).astype(dt).astype(f32)
    y = (silu * up).astype(dt)
  if bias_ref is not None:
    y = (y.astype(f32) + bias_ref[...].astype(f32)).astype(dt)
  o_ref[...] = y


def _columns(y_RxW, n: int):
  """The even (gate) and odd (up) columns of ``y`` ``[R, 2n]`` as float32 ``[R, n]`` each, exactly:
  products with 0/1 selection matrices built in registers (one term each: no rounding), where a
  strided read of the weight's columns would load them one 16-bit element at a time (no vector
  loads, no asynchronous copies: the PTX of an H100 compile, ``bench/norm_matmul.py``)."""
  rows = lax.broadcasted_iota(jnp.int32, (2 * n, n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (2 * n, n), 1)
  exact = lax.Precision.HIGHEST if y_RxW.dtype == jnp.float32 else None
  return tuple(jnp.dot(y_RxW, (rows == 2 * cols + parity).astype(y_RxW.dtype), precision=exact,
                       preferred_element_type=jnp.float32) for parity in (0, 1))


@functools.partial(jax.jit, static_argnames=("eps", "glu", "tuning", "interpret"))
def norm_matmul(x_NxE, scale_E, w_ExO, bias_O=None, *, eps: float, glu: bool = False,
                tuning: NormTuning = NormTuning(), interpret: bool = False):
  """``RMSNorm(x) @ w (+ bias)`` in ``x``'s dtype, or with ``glu`` ``silu(gate) * up`` of the
  interleaved gate/up columns (``[N, O // 2]``). ``x`` ``[N, E]`` (``usable(E, out)``), the
  norm's ``scale_E``, the weight ``[E, O]`` in ``x``'s dtype. Past ``BLOCK_ROWS`` rows, each block
  of rows is a program of its own (reading the weight again)."""
  n, e = x_NxE.shape
  out = w_ExO.shape[1] // 2 if glu else w_ExO.shape[1]
  rows = _rows(n)
  block_n = tuning.block_n or (64 if rows <= 64 else 32)
  block_n = _pow2_dividing(out, block_n)
  width = 2 * block_n if glu else block_n
  x = jnp.pad(x_NxE, ((0, -n % rows), (0, 0)))
  kernel = functools.partial(_kernel, eps=eps, glu=glu, block_k=_pow2_dividing(e, 64),
                             block_n=block_n)
  bias = () if bias_O is None else (bias_O,)
  y = pl.pallas_call(
      kernel,
      grid=(x.shape[0] // rows, out // block_n),
      in_specs=[pl.BlockSpec((rows, e), lambda i, j: (i, 0)),
                pl.BlockSpec((e,), lambda i, j: (0,)),
                pl.BlockSpec((e, width), lambda i, j: (0, j))]
               + [pl.BlockSpec((block_n,), lambda i, j: (j,))] * len(bias),
      out_specs=pl.BlockSpec((rows, block_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((x.shape[0], out), x_NxE.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages),
      interpret=interpret,
      name="norm_matmul",
  )(x, scale_E, w_ExO, *bias)
  return y[:n]
