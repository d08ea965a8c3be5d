"""Orbax's failed reads end before the caller moves on: no orphaned read prints anything later.

Orbax runs each restore, metadata read and save as one coroutine in a fresh event loop that it
closes when the coroutine returns. The coroutine gathers one TensorStore operation per array, so
when one array fails (a truncated file, a bucket that times out) the others are still in flight:
they complete later into the closed loop and each prints ``RuntimeError: Event loop is closed`` or
``Task exception was never retrieved`` with a TensorStore traceback, hundreds of lines after the
one warning that matters. :func:`install` makes a failed run cancel what is still pending and await
it, and consume the exceptions of all its tasks, before the loop is closed. A run that succeeds is
unchanged.

Process-wide and idempotent: the checkpoint and weight-version readers install it on import. It
replaces one private function of ``orbax.checkpoint._src.asyncio_utils`` (the version pinned in
requirements.lock); with an Orbax that lacks it nothing is replaced.
"""

from __future__ import annotations

import asyncio
import functools
import re


def install() -> bool:
  """Settles failed Orbax runs as the module docstring says; False when this Orbax has no hook."""
  try:
    from orbax.checkpoint._src import asyncio_utils  # noqa: PLC0415
  except ImportError:
    return False
  original = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
  if original is None:
    return False
  if getattr(original, "settles_failed_reads", False):
    return True

  @functools.wraps(original)
  def run(coro):
    loop = asyncio.new_event_loop()
    tasks = []  # every task of this run: a failed one may have finished unseen (see _settle)

    def factory(loop, coro, **kwargs):
      task = asyncio.Task(coro, loop=loop, **kwargs)
      tasks.append(task)
      return task

    loop.set_task_factory(factory)
    try:
      asyncio.set_event_loop(loop)
      try:
        return loop.run_until_complete(coro)
      except Exception:
        _settle(loop, tasks)
        raise
    finally:
      asyncio.set_event_loop(None)
      loop.close()

  run.settles_failed_reads = True
  asyncio_utils._run_sync_via_new_loop = run  # pylint: disable=protected-access
  return True


def _settle(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task]) -> None:
  """Cancels the tasks still pending in ``loop`` and waits for them, then marks every failed task's
  exception retrieved (the caller reports the first failure). A task can fail in the loop's last
  pass, after the gather it belongs to stopped listening: the callback that would have retrieved
  its exception never runs, and Python logs the task when it is collected."""
  pending = [t for t in tasks if not t.done()]
  for task in pending:
    task.cancel()
  if pending:
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
  for task in tasks:
    if not task.cancelled():
      task.exception()


def without_spec(text: str) -> str:
  """``text`` without the ``[tensorstore_spec='{...}']`` TensorStore appends to its errors (the
  whole spec as JSON: nothing a person reads)."""
  return re.sub(r"\s*\[tensorstore_spec=.*$", "", text)


def verbose() -> bool:
  """``--verbosity=1`` or more: a warning about a damaged read is followed by its traceback."""
  from absl import logging  # noqa: PLC0415
  return logging.get_verbosity() >= 1
