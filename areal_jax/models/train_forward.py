"""The training forward of a ``Transformer`` with rematerialised and scanned layers.

``hidden(model, tokens_BxL, positions_BxL, segment_ids_BxL, remat=..., scan=...)`` is the model's
full causal forward over packed rows up to the final norm (``[B, L, E]``), and ``head_weight``
gives the LM head, so a learner can compute the head itself (in chunks). The parameter layout is
the model's own (``Transformer.layers`` stays a list of Blocks): the scan runs over a stacked view
built here, inside the traced function, and gradients flow back to each Block's parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.kernels import choice
from areal_jax.kernels import context_attention as context_kernels
from areal_jax.models.transformer import Transformer, rope_tables, row_attention

REMAT_POLICIES = ("none", "full", "dots", "offload")


def remat_policy(name: str):
  """The ``jax.checkpoint`` policy of a named rematerialisation setting (None for ``"none"``).

  ``full``: a layer keeps only its input, everything else is recomputed in the backward pass;
  ``dots``: the outputs of matmuls without batch dimensions (the projections) are kept, the
  elementwise work and attention recomputed; ``offload``: like ``dots`` but the kept outputs go to
  pinned host memory (backends with a host memory space: TPU, GPU; XLA:CPU compiles it as
  ``dots``)."""
  policies = jax.checkpoint_policies
  if name == "none":
    return None
  if name == "full":
    return policies.nothing_saveable
  if name == "dots":
    return policies.dots_with_no_batch_dims_saveable
  if name == "offload":
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  raise ValueError(f"remat={name!r} is not one of {REMAT_POLICIES}")


def hidden(model: Transformer, tokens_BxL, positions_BxL=None, segment_ids_BxL=None,
           remat: str = "none", scan: bool = False, attention: str = "auto",
           context_attention: str = "auto"):
  """Final-normed hidden states ``[B, L, E]`` of ``model(tokens_BxL, positions_BxL,
  segment_ids_BxL)`` (the same computation up to the LM head).

  ``remat`` names a ``remat_policy`` applied per layer (``jax.checkpoint``). ``scan``: the layers
  run as one ``lax.scan`` over a stacked ``[n_layers, ...]`` view of their parameters, so the
  compiled program holds one layer whatever the depth (on XLA:CPU remat only saves memory then:
  unrolled, the checkpointed layers are scheduled without regard to it). ``attention``: the
  causal attention (``transformer.row_attention``): on GPU and TPU by default a flash kernel,
  which holds no ``L x L`` mask or scores. Where the active mesh splits the rows' positions (its
  ``context`` axis), the attention runs across the devices as ``context_attention`` asks
  (``kernels.choice.context_attention``: Ulysses around that attention, or a ring)."""
  b, l = tokens_BxL.shape
  if positions_BxL is None:
    positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  attend_with, seen = _row_attention(model.cfg, segment_ids_BxL, b, l, attention,
                                     context_attention)
  x = model._embed(tokens_BxL)
  rope_BxLxF = rope_tables(positions_BxL, model.cfg.head_dim, model.cfg.rope_theta)
  graphdef = nnx.graphdef(model.layers[0])

  def layer(state, x_BxLxE, rope_BxLxF, seen):
    block = nnx.merge(graphdef, state)
    return block(x_BxLxE, rope_BxLxF, attend_with(seen))

  if remat != "none":
    layer = jax.checkpoint(layer, policy=remat_policy(remat), prevent_cse=not scan)
  states = [nnx.state(block) for block in model.layers]
  if scan:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    x, _ = jax.lax.scan(lambda x, s: (layer(s, x, rope_BxLxF, seen), None), x, stacked)
  else:
    for state in states:
      x = layer(state, x, rope_BxLxF, seen)
  return model.final_norm(x)


def _row_attention(cfg, segment_ids_BxL, b: int, l: int, attention: str, context: str):
  """``transformer.row_attention``'s ``(attend_with, seen)``, across the devices that split the
  rows' positions when the active mesh does (``kernels.context_attention``)."""
  if context_kernels.shards(l) == 1:
    return row_attention(segment_ids_BxL, b, l, cfg.head_dim, attention)
  if segment_ids_BxL is None:  # one sequence a row
    segment_ids_BxL = jnp.ones((b, l), jnp.int32)
  if choice.context_attention(context, cfg.n_heads, l) == "ring":
    return (lambda ids: lambda q, k, v: context_kernels.ring(q, k, v, ids)), segment_ids_BxL
  attend_with, seen = row_attention(segment_ids_BxL, b, l, cfg.head_dim, attention)
  return (lambda s: lambda q, k, v: context_kernels.ulysses(q, k, v, attend_with(s))), seen


def head_weight(model: Transformer):
  """``(w, transpose_w)`` of the LM head in the compute dtype, for ``linear(x, w, transpose_w)``
  (a tied head is the embedding ``[V, E]``, transposed)."""
  if model.cfg.tie_embeddings:
    return model.embed[...].astype(model.cfg.compute_dtype), True
  return model.lm_head[...].astype(model.cfg.compute_dtype), False
