"""What the command lines share: a fault the person running them can fix ends in one line.

launch.py, ``areal_jax.serve``, ``areal_jax.evaluate``, ``areal_jax.export`` and
``areal_jax.generate`` run their work under :func:`reported_faults`. A fault of what the person
gave them (settings that contradict each other or the devices, a model or checkpoint that is not
there or does not fit the config, task data that cannot be read, a damaged run directory, a memory
plan that cannot fit, ``rollout.backend='vllm'`` where vLLM is not installed) prints
``error: <message>`` on stderr, the message naming the key, file or line to change, and exits with
status 1. ``--verbosity=1`` (or more) raises it with its traceback instead. Any other exception is
a bug and keeps its traceback.

Each of them calls :func:`set_up_logging` first: the libraries' loggers (HTTP clients, Ray, Orbax
and TensorStore, JAX, absl's INFO of other modules) stay at WARNING and the project's own lines
(the ``areal_jax.*`` loggers) at the command's level, unless ``--verbosity`` asks for more.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import sys

from absl import flags, logging

from areal_jax.runtime.errors import fault_kinds, is_fault  # noqa: F401 (fault_kinds: re-exported)


# Libraries that set their own logger's level (the others inherit the root's, set to WARNING).
LIBRARY_LOGGERS = ("httpx", "httpcore", "openai", "urllib3", "ray", "jax", "jaxlib", "orbax",
                   "tensorstore", "absl", "uvicorn", "asyncio", "filelock", "matplotlib")


def verbosity_given() -> bool:
  """Whether the command line named ``--verbosity`` (``-v``): then every logger follows it."""
  return "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present > 0


def library_level() -> int:
  """The level of the libraries' loggers: WARNING, or what ``--verbosity`` asks for."""
  return std_logging.getLogger().getEffectiveLevel() if verbosity_given() else std_logging.WARNING


def set_up_logging(project_level: int = std_logging.WARNING) -> None:
  """A command line's logging: the root logger and every library's at WARNING, the project's own
  loggers (``areal_jax.*``) at ``project_level``. With ``--verbosity`` everything follows it."""
  if verbosity_given():
    return
  logging.set_verbosity(logging.WARNING)  # the root logger (absl's handler prints it)
  for name in LIBRARY_LOGGERS:
    std_logging.getLogger(name).setLevel(std_logging.WARNING)
  std_logging.getLogger("areal_jax").setLevel(project_level)


@contextlib.contextmanager
def reported_faults(*, quiet_exit: bool = False):
  """Runs the body; one of :func:`fault_kinds` raised in it ends the process as the module
  docstring says. ``quiet_exit``: stderr is closed after the message, so that the shutdown
  chatter of TensorStore's and asyncio's failed reads does not bury it."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if not is_fault(e) or logging.get_verbosity() >= 1:  # a bug; --verbosity=1
      raise
    print(f"error: {e}", file=sys.stderr, flush=True)
    if quiet_exit:
      os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(1)
