"""What the command lines share: a fault the person running them can fix ends in one line.

launch.py, ``areal_jax.serve``, ``areal_jax.evaluate``, ``areal_jax.export`` and
``areal_jax.generate`` run their work under :func:`reported_faults`. A fault of what the person
gave them (settings that contradict each other or the devices, a model or checkpoint that is not
there or does not fit the config, task data that cannot be read, a damaged run directory, a memory
plan that cannot fit, ``rollout.backend='vllm'`` where vLLM is not installed) prints
``error: <message>`` on stderr, the message naming the key, file or line to change, and exits with
status 1. ``--verbosity=1`` (or more) raises it with its traceback instead. Any other exception is
a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import logging

from areal_jax.runtime.errors import fault_kinds, is_fault  # noqa: F401 (fault_kinds: re-exported)


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
