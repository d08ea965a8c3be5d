"""Run checkpoints: learner state plus everything needed to resume exactly.

One Orbax ``CheckpointManager`` under ``<workdir>/checkpoints``, one step per policy version. Each
checkpoint holds two items:
  * ``state``: the learner's pytree (parameters, optimizer state, step), restored straight into the
    learner mesh's shardings;
  * ``meta``: JSON — policy version, data iterator state, the examples of groups admitted but not yet
    trained (redone first after a resume, so the data order is unchanged), the next group id,
    staleness counters and cumulative run statistics.
Orbax writes into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoint as the latest one; unfinished temporaries are ignored and cleaned up. A save that
fails after Orbax committed the step (a learner process lost at the save's last barrier) keeps it:
it is complete (:func:`committed`).

Damage (an interrupted copy of a workdir, another model's checkpoint, a full disk) is an expected
fault. ``restore_latest`` tries the checkpoints newest first and uses the first one that restores
completely and matches the config; each one that does not is moved aside (never deleted) as
``<step>.corrupt-<UTC time>`` with a one-line warning. A checkpoint whose arrays do not fit
because the run was restarted with other settings (``meta`` records the config each save ran with)
is not damage: it is left in place, and the restore stops naming the keys that differ. Faults a
person must act on raise :class:`RunDirError`, whose message is meant to be printed as is, without
a traceback.

With several learner processes (``runtime.learner_processes``) every process runs the same restore
and they agree on each checkpoint (unusable if any process found it so); only process 0 moves
directories aside.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from areal_jax.runtime import orbax_reads
from areal_jax.runtime.errors import RunDirError  # noqa: F401 (re-exported)

orbax_reads.install()  # a damaged checkpoint's reads end before the next one is tried

# What ``meta`` must hold for a resume to rewind the run consistently (written by trainer._save).
REQUIRED_META = ("version", "data_state", "next_group_id", "pending", "staleness", "totals")
_CORRUPT = re.compile(r"^\d+\.corrupt-")
# What Orbax writes into a step directory when it commits it (the last files of a save).
COMMIT_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")


def utc_tag() -> str:
  """``20261125T121503Z``: the suffix of directories moved aside."""
  return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def move_aside(path: str, suffix: str) -> str | None:
  """Renames ``path`` to ``<path><suffix>`` (a free name); returns the new path, None if absent."""
  if not os.path.lexists(path):
    return None
  dest, n = path + suffix, 1
  while os.path.lexists(dest):
    n += 1
    dest = f"{path}{suffix}.{n}"
  os.rename(path, dest)
  return dest


class Checkpointer:

  def __init__(self, workdir: str, keep: int, resume: bool = True, config=None,
               keep_every: int = 0):
    """Keeps the newest ``keep`` checkpoints, and with ``keep_every`` > 0 also every step that is a
    multiple of it (``train.keep_checkpoint_every``: a run's curve without all its checkpoints).
    ``resume=False`` moves existing checkpoints to ``checkpoints.old-<time>`` (kept) first.
    ``config`` (the run's): each save records it in ``meta``, so that a checkpoint whose arrays do
    not fit a later run's model is reported as written with other settings (the keys that
    differ), and kept in place, rather than set aside as damaged."""
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._settings = settings_of(config) if config is not None else None
    if not resume and os.path.isdir(self.directory) and os.listdir(self.directory):
      old = move_aside(self.directory, f".old-{utc_tag()}")
      print(f"train.resume=False: the previous checkpoints were moved to {old}", flush=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True,
                                           keep_period=keep_every if keep_every > 0 else None,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True)
    # Handlers named per item, so item_metadata can read the stored shapes before any array is read.
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=dict(
        state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()))

  @classmethod
  def of_run(cls, workdir: str, config, resume: bool) -> "Checkpointer":
    """The run's checkpointer: what it keeps from ``config.train`` (``keep_checkpoints``,
    ``keep_checkpoint_every``), ``config`` recorded with each save."""
    return cls(workdir, config.train.keep_checkpoints, resume=resume, config=config,
               keep_every=config.train.keep_checkpoint_every)

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Writes ``step`` completely or not at all: on failure the temporary directory is removed,
    earlier checkpoints are untouched and :class:`RunDirError` is raised."""
    before = self.steps()
    if self._settings is not None:
      meta = dict(meta, config=self._settings)
    try:
      self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave(meta)), force=True)
      self._mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      _quiet_orphaned_reads()
      self._discard_unfinished(step, keep_final=step in before)
      if committed(os.path.join(self.directory, str(step))):
        kept = f"checkpoint {step} was written completely before the failure and is kept"
      else:
        kept = (f"checkpoint {before[-1]} is intact" if before
                else "no checkpoint was written before")
      raise RunDirError(
          f"could not save checkpoint {step} under {self.directory}: {_reason(e, self.directory)}\n"
          f"The run stopped; {kept}. Fix the cause (disk space, permissions, the bucket) and rerun "
          "the same command to resume.") from e

  def _discard_unfinished(self, step: int, keep_final: bool) -> None:
    """Removes what a failed save of ``step`` left behind, so no later resume can trust it.

    The other item's writes may still be finishing in Orbax's background threads when the save
    raises (and recreate files under the temporary directory, even after a first look found it
    gone: seen once in CI): remove until it has stayed gone for a second. A step directory Orbax
    committed (:func:`committed`) is complete and kept: the failure came after the commit (in CI a
    learner process killed just after the rename failed process 0's last barrier, and removing the
    committed checkpoint, interrupted by the group's kill, left it half deleted).
    """
    try:
      self._mgr.wait_until_finished()
    except Exception:  # pylint: disable=broad-except  (the same failure, reported by the caller)
      pass
    quiet = 0
    for _ in range(150):
      leftovers = [os.path.join(self.directory, n) for n in os.listdir(self.directory)
                   if (n == str(step) and not keep_final
                       and not committed(os.path.join(self.directory, n)))
                   or n.startswith(f"{step}.orbax-checkpoint-tmp")]
      quiet = 0 if leftovers else quiet + 1
      if quiet >= 10:
        break
      for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
      time.sleep(0.1)
    self._mgr.reload()

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores ``step``, every array read and checked against ``abstract_state`` (shapes, dtypes,
    target shardings) and ``meta`` checked for :data:`REQUIRED_META`. Raises on any damage."""
    self._check_shapes(step, abstract_state)
    return self._read(step, abstract_state)

  def _read(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                          meta=ocp.args.JsonRestore()))
    state, meta = out["state"], out["meta"]
    jax.block_until_ready(state)
    _check_meta(step, meta)
    return state, meta

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """The newest usable checkpoint as ``(step, state, meta)``; None when the run has none.

    A checkpoint that fails :meth:`restore` is reported in one warning and moved aside as
    ``<step>.corrupt-<UTC time>``; then the next older one is tried. Raises
    :class:`RunDirError` when checkpoints exist (or were moved aside) but none is usable, and,
    leaving it in place, when one whose arrays do not fit was saved with settings other than the
    ``config`` given (:meth:`__init__`): it names the keys that differ.
    Several processes: each checkpoint is checked (its stored shapes), then read, by all of them,
    agreeing after each part (an Orbax read waits for every process at its end).
    """
    tried = []
    candidates = self.steps()
    _agree_on_steps(candidates, self.directory)
    for step in reversed(candidates):
      step_dir = os.path.join(self.directory, str(step))
      found, local, error = None, None, None
      for first, part in ((True, lambda: self._check_shapes(step, abstract_state)),
                          (False, lambda: self._read(step, abstract_state))):
        try:
          found = part()
        except Exception as e:  # pylint: disable=broad-except
          local, error = _reason(e, step_dir), e
          _quiet_orphaned_reads()
        reason = _agree(local)
        if reason is not None:
          break
      else:
        return (step, *found)
      # Arrays of other shapes may come from a run of other settings; unreadable files are damage.
      fits = not (first and isinstance(error, _DoesNotFit))
      changed = _agree(None if fits else self._settings_changed(step)) if first else None
      if changed is not None:  # not damage: a run of other settings wrote it
        raise RunDirError(
            f"checkpoint {step} in {self.directory} does not fit this run: {reason}. It was saved "
            f"with other settings: {changed}.\nRerun with the run's settings (its checkpoints "
            "are untouched), pass another --workdir, or rerun with --config.train.resume=False "
            "to start over (the old checkpoints are kept in checkpoints.old-<time>).")
      where = self._set_aside(step)
      tried.append(f"checkpoint {step}: {reason} ({where})")
      then = "trying an older one" if step > candidates[0] else "no older one"
      if jax.process_index() == 0 or local is not None:
        print(f"warning: checkpoint {step} is unusable: {reason}; {where}, {then}",
              file=sys.stderr, flush=True)
        if error is not None and orbax_reads.verbose():
          traceback.print_exception(error, file=sys.stderr)
    earlier = sorted(n for n in os.listdir(self.directory) if _CORRUPT.match(n))
    if not tried and not earlier:
      return None
    lines = tried or [f"only checkpoints moved aside earlier as damaged: {', '.join(earlier)}"]
    raise RunDirError(
        f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(lines) + "\n"
        "To start over, rerun with --config.train.resume=False (the old checkpoints are kept in "
        "checkpoints.old-<time>); or restore the checkpoints directory from a good copy and rerun.")

  def _set_aside(self, step: int) -> str:
    """Moves ``step`` aside as damaged (process 0; the others wait for it); says where."""
    where = "moved aside by learner process 0"
    if jax.process_index() == 0:
      try:
        moved = move_aside(os.path.join(self.directory, str(step)), f".corrupt-{utc_tag()}")
        where = (f"moved aside to {os.path.basename(moved)}" if moved
                 else "gone before it could be moved aside")
      except OSError as e:
        where = f"could not be moved aside ({e.strerror or e})"
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # noqa: PLC0415
      multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
    self._mgr.reload()
    return where

  def close(self) -> None:
    self._mgr.close()

  def _settings_changed(self, step: int) -> str | None:
    """The keys whose values differ between the settings ``step`` was saved with and this run's
    (``"model.source: 'tiny' then, 'small' now, ..."``); None when unknown (no ``config`` given,
    a checkpoint that recorded none, an unreadable ``meta``) or the same."""
    if self._settings is None:
      return None
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # pylint: disable=broad-except  (damage: reported as such)
      _quiet_orphaned_reads()
      return None
    then = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(then, dict):
      return None
    then, now = _dotted(then), _dotted(self._settings)
    # the model's and the adapters' keys first: what shapes the arrays
    keys = [k for k in then.keys() | now.keys() if then.get(k, _ABSENT) != now.get(k, _ABSENT)]
    keys.sort(key=lambda k: (not k.startswith(("model.", "actor.lora.")), k))
    if not keys:
      return None
    said = [f"{k}: {then.get(k, _ABSENT)!r} then, {now.get(k, _ABSENT)!r} now" for k in keys[:6]]
    return "; ".join(said) + (f"; and {len(keys) - 6} more" if len(keys) > 6 else "")

  def _check_shapes(self, step: int, abstract_state: Any) -> None:
    """Stored shapes and dtypes against the config's, before any array is read."""
    stored = self._mgr.item_metadata(step)["state"]
    stored = getattr(stored, "tree", stored)
    if stored is None:
      raise ValueError("state/_METADATA is missing or unreadable")
    want, have = _flat(abstract_state), _flat(stored)
    if set(want) != set(have):
      missing = sorted(set(want) - set(have), key=str)
      extra = sorted(set(have) - set(want), key=str)
      first = (missing or extra)[0]
      raise _DoesNotFit(f"its arrays do not match the config's model ({len(missing)} missing, "
                       f"{len(extra)} unexpected, e.g. state/{first})")
    for path, w in want.items():
      h = have[path]
      if tuple(h.shape) != tuple(w.shape) or jax.numpy.dtype(h.dtype) != jax.numpy.dtype(w.dtype):
        raise _DoesNotFit(f"state/{path} is {h.dtype}{list(h.shape)} in the "
                         f"checkpoint, the config's model needs {w.dtype}{list(w.shape)} "
                         "(a checkpoint of another model?)")


class _DoesNotFit(ValueError):
  """A checkpoint's stored arrays, read completely, are not the ones the config's model needs."""


def committed(step_dir: str) -> bool:
  """Whether Orbax committed ``step_dir`` (both of :data:`COMMIT_FILES` are there): a complete
  checkpoint, as opposed to one being written in place or half deleted."""
  return all(os.path.isfile(os.path.join(step_dir, n)) for n in COMMIT_FILES)


def _agree(reason: str | None) -> str | None:
  """Across the learner processes: None when every process found the checkpoint usable; else this
  process's reason, or which process found it unusable (that process's warning says why)."""
  if jax.process_count() == 1:
    return reason
  from jax.experimental import multihost_utils  # noqa: PLC0415
  bad = np.asarray(multihost_utils.process_allgather(np.int32(reason is not None))).reshape(-1)
  if reason is None and bad.any():
    return f"unusable on learner process {int(np.flatnonzero(bad)[0])} (its warning says why)"
  return reason


def _agree_on_steps(steps: list[int], directory: str) -> None:
  """Every learner process must see the same checkpoints (one shared filesystem)."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415
  mine = np.array([len(steps), steps[-1] if steps else -1, sum(steps)], np.int32)
  seen = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), 3)
  if (seen != seen[0]).any():
    raise RunDirError(
        f"the learner processes see different checkpoints in {directory} (count, newest step and "
        f"step sum per process: {seen.tolist()}): the workdir must be one filesystem that every "
        "learner host shares (a network or bucket path), not a local disk per host.")


def _flat(tree) -> dict[str, Any]:
  """Leaves by a path string that is the same for a list and a tuple, a dict key and an attribute."""
  def name(k):
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return {"/".join(name(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class _Absent:
  def __repr__(self):
    return "(absent)"


_ABSENT = _Absent()


def settings_of(config) -> dict:
  """A run's ``ConfigDict`` as plain JSON values, as a checkpoint's ``meta`` keeps it."""
  return json.loads(config.to_json_best_effort())


def _dotted(settings: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in settings.items():
    if isinstance(value, dict) and value:
      out.update(_dotted(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _check_meta(step: int, meta) -> None:
  if not isinstance(meta, dict):
    raise ValueError(f"meta/metadata holds a {type(meta).__name__}, not a dict")
  missing = [k for k in REQUIRED_META if k not in meta or (k == "data_state" and meta[k] is None)]
  if missing:
    raise ValueError(f"meta/metadata lacks {missing}")
  if meta["version"] != step:
    raise ValueError(f"meta/metadata says version {meta['version']}, the directory is step {step}")


def _quiet_orphaned_reads() -> None:
  """Drops the tracebacks of Orbax's orphaned reads and writes after a failure (kept with
  ``--verbosity=1``).

  :mod:`orbax_reads` ends the other reads of a failed Orbax call before its event loop closes; what
  it cannot reach (writes a failed save leaves in Orbax's background threads, an Orbax without its
  hook) would complete later into a closed loop, each printing "Event loop is closed" or "Exception
  ignored in <coroutine ...>" through ``sys.unraisablehook``. Other unraisable exceptions still
  reach the previous hook.
  Process-wide from the first failure on (checkpoint faults end or rewind the run anyway).
  """
  previous = sys.unraisablehook
  if getattr(previous, "quiets_orbax", False) or absl_logging.get_verbosity() >= 1:
    return

  def hook(unraisable):
    exc, obj = unraisable.exc_value, unraisable.object
    code = getattr(obj, "cr_code", None)
    if ((isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc))
        or "orbax" in getattr(code, "co_filename", "")):
      return
    previous(unraisable)

  hook.quiets_orbax = True
  sys.unraisablehook = hook
  # The write coroutines a failed save abandons are reported when collected.
  warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def _reason(e: BaseException, directory: str) -> str:
  """One line: the innermost cause of ``e`` (TensorStore nests them), paths relative to ``directory``."""
  causes = [e]
  while len(causes) < 10:
    nxt = causes[-1].__cause__ or (None if causes[-1].__suppress_context__ else causes[-1].__context__)
    if nxt is None:
      break
    causes.append(nxt)
  # TensorStore's useful line ("OUT_OF_RANGE: Error reading "x/0.0" ...") is the innermost cause;
  # the outer ones wrap it in a dump of the whole TensorStore spec.
  inner = causes[-1]
  text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
  if isinstance(inner, OSError) and inner.filename:
    text = f"{inner.strerror or type(inner).__name__}: {inner.filename}"
  text = text.replace(directory.rstrip("/") + "/", "").replace(directory, ".")
  ts = re.search(r'Error reading "([^"/]+)/[^"]*" in OCDBT database at local file "([^"]*)": (.*)', text)
  if ts:  # TensorStore names the array and the item directory, not the data file inside it
    text = f"{ts.group(2)}{ts.group(1)} is unreadable: {ts.group(3)}"
  text = orbax_reads.without_spec(text)
  if len(text) > 300:
    text = text[:297] + "..."
  return text
