"""What a published weights version is: its dtype, the cast that makes it, and its restore targets.

Every transfer (``weight_transfer``, ``orbax_weights``, ``jax_transfer``) casts a version to the JAX
sampler's compute dtype on the learner's devices before it leaves them (:func:`version_dtype`: the
cast the sampler's engine would make itself, ``models.transformer.cast_weights``), so a bfloat16
sampler receives half the bytes of the learner's float32 weights and holds the same values.
Receivers restore into ``jax.ShapeDtypeStruct`` targets that carry the sampler's shardings, in the
dtypes a version arrives in (:func:`cast_target`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax import sharding
from areal_jax.models import lora as lora_lib
from areal_jax.models.transformer import cast_weights


# ---- shardings and targets ---------------------------------------------------------------------
def version_dtype(config) -> str | None:
  """The dtype a published version's matmul weights, embedding and biases are cast to on the
  learner's devices (``cast_weights``): the JAX sampler's compute dtype (``model.dtype``) where it
  receives whole weights, by any transfer; None otherwise (LoRA publishes adapters, vLLM loads
  its own)."""
  lora = lora_lib.LoraConfig.from_config(config.actor.get("lora"))
  return config.model.dtype if config.rollout.backend == "jax" and lora is None else None


def _cast_fn(dtype):
  """``cast_weights`` to ``dtype``, or None where there is nothing to cast (None, or the learner's
  float32)."""
  if dtype is None or jnp.dtype(dtype) == jnp.float32:
    return None
  return functools.partial(cast_weights, dtype=jnp.dtype(dtype))


def caster(dtype):
  """A jitted ``cast_weights`` to ``dtype`` (on the devices and in the shardings of its argument,
  a new array each), or None where there is nothing to cast (None, float32)."""
  fn = _cast_fn(dtype)
  return None if fn is None else jax.jit(fn)


def version_caster(config):
  """``caster(version_dtype(config))``: the program every published version runs through on the
  learner's devices (the learner's memory plan counts its copy); None where nothing is cast."""
  return caster(version_dtype(config))


def version_bytes(params, dtype) -> int:
  """Bytes of ``params`` (arrays or shapes) as a version cast by ``caster(dtype)`` holds them."""
  fn = _cast_fn(dtype)
  shapes = params if fn is None else jax.eval_shape(fn, params)
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def cast_target(target, dtype):
  """``target`` (``abstract_params``: restore targets with shardings) in the dtypes a version
  cast by ``caster(dtype)`` arrives in."""
  fn = _cast_fn(dtype)
  if fn is None:
    return target
  cast = jax.eval_shape(fn, target)
  return jax.tree.map(lambda t, c: jax.ShapeDtypeStruct(t.shape, c.dtype, sharding=t.sharding),
                      target, cast)


def target_shardings(params, mesh, rules=None) -> dict:
  """Pure dict of ``NamedSharding`` on ``mesh`` for a model's parameters.

  ``params`` is an ``nnx.Module`` or an ``nnx.State`` of its ``nnx.Param`` variables (which carry
  the logical ``axes`` metadata the shardings come from).
  """
  if not isinstance(params, (nnx.Module, nnx.State)):
    raise TypeError("target_shardings needs an nnx.Module or an nnx.State of nnx.Param variables "
                    f"(a pure dict has lost its logical axes), got {type(params).__name__}")
  return sharding.param_shardings(params, mesh, rules)


def abstract_params(params, shardings, dtype=None) -> dict:
  """``jax.ShapeDtypeStruct`` tree with ``sharding=``: the restore target on the receiving mesh,
  in the dtypes a version cast to ``dtype`` arrives in (``cast_target``; None: as ``params``)."""
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  return cast_target(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  params, shardings), dtype)


def version_target(model, mesh, lcfg=None, dtype=None) -> dict:
  """What a published version holds, as restore targets on ``mesh``: the model's parameters (cast
  to ``dtype``: :func:`version_dtype`), or with LoRA (``lcfg``) only the adapters (replicated),
  which the sampler merges into its base."""
  if lcfg is None:
    return abstract_params(model, target_shardings(model, mesh), dtype)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return lora_lib.abstract_adapters(nnx.to_pure_dict(nnx.state(model, nnx.Param)), lcfg, replicated)


def pure_dict(params) -> dict:
  """A model, or an ``nnx.State`` of its params, as an NNX pure dict (a pure dict as it is)."""
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  return params


def check_version(version: int, latest: int | None) -> int:
  """``version`` if it is an int above ``latest`` (the last published), else ``ValueError``."""
  if not isinstance(version, int) or version < 0:
    raise ValueError(f"version must be an int >= 0, got {version!r}")
  if latest is not None and version <= latest:
    raise ValueError(f"publish({version}): versions must increase (latest published is {latest})")
  return version
