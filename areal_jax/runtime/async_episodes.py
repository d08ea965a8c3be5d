"""Async episodes: ``async def run`` workflows, all on one asyncio event loop of their own thread.

An episode is a coroutine on the loop; it awaits its turns (``AsyncTurnClient.generate``), its
environment and its reward, so one thread holds thousands of episodes that wait on tools.
Nothing on the loop blocks: a turn's request goes to the engine from the ``turn-submit`` thread
(an engine's ``submit`` may wait for its own locks), and the sample comes back from the
controller's thread through ``call_soon_threadsafe``. At most ``max_episodes`` training episodes
run at once (an asyncio semaphore; the others of the admitted groups wait for a place);
evaluation episodes do not wait for one.

Stop: ``shutdown`` wakes every waiting turn with ``Stopped``, cancels every episode still running
(an episode's ``finally`` runs: environments close) and ends the loop. An episode's unexpected
exception goes to ``on_error`` (the run stops), as with blocking episodes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

from areal_jax.rollout_api import RolloutEngine, Sample, SamplingParams
from areal_jax.runtime.episode_stats import EpisodeStats
from areal_jax.runtime.episodes import Runner, Stopped, TurnClient

CANCEL_WAIT_S = 10.0  # how long a stop waits for cancelled episodes' cleanup


def _settle_async(future: asyncio.Future, result) -> None:
  if future.done():  # (cancelled meanwhile)
    return
  if isinstance(result, BaseException):
    future.set_exception(result)
  else:
    future.set_result(result)


class AsyncTurnClient:
  """The ``workflows.AsyncClient`` of the episodes on ``loop``, over a ``TurnClient``'s routing."""

  def __init__(self, turns: TurnClient, loop: asyncio.AbstractEventLoop):
    self.turns, self.loop = turns, loop
    self._requests: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._submit_loop, name="turn-submit", daemon=True)
    self._thread.start()

  async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Sample:
    future = self.loop.create_future()

    def settle(result) -> None:  # (from any thread)
      try:
        self.loop.call_soon_threadsafe(_settle_async, future, result)
      except RuntimeError:  # the loop is closed: nobody waits any more
        pass

    request = self.turns.request(prompt_tokens, params, settle)
    self._requests.put(request)
    try:
      return await future
    finally:
      self.turns.forget(request.group_id)

  def _submit_loop(self) -> None:
    while True:
      request = self._requests.get()
      if request is None:
        return
      try:
        self.turns.engine.submit(request)
      except BaseException as e:  # pylint: disable=broad-except
        self.turns.fail(request.group_id, e)  # (the episode raises it: the run stops)

  def close(self) -> None:
    self._requests.put(None)
    self._thread.join(timeout=30)


class AsyncEpisodeRunner(Runner):
  """Plays async workflow episodes on one event loop (see the module's docstring)."""

  def __init__(self, workflow, ctx, engine: RolloutEngine, stop: threading.Event,
               max_episodes: int, on_error, stats: EpisodeStats | None = None):
    self.workflow, self.ctx, self.on_error = workflow, ctx, on_error
    self.stats = stats or EpisodeStats()
    self._stop = stop
    self.loop = asyncio.new_event_loop()
    self._places = asyncio.Semaphore(max(1, int(max_episodes)))
    self._thread = threading.Thread(target=self._run_loop, name="episode-loop", daemon=True)
    self._thread.start()
    self.turns = TurnClient(engine, stop)
    self.client = AsyncTurnClient(self.turns, self.loop)

  def _run_loop(self) -> None:
    asyncio.set_event_loop(self.loop)
    try:
      self.loop.run_forever()
    finally:  # (the reward's worker threads: asyncio.to_thread)
      self.loop.run_until_complete(self.loop.shutdown_default_executor())
      self.loop.close()

  def launch(self, group_id, index, example, params, kind) -> Future:
    return asyncio.run_coroutine_threadsafe(
        self._play(group_id, index, example, params, kind), self.loop)

  async def _play(self, group_id: int, index: int, example: dict, params: SamplingParams,
                  kind: str):
    try:
      if kind == "eval":
        return await self._episode(group_id, index, example, params, kind)
      async with self._places:
        return await self._episode(group_id, index, example, params, kind)
    except (Stopped, asyncio.CancelledError):
      return None

  async def _episode(self, group_id, index, example, params, kind):
    if self._stop.is_set():
      return None
    self.stats.started()
    try:
      ep = await self.workflow.run(example, self.ctx, self.client, params)
    except (Stopped, asyncio.CancelledError):
      raise
    except BaseException as e:  # pylint: disable=broad-except
      self.on_error(e)
      return None
    finally:
      self.stats.ended()
    return self.label(ep, group_id, index, kind)

  def shutdown(self) -> None:
    """Wakes and cancels the running episodes, waits for them to end, then ends the loop."""
    self.turns.stop_waiting()

    async def cancel_all() -> None:
      tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
      for t in tasks:
        t.cancel()
      if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)

    if self._thread.is_alive():
      try:
        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(CANCEL_WAIT_S + 5)
      finally:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
    self.client.close()
