"""Moving policy weights from the learner to the sampler.

Parameters cross components as an NNX pure dict (nested dicts of ``jax.Array``, e.g.
``nnx.to_pure_dict(nnx.state(model, nnx.Param))``). Two ways to move them, chosen by
``weights.transfer``:

* ``"device_put"``: one process. ``publish`` copies the tree onto the sampler mesh's shardings with
  ``jax.device_put`` (a real copy even when the meshes share devices, so the learner may donate or
  overwrite its buffers afterwards; cast first to the sampler's compute dtype when given one) and
  waits for the copy; ``fetch`` hands out that copy, ``send`` hands it over and keeps none.
* ``"orbax"``: the learner writes each version as an Orbax directory that any process (or machine,
  with a bucket path) can read, restored straight onto the sampler's shardings
  (``orbax_weights.py``).

Every transfer, and ``jax_transfer``'s publisher, casts a version to the JAX sampler's compute dtype
on the learner's devices before it leaves them, and receivers restore into targets of those dtypes
(``weight_versions.py``: ``version_dtype``, ``cast_target``).

``publish`` must have returned (or ``wait()`` been called after ``publish(..., wait=False)``) before
the version is announced to the sampler; the returned seconds feed the ``weight_publish_s`` metric.
"""

from __future__ import annotations

import os
import threading
import time

import jax
from flax import nnx

# What a version is, and the Orbax path, live in modules of their own; their public names are
# this module's too (callers use ``weight_transfer.<name>``).
from areal_jax.runtime.orbax_weights import (  # noqa: F401 (re-exported)
    COMMIT_FILE, OrbaxPublisher, OrbaxReceiver, OrbaxTransfer, StorageAnnouncer, list_versions)
from areal_jax.runtime.weight_versions import (  # noqa: F401 (re-exported)
    abstract_params, cast_target, caster, check_version, pure_dict, target_shardings,
    version_bytes, version_caster, version_dtype, version_target)


# ---- in-process: device_put ----------------------------------------------------------------------
class DevicePutTransfer:
  """Learner and sampler in one process: a copy onto the sampler's shardings, held for ``fetch``."""

  mode = "device_put"

  def __init__(self, shardings, dtype=None):
    """``dtype``: the matmul weights, embedding and biases are cast to it on the learner's devices
    before the copy (``models.transformer.cast_weights``: the sampler's compute dtype, the cast
    its engine would make itself, so it holds the same values): the copy on the sampler mesh is
    half the float32 one (a swap holds it beside the version it becomes). None: as given."""
    self.shardings = shardings
    self._cast = caster(dtype)
    self._lock = threading.Lock()
    self._version: int | None = None
    self._params = None
    self.last_publish_s = self.last_fetch_s = 0.0

  def publish(self, params, version: int, wait: bool = True) -> float:
    """Copies ``params`` onto the sampler mesh; returns the seconds it took (copy complete)."""
    t0 = time.perf_counter()
    with self._lock:
      check_version(version, self._version)
    params = pure_dict(params)
    if self._cast is not None:  # (on the learner's devices, in its shardings: a new array each)
      params = self._cast(params)
    out = jax.device_put(params, self.shardings, may_alias=False)
    jax.block_until_ready(out)  # always: a version is announced only once it is really there
    with self._lock:
      check_version(version, self._version)
      self._version, self._params = version, out
    self.last_publish_s = time.perf_counter() - t0
    return self.last_publish_s

  def wait(self) -> float:
    return 0.0

  def latest_version(self) -> int | None:
    with self._lock:
      return self._version

  def fetch(self, version: int | None = None) -> dict:
    """The published parameters, already on the sampler mesh (only the latest version is held,
    and none after ``send``, which hands its copy over)."""
    with self._lock:
      if self._version is None:
        raise LookupError("no weights have been published yet")
      if version is not None and version != self._version:
        raise LookupError(f"version {version} is not held (device_put keeps only the latest, "
                          f"{self._version})")
      if self._params is None:
        raise LookupError(f"version {self._version} was handed over by send(); none is held")
      self.last_fetch_s = 0.0
      return self._params

  def send(self, params, version: int) -> dict:
    """``publish`` then ``fetch``: the parameters of ``version`` on the sampler mesh, handed over:
    this transfer keeps no reference to them (a sampler converts them into the weights it holds,
    and a copy kept here would stay on every sampler device, in the learner's dtype, until the
    next version; ``fetch`` after ``send`` raises)."""
    self.publish(params, version)
    with self._lock:
      out, self._params = self._params, None
    return out

  def close(self) -> None:
    with self._lock:
      self._params = None


# ---- factory ------------------------------------------------------------------------------------
def build(weights, workdir, learner_mesh, sampler_mesh, params, shardings=None, dtype=None):
  """The transfer named by ``weights.transfer`` (config section ``weights``).

  ``params`` is the model (``nnx.Module``) or its ``nnx.State`` of ``nnx.Param`` variables, from
  which the sampler shardings are derived; with a pure dict, pass ``shardings`` (a pure dict of
  shardings on ``sampler_mesh``). ``learner_mesh`` only tells whether the two meshes share devices
  (``.colocated`` on the result); ``device_put`` copies in both cases. ``weights.path`` "" means
  ``<workdir>/weights``. ``dtype``: the cast before a version leaves the learner's devices
  (``version_dtype``), for either transfer.
  """
  if shardings is None:
    if not isinstance(params, (nnx.Module, nnx.State)):
      raise TypeError(f"weight_transfer.build: params is a {type(params).__name__}, which has no "
                      "logical axes to derive the sampler shardings from; pass the model, its "
                      "nnx.State of nnx.Param, or shardings= (a pure dict of shardings on the "
                      "sampler mesh)")
    shardings = target_shardings(params, sampler_mesh)
  if weights.transfer == "device_put":
    transfer = DevicePutTransfer(shardings, dtype)
  elif weights.transfer == "orbax":
    path = weights.path or os.path.join(os.fspath(workdir), "weights")
    transfer = OrbaxTransfer(path, weights.keep, abstract_params(params, shardings), dtype)
  else:
    raise ValueError(f"weights.transfer={weights.transfer!r}: in one process it is 'device_put' or "
                     "'orbax' ('jax_transfer' is for rollout workers, runtime.mode='ray')")
  same = learner_mesh is not None and (set(learner_mesh.devices.flat) == set(sampler_mesh.devices.flat))
  transfer.colocated = same
  return transfer
