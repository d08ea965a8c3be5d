"""Expected faults of a run directory, and the list of every fault a person fixes (see cli.py)."""

import os
import traceback


class RunDirError(RuntimeError):
  """A damaged or unwritable checkpoint or weights directory; the message says what to do."""


def make_run_dir(workdir: str) -> None:
  """Creates ``workdir`` (and its parents) if need be; one that cannot be created (a file in the
  way, a parent without permission) or written to is a :class:`RunDirError` naming it."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise RunDirError(f"--workdir={workdir} is a file, not a directory; pass a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise RunDirError(f"--workdir={workdir}: cannot create the run directory "
                      f"({e.strerror or e}); pass a directory this user can write") from e
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise RunDirError(f"--workdir={workdir}: the run directory is not writable by this user; "
                      "pass one that is")


# Exit status of a training process whose learner group lost a process: the supervisor
# (``supervisor.py``) reruns it, and it resumes from its last checkpoint (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
# Exit status of a process stopped by one of :func:`fault_kinds` (a checkpoint saved with other
# settings, a memory plan that cannot fit): its supervisor does not restart it, since the same
# settings would fail the same way (EX_CONFIG).
FAULT_EXIT_CODE = 78


class LearnerProcessDied(RuntimeError):
  """A process of the learner group exited or lost its connection; the group was torn down."""


def fault_kinds() -> tuple[type[BaseException], ...]:
  """The exceptions a person fixes by changing what they passed: the command lines print them in
  one line (``cli.reported_faults``); raised in another process (a learner process, a rollout
  worker, the serve trainer process) they come back under their own type (:func:`remote_error`)
  and that process is not restarted into the same fault. Imported when asked: the checkpoint errors' module imports JAX, which launch.py and serve import
  late on purpose."""
  # pylint: disable=import-outside-toplevel
  from areal_jax.config import ConfigError
  from areal_jax.models import CheckpointError
  from areal_jax.tasks.data import DataError
  from areal_jax.vllm_rollout.env import VllmNotInstalledError  # (imports no vLLM)
  return (ConfigError, CheckpointError, DataError, RunDirError, MemoryError, VllmNotInstalledError)


def is_fault(error: BaseException) -> bool:
  """One of :func:`fault_kinds`, with a message to print (a bare MemoryError is the host running
  out of memory, not a plan of ours: it keeps its traceback)."""
  return isinstance(error, fault_kinds()) and bool(str(error))


def error_fields(error: BaseException) -> tuple[list[str], str, str]:
  """What another process needs to raise ``error`` again (:func:`remote_error`): the names of its
  class and bases, its message and the traceback being handled (call it in the ``except``)."""
  return [c.__name__ for c in type(error).__mro__], str(error), traceback.format_exc()


_BUILTIN_ERRORS = (FloatingPointError, ValueError, MemoryError, TypeError, LookupError, OSError,
                   NotImplementedError, RuntimeError)


def remote_error(where: str, types, message: str, traceback_text: str = "") -> Exception:
  """The error ``where`` (e.g. "learner process 1") reported by :func:`error_fields`, to raise
  here: the first of its class and bases (``types``; or one name) that is one of
  :func:`fault_kinds` (printed by the command lines in one line) or a builtin error, else
  RuntimeError. The message starts with ``where`` (and the original type when it is not kept);
  the other process's traceback is a note, shown only with this one's. A fault kind without a
  message (a bare MemoryError: that host ran out of memory) is not a fault here either
  (:func:`is_fault`): it comes back as RuntimeError, so its traceback is printed."""
  types = [types] if isinstance(types, str) else list(types)
  known = {c.__name__: c for c in (*fault_kinds(), *_BUILTIN_ERRORS)}
  kind = next((known[n] for n in types if n in known), RuntimeError)
  if not message.strip() and issubclass(kind, fault_kinds()):
    kind, message = RuntimeError, "(no message)"
  error = kind(f"{where}: {message}" if kind.__name__ == types[0] else
               f"{where}: {types[0]}: {message}")
  if traceback_text:
    error.add_note(f"{where}'s traceback:\n{traceback_text.rstrip()}")
  return error
