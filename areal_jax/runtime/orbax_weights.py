"""``weights.transfer="orbax"``: weight versions on storage, written by the learner, read by samplers.

The learner writes ``<path>/<version>/`` with Orbax, so any process (or machine, with a bucket
path) can read it. Orbax writes into ``<version>.orbax-checkpoint-tmp-*`` and renames it when
complete (on object stores, where rename is not atomic, it writes ``commit_success.txt`` last); a
version counts as published only when its directory has the final name *and* the commit file, so a
reader never sees a half-written or crashed save. Only the newest ``keep`` versions are kept. The
receiver restores into ``jax.ShapeDtypeStruct`` targets that carry the sampler's shardings
(``weight_versions.abstract_params``), so each sampler device reads its own shards straight from
storage. ``weight_transfer`` re-exports every public name here.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
import uuid

import jax
from etils import epath

from areal_jax.runtime import orbax_reads
from areal_jax.runtime.errors import RunDirError
from areal_jax.runtime.weight_versions import cast_target, caster, check_version, pure_dict

COMMIT_FILE = "commit_success.txt"  # written by Orbax when a save is finalized
_TMP_NAME = re.compile(r"^\d+\.orbax-checkpoint-tmp")


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
    check_version(version, self._latest)
    params = pure_dict(params)
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
    orbax_reads.install()
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
    orbax_reads.install()  # a damaged version's reads end before the next one is tried
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
        first = orbax_reads.without_spec(first).replace(f"{self.path}/", "")  # (named below)
        print(f"warning: weights version {v} under {self.path} is unreadable, skipped "
              f"({first[:240]}); the sampler keeps its current weights", file=sys.stderr, flush=True)
        if orbax_reads.verbose():
          traceback.print_exception(e, file=sys.stderr)
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
