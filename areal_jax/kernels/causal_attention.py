"""Causal self-attention of whole rows as a flash kernel on accelerators: the attention of a
training step over packed rows (``models.train_forward``) and of a sampler's prefill (prompts from
position 0). The dense form (the model's ``causal_attention``) holds each layer's float32 scores,
``heads x L x L`` a row: 17 GB per row and layer at 16k tokens and 16 heads, more than a chip has.
The kernels JAX ships hold a block of them at a time, in the forward and the backward pass:

  * ``"pallas_tpu"``: ``jax.experimental.pallas.ops.tpu.flash_attention`` (Mosaic);
  * ``"pallas_gpu"``: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton; GPUs of compute
    capability 8.0 and newer, ``choice.triton_unusable``).

Both take packed rows as segment ids (a query attends to keys of its own segment, causally; the
padding, segment 0, attends among itself and its outputs are ignored), equal numbers of query and
K/V heads (K/V heads are repeated for grouped-query attention: ``[B, L, H, D]`` each, not
``L x L``), and rows whose length is a multiple of their blocks (rows are padded at the end here,
which no earlier position sees). On a mesh a kernel runs per device under ``shard_map`` (rows over
the batch's axes, heads over the tensor axis), as a custom call cannot be split by the compiler.

On a CPU device both run in Pallas interpret mode (tests; slow). ``choice.causal_attention``
picks one per platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention
from jax.sharding import PartitionSpec as P

from areal_jax import sharding

IMPLS = ("dense", "pallas_gpu", "pallas_tpu")
BLOCK = 128  # positions per kernel block (both kernels' default); rows are padded to a multiple
MIN_BLOCK = 16  # the GPU kernel's smallest block (a power of two) for rows shorter than BLOCK
LANES = 128  # a TPU vector register's lanes: a head size above it must be a multiple of it


def unusable(impl: str, head_dim: int, compiled: bool) -> str | None:
  """Why ``impl`` cannot run heads of ``head_dim`` (None when it can; ``compiled``: for the
  accelerator, not in interpret mode, where Mosaic's constraints apply)."""
  if impl == "pallas_tpu" and compiled and head_dim > LANES and head_dim % LANES:
    return (f"head_dim={head_dim} above {LANES} must be a multiple of {LANES} for the TPU "
            "flash kernel")
  return None


def padded_length(length: int, impl: str) -> int:
  """Rows' length in kernel ``impl``: a multiple of ``BLOCK`` (the TPU kernel's smallest block of
  keys is 128, its lanes), or for the GPU kernel below it a power of two (at least
  ``MIN_BLOCK``)."""
  if length >= BLOCK or impl == "pallas_tpu":
    return -(-length // BLOCK) * BLOCK
  return max(MIN_BLOCK, 1 << (length - 1).bit_length())


def attend(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL, impl: str, interpret: bool = False):
  """Softmax attention of each query to the keys at or before its position (and, with
  ``segment_ids_BxL``, of its segment), scaled by ``D ** -0.5``; ``[B, L, H, D]`` in the values'
  dtype (queries are cast to it). ``interpret``: Pallas interpret mode (a CPU device)."""
  if impl not in ("pallas_gpu", "pallas_tpu"):
    raise ValueError(f"causal attention {impl!r} is not a kernel here (pallas_gpu, pallas_tpu)")
  b, length, h, d = q_BxLxHxD.shape
  group = h // k_BxLxKxD.shape[2]
  dtype = v_BxLxKxD.dtype
  # K/V head j serves query heads [j * group, (j + 1) * group) (the model's grouping)
  q, k, v = (jnp.repeat(x, r, axis=2).astype(dtype)
             for x, r in ((q_BxLxHxD, 1), (k_BxLxKxD, group), (v_BxLxKxD, group)))
  pad = padded_length(length, impl) - length
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    if segment_ids_BxL is not None:
      segment_ids_BxL = jnp.pad(segment_ids_BxL, ((0, 0), (0, pad)))
  kernel = functools.partial(_tpu if impl == "pallas_tpu" else _gpu, scale=d ** -0.5,
                             interpret=interpret)
  if segment_ids_BxL is None:
    local = lambda q, k, v: kernel(q, k, v, None)  # noqa: E731
  else:
    local = kernel
  ctx = sharding.current()
  if ctx is not None and ctx[0].size > 1:
    mesh, rules = ctx
    heads = sharding.spec(("batch", None, "act_heads", None), q.shape, mesh, rules)
    rows = P(heads[0], None)
    specs = (heads,) * 3 + ((rows,) if segment_ids_BxL is not None else ())
    local = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False)
  args = (q, k, v) if segment_ids_BxL is None else (q, k, v, segment_ids_BxL.astype(jnp.int32))
  return local(*args)[:, :length]


def _gpu(q, k, v, segment_ids, *, scale: float, interpret: bool):
  block = min(BLOCK, q.shape[1])
  sizes = gpu_attention.BlockSizes(block_q=block, block_k=block,
                                   block_q_dkv=min(32, block), block_kv_dkv=min(32, block),
                                   block_q_dq=min(32, block), block_kv_dq=min(32, block))
  return gpu_attention.mha(q, k, v, segment_ids, sm_scale=scale, causal=True,
                           block_sizes=sizes, interpret=interpret)


def _tpu(q, k, v, segment_ids, *, scale: float, interpret: bool):
  if interpret:  # the backward pass is traced later, outside the forward's interpret mode
    return _tpu_interpreted(q, k, v, segment_ids, scale)
  return _tpu_kernel(q, k, v, segment_ids, scale)


def _tpu_kernel(q, k, v, segment_ids, scale: float):
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (the kernel's [B, H, L, D])
  ids = None if segment_ids is None else tpu_attention.SegmentIds(segment_ids, segment_ids)
  block = min(BLOCK, q.shape[1])
  sizes = tpu_attention.BlockSizes(
      block_q=block, block_k_major=block, block_k=block, block_b=1,
      block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
      block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
  out = tpu_attention.flash_attention(heads_first(q), heads_first(k), heads_first(v),
                                      segment_ids=ids, causal=True, sm_scale=scale,
                                      block_sizes=sizes)
  return heads_first(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tpu_interpreted(q, k, v, segment_ids, scale):
  with pltpu.force_tpu_interpret_mode():
    return _tpu_kernel(q, k, v, segment_ids, scale)


def _tpu_interpreted_fwd(q, k, v, segment_ids, scale):
  with pltpu.force_tpu_interpret_mode():
    out, vjp = jax.vjp(lambda q, k, v: _tpu_kernel(q, k, v, segment_ids, scale), q, k, v)
  return out, (vjp, segment_ids)


def _tpu_interpreted_bwd(scale, res, g):
  del scale
  vjp, segment_ids = res
  with pltpu.force_tpu_interpret_mode():
    dq, dk, dv = vjp(g)
  ids = None if segment_ids is None else np.zeros(segment_ids.shape, jax.dtypes.float0)
  return dq, dk, dv, ids


_tpu_interpreted.defvjp(_tpu_interpreted_fwd, _tpu_interpreted_bwd)
