"""Moving policy weights from the learner to the sampler.

Parameters cross components as an NNX pure dict (nested dicts of ``jax.Array``, e.g.
``nnx.to_pure_dict(nnx.state(model, nnx.Param))``). Two ways to move them, chosen by
``weights.transfer``:

* ``"device_put"``: one process. ``publish`` copies the tree onto the sampler mesh's shardings with
  ``jax.device_put`` (a real copy even when the meshes share devices, so the learner may donate or
  overwrite its buffers afterwards; cast first to the sampler's compute dtype when given one) and
  waits for the copy; ``fetch`` hands out that copy, ``send`` hands it over and keeps none.
* ``"orbax"``: the learner writes ``<path>/<version>/`` with Orbax, so any process (or machine, with a
  bucket path) can read it. Orbax writes into ``<version>.orbax-checkpoint-tmp-*`` and renames it
  when complete (on object stores, where rename is not atomic, it writes ``commit_success.txt``
  last); a version counts as published only when its directory has the final name *and* the commit
  file, so a reader never sees a half-written or crashed save. Only the newest ``keep`` versions
  are kept. The receiver restores into ``jax.ShapeDtypeStruct`` targets that carry the sampler's
  shardings, so each sampler device reads its own shards straight from storage.

Every transfer, and ``jax_transfer``'s publisher, casts a version to the JAX sampler's compute dtype
on the learner's devices before it leaves them (``version_dtype``: the cast the sampler's engine
would make itself, ``models.transformer.cast_weights``): a bfloat16 sampler receives (and Orbax
writes) half the bytes of the learner's float32, and holds the same values. Receivers restore into
targets of those dtypes (``cast_target``).

``publish`` must have returned (or ``wait()`` been called after ``publish(..., wait=False)``) before
the version is announced to the sampler; the returned seconds feed the ``weight_publish_s`` metric.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
import time
import uuid

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from areal_jax import sharding
from areal_jax.models import lora as lora_lib
from areal_jax.models.transformer import cast_weights
from areal_jax.runtime.errors import RunDirError

COMMIT_FILE = "commit_success.txt"  # written by Orbax when a save is finalized
_TMP_NAME = re.compile(r"^\d+\.orbax-checkpoint-tmp")


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


def _pure(params) -> dict:
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  return params


def _check_version(version: int, latest: int | None) -> int:
  if not isinstance(version, int) or version < 0:
    raise ValueError(f"version must be an int >= 0, got {version!r}")
  if latest is not None and version <= latest:
    raise ValueError(f"publish({version}): versions must increase (latest published is {latest})")
  return version


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
      _check_version(version, self._version)
    params = _pure(params)
    if self._cast is not None:  # (on the learner's devices, in its shardings: a new array each)
      params = self._cast(params)
    out = jax.device_put(params, self.shardings, may_alias=False)
    jax.block_until_ready(out)  # always: a version is announced only once it is really there
    with self._lock:
      _check_version(version, self._version)
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


# ---- across processes: Orbax -------------------------------------------------------------------
def list_versions(path) -> list[int]:
  """Published (finalized) versions under ``path``, ascending; tmp and unfinished dirs are ignored."""
  root = epath.Path(path)
  if not root.exists():
    return []
  out = []
  for child in root.iterdir():
    if child.name.isdigit() and child.is_dir() and (child / COMMIT_FILE).exists():
      out.append(int(child.name))
  return sorted(out)


class StorageAnnouncer:
  """The part of a ray-mode announcer (``send``, ``ticket``, ``drop``, ``close``) shared by those
  whose versions the workers find on storage themselves: nothing is handed to, or held for, a
  worker (the ``jax_transfer`` announcer registers a pull per worker instead)."""

  mode = "orbax"

  def ticket(self, slot: int, incarnation: int) -> None:  # pylint: disable=unused-argument
    return None

  def drop(self, slot: int) -> None:  # pylint: disable=unused-argument
    return None


class OrbaxPublisher:
  """Learner side: writes ``<path>/<version>/`` atomically and keeps the newest ``keep`` versions.

  One writer per directory, called from one thread (the learner's).
  """

  mode = "orbax"

  def __init__(self, path, keep: int = 2, dtype=None):
    """``dtype``: a version is cast to it on the learner's devices before it is written
    (``version_dtype``; its receivers restore into ``cast_target(target, dtype)``)."""
    if keep < 1:
      raise ValueError(f"weights.keep={keep} must be >= 1")
    self.path = epath.Path(path)
    self.keep = int(keep)
    self._cast = caster(dtype)
    self._ckptr = None  # created on the first publish
    self._latest: int | None = None
    self._pending: tuple[int, float] | None = None  # (version, perf_counter at publish start)
    self.last_publish_s = self.last_save_s = 0.0

  def publish(self, params, version: int, wait: bool = True) -> float:
    """Saves ``params`` as ``version``; returns the seconds the caller was blocked.

    With ``wait=False`` only the device-to-host copy blocks (the learner may then modify or donate
    its arrays); the write finishes in the background and the version becomes visible to readers
    when it is finalized. Call ``wait()`` before announcing the version.
    """
    t0 = time.perf_counter()
    self.wait()
    if self._ckptr is None:
      self._start(version)
    _check_version(version, self._latest)
    params = _pure(params)
    if self._cast is not None:
      params = self._cast(params)
    self._ckptr.save(self.path / str(version), params)
    self._pending = (version, t0)
    if wait:
      self.wait()
    self.last_publish_s = time.perf_counter() - t0
    return self.last_publish_s

  def wait(self) -> float:
    """Blocks until the pending save is finalized, then drops versions beyond the newest ``keep``."""
    if self._pending is None:
      return 0.0
    t0 = time.perf_counter()
    self._ckptr.wait_until_finished()
    version, started = self._pending
    self._pending = None
    if not (self.path / str(version) / COMMIT_FILE).exists():
      raise RuntimeError(f"Orbax finished saving version {version} under {self.path} but it is not "
                         f"finalized ({COMMIT_FILE} missing)")
    self._latest = version
    self.last_save_s = time.perf_counter() - started
    if jax.process_index() == 0:  # in a learner group (jax.distributed) one process deletes
      for old in list_versions(self.path)[:-self.keep]:
        _remove(self.path / str(old))
    return time.perf_counter() - t0

  def _start(self, first_version: int) -> None:
    """First publish of this process: clears leftovers of a crashed run, then opens the writer."""
    self.path.mkdir(parents=True, exist_ok=True)
    for child in list(self.path.iterdir()) if jax.process_index() == 0 else ():
      stale_tmp = bool(_TMP_NAME.match(child.name))
      # A resumed run republishes from its checkpoint's version: newer versions (and unfinished
      # directories) belong to the crashed timeline and must not be served.
      stale = child.name.isdigit() and (int(child.name) >= first_version
                                        or not (child / COMMIT_FILE).exists())
      if stale_tmp or stale:
        _remove(child)
    if jax.process_count() > 1:  # the others wait for process 0's cleanup
      from jax.experimental import multihost_utils  # noqa: PLC0415
      multihost_utils.sync_global_devices(f"areal_jax publisher start {first_version}")
    existing = list_versions(self.path)
    self._latest = existing[-1] if existing else None
    import orbax.checkpoint as ocp  # heavy import, only when Orbax is used
    self._ckptr = ocp.StandardCheckpointer()

  def latest_version(self) -> int | None:
    versions = list_versions(self.path)
    return versions[-1] if versions else None

  def close(self) -> None:
    self.wait()
    if self._ckptr is not None:
      self._ckptr.close()
      self._ckptr = None


class OrbaxReceiver:
  """Sampler side: restores a published version straight into the sampler's shardings."""

  mode = "orbax"

  def __init__(self, path, target):
    """``target``: pure dict of ``jax.ShapeDtypeStruct`` with ``sharding=`` (``abstract_params``)."""
    leaves = jax.tree.leaves(target)
    if not leaves or not all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                             for x in leaves):
      raise TypeError("target must be a tree of jax.ShapeDtypeStruct with sharding= set "
                      "(see abstract_params)")
    self.path = epath.Path(path)
    self.target = target
    import orbax.checkpoint as ocp
    self._ckptr = ocp.StandardCheckpointer()
    self.last_fetch_s = 0.0
    self.damaged: set[int] = set()  # published versions that failed to restore (skipped for good)

  def versions(self) -> list[int]:
    return list_versions(self.path)

  def latest_version(self) -> int | None:
    versions = list_versions(self.path)
    return versions[-1] if versions else None

  def fetch(self, version: int | None = None, retries: int = 3) -> dict:
    """Restores ``version`` (default: the latest) onto the sampler mesh.

    When no version is named and the chosen one is deleted by the publisher's retention while it
    is read, the newest version is tried again (up to ``retries`` times).
    """
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
      v = self.latest_version() if version is None else version
      if v is None:
        raise LookupError(f"no published weights under {self.path}")
      d = self.path / str(v)
      if not (d / COMMIT_FILE).exists():
        raise LookupError(f"version {v} is not published under {self.path} "
                          f"(published: {self.versions()})")
      try:
        params = self._ckptr.restore(d, self.target)
        break
      except Exception:  # deleted under us by retention: retry with the newest version
        if version is not None or attempt == retries or (d / COMMIT_FILE).exists():
          raise
    jax.block_until_ready(params)
    self.last_fetch_s = time.perf_counter() - t0
    return params

  def fetch_newer(self, current: int | None) -> tuple[int, dict] | None:
    """The newest readable version above ``current`` as ``(version, params)``; None if there is none.

    For a sampler polling the directory: a published version that cannot be restored (damaged
    files, another model's shapes) is reported in one warning and never tried again; older versions
    above ``current`` are tried next, and None means: keep the current weights until the next good
    version is published.
    """
    for v in reversed(self.versions()):
      if current is not None and v <= current:
        return None
      if v in self.damaged:
        continue
      try:
        return v, self.fetch(v)
      except LookupError:  # removed by the publisher's retention while listed: not damage
        continue
      except Exception as e:  # pylint: disable=broad-except
        if not (self.path / str(v) / COMMIT_FILE).exists():
          continue  # deleted under us by retention
        self.damaged.add(v)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cause = e.__cause__
        if cause is not None and str(cause).strip():  # TensorStore's useful line is the cause
          first = str(cause).strip().splitlines()[0]
        print(f"warning: weights version {v} under {self.path} is unreadable, skipped "
              f"({first[:240]}); the sampler keeps its current weights", file=sys.stderr, flush=True)
    return None

  def close(self) -> None:
    self._ckptr.close()


class OrbaxTransfer:
  """Both sides in one object (the runtime's single-process use of the Orbax path)."""

  mode = "orbax"

  def __init__(self, path, keep: int, target, dtype=None):
    """``target``: the learner's parameters' ``abstract_params``; ``dtype``: what a version is
    cast to before it is written (``OrbaxPublisher``), and restored as."""
    self.publisher = OrbaxPublisher(path, keep, dtype)
    self.receiver = OrbaxReceiver(path, cast_target(target, dtype))  # (idempotent)

  def publish(self, params, version: int, wait: bool = True) -> float:
    return self.publisher.publish(params, version, wait)

  def wait(self) -> float:
    return self.publisher.wait()

  def latest_version(self) -> int | None:
    return self.receiver.latest_version()

  def fetch(self, version: int | None = None) -> dict:
    return self.receiver.fetch(version)

  def send(self, params, version: int) -> dict:
    """``publish`` (finalized) then ``fetch``: the parameters of ``version`` on the sampler mesh.

    Fails with :class:`RunDirError` when the version cannot be written or read back (a full
    disk, permissions, a bucket error): the sampler must not run on weights other than announced.
    """
    try:
      self.publish(params, version)
      return self.fetch(version)
    except Exception as e:  # pylint: disable=broad-except
      cause = e.__cause__ if e.__cause__ is not None and str(e.__cause__).strip() else e
      first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
      raise RunDirError(
          f"could not publish weights version {version} under {self.publisher.path}: {first}\n"
          "The run stopped; its last checkpoint is intact. Fix the cause (disk space, permissions, "
          "the bucket) and rerun the same command to resume.") from e

  @property
  def last_publish_s(self) -> float:
    return self.publisher.last_publish_s

  @property
  def last_fetch_s(self) -> float:
    return self.receiver.last_fetch_s

  def close(self) -> None:
    self.publisher.close()
    self.receiver.close()


def _remove(path: epath.Path) -> None:
  """Deletes a version directory; on a local disk it first leaves the listing by an atomic rename."""
  try:
    if os.path.isdir(os.fspath(path)):
      hidden = path.parent / f".deleting-{path.name}-{uuid.uuid4().hex[:8]}"
      os.rename(os.fspath(path), os.fspath(hidden))
      path = hidden
  except (OSError, TypeError, NotImplementedError):
    pass
  if path.exists():
    path.rmtree() if path.is_dir() else path.unlink()


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
