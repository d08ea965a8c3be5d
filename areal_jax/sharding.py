"""Device meshes and logical-axis sharding.

Parameters and activations are annotated with *logical* axis names ("embed", "heads", "batch", ...).
A rule table maps each logical name to mesh axes ("data", "fsdp", "context", "tensor"), so the same
model runs replicated, FSDP-sharded, context-parallel (a row's positions split over ``context``) or
tensor-parallel by changing the config, not the code.

A dimension that a mesh axis does not divide evenly is replicated instead of sharded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None to replicate).
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp"),
    "length": "context",  # a row's positions (the learner's context parallelism)
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context"),  # context devices hold parts of the weights too, as fsdp's
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    # KV cache of the sampler: slots over data, heads over tensor
    "cache_batch": ("data", "fsdp"),
    "cache_heads": "tensor",
}

_CONTEXT: contextvars.ContextVar[tuple[Mesh, Mapping] | None] = contextvars.ContextVar(
    "areal_jax_sharding", default=None)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes ``MESH_AXES``; ``shape`` gives each size (missing = 1). The ``"context"``
  axis is left out where its size is 1 (only a context-parallel learner's mesh has it; the rules
  skip axes a mesh does not have)."""
  unknown = set(shape) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid axes: {MESH_AXES}")
  names = tuple(a for a in MESH_AXES if a != "context" or int(shape.get(a, 1)) != 1)
  sizes = tuple(int(shape.get(a, 1)) for a in names)
  devices = list(jax.devices() if devices is None else devices)
  need = int(np.prod(sizes))
  if need != len(devices):
    raise ValueError(f"mesh {dict(zip(names, sizes))} needs {need} devices, got {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes), names)


def split_mesh(mesh: Mesh, axis: str) -> list[Mesh]:
  """One mesh per index of ``mesh``'s axis ``axis`` (that axis of size 1 in each, the others
  kept)."""
  k = mesh.axis_names.index(axis)
  return [Mesh(np.take(mesh.devices, [i], axis=k), mesh.axis_names)
          for i in range(mesh.devices.shape[k])]


def spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
         rules: Mapping | None = None) -> P:
  """PartitionSpec for an array of ``shape`` whose dimensions carry ``logical`` names."""
  rules = DEFAULT_RULES if rules is None else rules
  used: set[str] = set()
  out = []
  for name, dim in zip(logical, shape):
    axes = rules.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or dim % size:
      out.append(None)
      continue
    used.update(axes)
    out.append(axes[0] if len(axes) == 1 else axes)
  return P(*out)


@contextlib.contextmanager
def use(mesh: Mesh, rules: Mapping | None = None):
  """Activates activation constraints (``constrain``) for code traced inside the block."""
  token = _CONTEXT.set((mesh, DEFAULT_RULES if rules is None else rules))
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside ``use(...)``."""
  ctx = _CONTEXT.get()
  if ctx is None:
    return x
  mesh, rules = ctx
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(logical, x.shape, mesh, rules)))


def current() -> tuple[Mesh, Mapping] | None:
  """The ``(mesh, rules)`` of the active ``use(...)``, or None outside it."""
  return _CONTEXT.get()


def num_shards(logical: str, dim: int) -> int:
  """Number of devices a dimension of size ``dim`` named ``logical`` is split over under the
  active ``use(...)`` (1 outside it)."""
  ctx = _CONTEXT.get()
  if ctx is None:
    return 1
  mesh, rules = ctx
  axes = spec((logical,), (dim,), mesh, rules)[0]
  axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping | None = None):
  """NamedShardings for an NNX state whose Variables carry ``axes`` metadata."""

  def one(var):
    axes = var.get_metadata().get("axes") or (None,) * var.ndim
    return NamedSharding(mesh, spec(axes, var.shape, mesh, rules))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(params, mesh: Mesh, rules: Mapping | None = None) -> dict:
  """Pure dict of ``NamedSharding`` on ``mesh`` for a model's parameters: ``params`` is an
  ``nnx.Module`` (maybe abstract) or an ``nnx.State`` of its ``nnx.Param`` variables, whose
  ``axes`` metadata the shardings come from."""
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  return nnx.to_pure_dict(shardings_to_values(state_shardings(params, mesh, rules)))


def put(tree, shardings):
  """``jax.device_put(tree, shardings)``, also when the shardings span several processes
  (``jax.distributed``): there each process builds its own shards of a global array from the host
  value (the same on every process); an array already global is resharded by a jitted copy."""
  leaves = jax.tree.leaves(shardings)
  if all(s.is_fully_addressable for s in leaves):
    return jax.device_put(tree, shardings)

  def one(x, s):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x if x.sharding.is_equivalent_to(s, x.ndim) else jax.jit(lambda a: a, out_shardings=s)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

  return jax.tree.map(one, tree, shardings)


def global_rows(arrays: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict:
  """Host arrays (the same on every process) as arguments for a jitted function sharded by
  ``sharding``: unchanged when the mesh is this process's alone (jit places numpy itself); when it
  spans several processes (``jax.distributed``), global arrays built from this process's slices."""
  if sharding.is_fully_addressable:
    return dict(arrays)
  return {k: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx])
          for k, x in arrays.items()}


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping | None = None) -> nnx.Module:
  """Places every parameter of ``model`` on ``mesh`` according to its logical axes (in place)."""
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  values = jax.device_put(nnx.to_pure_dict(state), nnx.to_pure_dict(shardings_to_values(shardings)))
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)
  return model


def shardings_to_values(tree):
  """Unwraps Variables holding shardings into a plain pytree of shardings."""
  return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def device_bytes(tree) -> int:
  """Bytes one device holds of a tree of arrays or ``ShapeDtypeStruct``s with shardings (the
  fullest device's shard of each leaf; a leaf without a sharding counts whole)."""
  total = 0
  for x in jax.tree.leaves(tree):
    sh = getattr(x, "sharding", None)
    shape = sh.shard_shape(x.shape) if sh is not None else x.shape
    total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total
