"""Causal attention of packed rows whose positions are split over devices (context parallelism).

Under a mesh whose rules map the logical ``"length"`` axis to mesh axes (``sharding.DEFAULT_RULES``:
``"context"``), each device holds a contiguous block of every row's positions. Everything in a
layer but attention is per position; attention needs the keys of earlier blocks. Two exact forms:

  * ``"ulysses"``: an all-to-all from positions to heads: the queries, keys and values are
    resharded so that each device holds whole rows for ``1 / context`` of the heads (the heads are
    split over the tensor and context axes together), any whole-row attention runs there (the dense
    form or a flash kernel, ``kernels.causal_attention``), and the output goes back to positions.
    Needs the query heads divisible by tensor x context; K/V heads that do not divide are repeated
    to one per query head first (grouped-query attention's grouping).
  * ``"ring"``: each device keeps its queries; the keys and values travel around the context axis
    (``ppermute`` inside ``shard_map``), one block a step, and each step's scores merge into the
    running output by online softmax. Any head count; per device it holds one block's scores.

Both are exact for packed rows whose segments cross block boundaries: a query attends to keys of
its own segment (segment ids, 0 = padding, attended by none) at or before its row index, which is
its global index (``axis_index`` x block + offset), not the per-segment position (``positions``,
what RoPE rotates by, arrive with the rows, sharded like them, already global). Padding queries'
outputs differ between the forms and from the dense one; they are meaningless everywhere.
``choice.context_attention`` picks one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax import sharding

IMPLS = ("ulysses", "ring")
QKV = ("batch", "length", "act_heads", None)  # logical axes of queries, keys, values, outputs
_MASKED = float(np.finfo(np.float32).min)  # a masked score (finite: no inf - inf in the merge)


def _axes(rule) -> tuple[str, ...]:
  return (rule,) if isinstance(rule, str) else tuple(rule or ())


def shards(length: int) -> int:
  """Devices a row of ``length`` positions is split over under the active ``sharding.use`` (1
  outside it or where the mesh's context axes do not divide it)."""
  return sharding.num_shards("length", length)


def _heads_rules(rules) -> dict:
  """``rules`` with the row's positions whole and the heads split over the heads' axes and the
  positions' axes together (Ulysses' layout)."""
  heads = _axes(rules.get("act_heads")) + _axes(rules.get("length"))
  return dict(rules, length=None, act_heads=heads)


def head_shards(n_heads: int) -> int:
  """Devices the ``n_heads`` query heads are split over in Ulysses' layout (under the active
  ``sharding.use``): tensor x context where that divides them, else fewer."""
  ctx = sharding.current()
  if ctx is None:
    return 1
  mesh, rules = ctx
  with sharding.use(mesh, _heads_rules(rules)):
    return sharding.num_shards("act_heads", n_heads)


def ulysses_fits(n_heads: int, length: int) -> bool:
  """Whether Ulysses' layout splits the heads over every device the positions were split over
  (and the tensor axis), so that no device holds more than its share."""
  ctx = sharding.current()
  if ctx is None:
    return True
  tensor = sharding.num_shards("act_heads", n_heads)
  return head_shards(n_heads) == tensor * shards(length)


def _group_repeat(k_BxLxKxD, v_BxLxKxD, n_heads: int):
  """K/V repeated to one head per query head (K/V head j serves query heads ``[j g, (j + 1) g)``)."""
  g = n_heads // k_BxLxKxD.shape[2]
  return jnp.repeat(k_BxLxKxD, g, axis=2), jnp.repeat(v_BxLxKxD, g, axis=2)


def ulysses(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, attend):
  """``attend(q, k, v)`` (a whole-row causal attention) run per head group: positions are
  exchanged for heads before (all-to-all over the context axes) and back after."""
  mesh, rules = sharding.current()
  h = q_BxLxHxD.shape[2]
  with sharding.use(mesh, _heads_rules(rules)):
    if k_BxLxKxD.shape[2] % sharding.num_shards("act_heads", h):
      k_BxLxKxD, v_BxLxKxD = _group_repeat(k_BxLxKxD, v_BxLxKxD, h)
    q, k, v = (sharding.constrain(x, QKV) for x in (q_BxLxHxD, k_BxLxKxD, v_BxLxKxD))
    out = sharding.constrain(attend(q, k, v), QKV)
  return sharding.constrain(out, QKV)


def ring(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL):
  """Ring attention over the context axes (see the module docstring); ``[B, L, H, D]`` in the
  values' dtype, scaled by ``D ** -0.5``."""
  mesh, rules = sharding.current()
  b, length, h, d = q_BxLxHxD.shape
  q_spec = sharding.spec(QKV, q_BxLxHxD.shape, mesh, rules)
  kv_spec = sharding.spec(QKV, k_BxLxKxD.shape, mesh, rules)
  if q_spec[2] != kv_spec[2]:  # K/V heads the tensor axis does not divide: one per query head
    k_BxLxKxD, v_BxLxKxD = _group_repeat(k_BxLxKxD, v_BxLxKxD, h)
    kv_spec = q_spec
  axis = q_spec[1]
  n = shards(length)
  if axis is None or n == 1:
    raise ValueError(f"ring attention needs the rows' positions split over the context axes "
                     f"(rows of {length} positions, mesh {dict(mesh.shape)})")
  local = functools.partial(_ring_local, axis=axis, n=n, scale=d ** -0.5)
  ids_spec = jax.sharding.PartitionSpec(q_spec[0], axis)
  local = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec),
                        out_specs=q_spec, check_vma=False)
  return local(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, segment_ids_BxL.astype(jnp.int32))


def _ring_local(q_BxCxHxD, k_BxCxKxD, v_BxCxKxD, ids_BxC, *, axis, n: int, scale: float):
  """One device's block of ``C`` queries against the ``n`` blocks of keys and values, which
  arrive one a step from the previous device on the ring."""
  b, c, h, d = q_BxCxHxD.shape
  kv = k_BxCxKxD.shape[2]
  i = jax.lax.axis_index(axis)
  ids_all_BxL = jax.lax.all_gather(ids_BxC, axis, axis=1, tiled=True)  # small: one int a position
  q_BxKxGxCxD = q_BxCxHxD.reshape(b, c, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
  q_index_C = i * c + jnp.arange(c)
  m = jnp.full((b, kv, h // kv, c), _MASKED, jnp.float32)
  l = jnp.zeros((b, kv, h // kv, c), jnp.float32)
  acc = jnp.zeros((b, kv, h // kv, c, d), jnp.float32)
  perm = [(j, (j + 1) % n) for j in range(n)]
  for s in range(n):
    j = (i - s) % n  # the device whose keys and values this step holds
    k_ids_BxC = jax.lax.dynamic_slice_in_dim(ids_all_BxL, j * c, c, axis=1)
    k_index_C = j * c + jnp.arange(c)
    mask_BxCxC = ((ids_BxC[:, :, None] == k_ids_BxC[:, None, :]) & (k_ids_BxC[:, None, :] > 0)
                  & (q_index_C[:, None] >= k_index_C[None, :])[None])
    m, l, acc = _merge_block(q_BxKxGxCxD, k_BxCxKxD, v_BxCxKxD, mask_BxCxC, m, l, acc, scale)
    if s < n - 1:
      k_BxCxKxD, v_BxCxKxD = jax.lax.ppermute((k_BxCxKxD, v_BxCxKxD), axis, perm)
  out = (acc / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, c, h, d)
  return out.astype(v_BxCxKxD.dtype)


@functools.partial(jax.checkpoint, static_argnums=(7,))
def _merge_block(q_BxKxGxCxD, k_BxTxKxD, v_BxTxKxD, mask_BxCxT, m, l, acc, scale: float):
  """Online softmax: the running max ``m``, sum ``l`` and output ``acc`` with one block of keys
  merged in (checkpointed: the backward recomputes the block's scores instead of keeping them).
  A query that has seen only masked keys carries a meaningless sum until its first real key,
  whose larger score scales it away (``alpha`` 0)."""
  s = jnp.einsum("bkgcd,btkd->bkgct", q_BxKxGxCxD.astype(k_BxTxKxD.dtype), k_BxTxKxD,
                 preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask_BxCxT[:, None, None], s, _MASKED)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[..., None])
  pv = jnp.einsum("bkgct,btkd->bkgcd", p.astype(v_BxTxKxD.dtype), v_BxTxKxD,
                  preferred_element_type=jnp.float32)
  return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv
