"""The sampler's own copy of the weights, in the layout its programs read, made once per version.

Callers (the learner's publisher, a checkpoint, a weight transfer) hand the engine a pure
per-layer parameter dict in the model's own layout, sharded like the model on the sampler mesh
(``param_shardings``). The engine holds it converted, in one jitted pass per weight version:

  * q/k/v and gate/up fused into one weight each when the engine decodes with fused projections
    (``kernels.choice.projections``; ``transformer.fuse_projections``);
  * matmul weights and the embedding in the compute dtype (norm scales and biases stay float32;
    the model casts what it reads anyway, so the results are the same); the learner's float32
    master weights are not touched;
  * the logits computed vocabulary-major where the platform's sampling reads them so
    (``kernels.choice.vocab_major_logits``: a form of the LM head's matmul, not a conversion);
  * the layers stacked ``[n_layers, ...]`` when they run in a scan (``decode_scan.stack_layers``),
    or the matmul weights packed for the CPU kernel (``cpu_matmul``: one CPU device, float32).

With LoRA the engine keeps the base weights it was built with (in the compute dtype; a base
already in that dtype on this mesh is the caller's array, not a copy) and also accepts adapters,
merged into that base and converted in one program (no merged copy beside the held one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from areal_jax import program_memory, sharding
from areal_jax.kernels import cpu_matmul
from areal_jax.models import decode_scan
from areal_jax.models import lora as lora_lib
from areal_jax.models.transformer import Transformer, cast_weights, fuse_projections


class HeldWeights:
  """Layout, shardings and conversion of the weights an engine holds (see the module docstring).

  ``cfg`` / ``graphdef``: the model the held weights belong to (fused projections or not);
  ``param_shardings``: what ``put`` takes; ``shardings``: what it returns."""

  def __init__(self, model: Transformer, mesh: Mesh, *, fused: bool, stacked: bool, packed: bool,
               lora: lora_lib.LoraConfig | None = None, vocab_major_logits: bool = False):
    given = model.cfg
    self.cfg = dataclasses.replace(
        given, fused_projections=fused or given.fused_projections,
        vocab_major_logits=vocab_major_logits or given.vocab_major_logits)
    held = model if self.cfg == given else nnx.eval_shape(
        lambda: Transformer(self.cfg, nnx.Rngs(0)))
    self.graphdef = nnx.graphdef(held)
    self.param_shardings = sharding.param_shardings(model, mesh)
    self.param_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                     nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    self.shardings = sharding.param_shardings(held, mesh)
    fuse = ((lambda params: fuse_projections(params, given))
            if self.cfg.fused_projections != given.fused_projections else None)
    dtype = self.compute_dtype = jnp.dtype(given.compute_dtype)
    if packed:  # one CPU device, float32: packed, never stacked
      which = cpu_matmul.packable(nnx.to_pure_dict(nnx.state(held, nnx.Param)))
      self.shardings = jax.tree.map(
          lambda sh, pack: NamedSharding(mesh, P()) if pack else sh, self.shardings, which)
      steps = [fuse, lambda params: cpu_matmul.pack_params(params, which)]
    else:
      if stacked:
        self.shardings = decode_scan.stacked_shardings(self.shardings)
      steps = [fuse, None if dtype == jnp.float32 else lambda params: cast_weights(params, dtype),
               decode_scan.stack_layers if stacked else None]
    steps = [f for f in steps if f is not None]

    def convert(params):
      for f in steps:
        params = f(params)
      return params

    self._steps = convert
    self._convert = jax.jit(convert, out_shardings=self.shardings) if steps else None
    self.lora_base, self._merge, self.adapter_shapes = None, None, None
    if lora is not None:
      # an eager cast and placement: a base already in the compute dtype on this mesh is shared
      self.lora_base = jax.device_put(
          lora_lib.frozen_base(nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype),
          self.param_shardings)
      # the merge and the conversion in one program: no merged copy in the model's layout beside
      # the held one it becomes (compiled at the Qwen3-1.7B shape: no temporaries for a v5e chip,
      # 0.05 GiB for an H100, against 3.21 GiB merged first; XLA:CPU keeps float32 ones)
      self._merge_steps = lambda base, adapters: convert(lora_lib.merge(base, adapters, lora))
      self._merge = jax.jit(self._merge_steps, out_shardings=self.shardings)
      self.adapter_shapes = lora_lib.abstract_adapters(self.param_shapes, lora,
                                                       NamedSharding(mesh, P()))

  def incoming_bytes(self, dtype=None, temp=None) -> int:
    """Bytes per device of a weight version as ``put`` takes it, before the conversion: the model's
    layout on ``param_shardings``, its matmul weights, embedding and biases in ``dtype`` (the
    compute dtype by default: what a transfer that casts before its copy delivers, and with LoRA
    the base merged with the adapters), norm scales float32. A swap holds it beside the held
    version it becomes until ``put`` returns. With LoRA: the adapters and the temporaries of the
    program merging and converting them, ``temp(fn, base, adapters)`` (default: compiled for this
    mesh; bench/aot_decode.py compiles ``fn`` for another device)."""
    if self._merge is not None:  # adapters come in, merged and converted in one program
      args = (self.lora_base, self.adapter_shapes)
      needed = (temp(self._merge_steps, *args) if temp is not None else
                program_memory.cost(self._merge.lower(*args), args)["temp"])
      return sharding.device_bytes(self.adapter_shapes) + needed
    dtype = self.compute_dtype if dtype is None else jnp.dtype(dtype)
    shapes = jax.eval_shape(lambda p: cast_weights(p, dtype), self.param_shapes)
    return sharding.device_bytes(jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
        self.param_shardings))

  def shapes(self, params: dict) -> dict:
    """The held weights' shapes and dtypes for ``params`` (arrays or shapes in the model's
    layout), without converting anything."""
    return jax.eval_shape(self._steps, params)

  def hold_in(self, formats) -> None:
    """From now on ``put`` returns the weights in ``formats`` (a tree of ``jax`` ``Format``:
    layouts with the held shardings, ``kernels.choice.held_layouts``)."""
    self._convert = jax.jit(self._steps, out_shardings=formats)
    if self._merge is not None:
      self._merge = jax.jit(self._merge_steps, out_shardings=formats)

  def put(self, params: dict) -> dict:
    """``params`` (a pure parameter dict in the model's layout, or with LoRA its adapters) placed
    on the sampler mesh and converted to the held layout; the caller's arrays are left as they
    are."""
    if self._merge is not None and lora_lib.is_adapters(params):
      return self._merge(self.lora_base, params)
    placed = jax.device_put(params, self.param_shardings)
    return placed if self._convert is None else self._convert(placed)
