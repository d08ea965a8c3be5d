"""A pool whose workers are Ray actors (``rollout.env.kind="ray"``, with ``runtime.mode="ray"``).

``RayEnvPool`` is ``pool.EnvPool`` (the same places, back-pressure, time limits, retries and
failure kinds) with each place's worker a Ray actor, ``HostActor``: a ``worker.Host``, the code a
worker process runs. Ray spreads the actors over the cluster's nodes (scheduling strategy
"SPREAD") and counts no CPU for them (``num_cpus=0``: the rollout workers keep theirs). An actor
whose call runs past the time limit, or that died (``RayError``), is killed (``ray.kill``) and a
new one takes its place; the episodes it held end "crashed", as with a worker process. The
environment class must be importable on every node, and Ray must be started by the caller (the
trainer connects to it in ray mode).
"""

from __future__ import annotations

import os
import sys
import time

from areal_jax.envs import worker as worker_lib
from areal_jax.envs.base import EnvError, load_class, parse_args
from areal_jax.envs.pool import START_TIMEOUT_S, EnvPool, Place, _Garbage


class HostActor:
  """A Ray actor holding episodes' environments; ``answer(request)`` is a worker's answer frame."""

  def __init__(self, class_path: str, args: dict, max_bytes: int, sys_path: list[str]):
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    self.host = worker_lib.Host(load_class(class_path), parse_args(args), max_bytes)

  def ready(self) -> int:
    return os.getpid()

  def answer(self, request: dict) -> bytes:
    return self.host.answer(request)


class _RayPlace(Place):

  def __init__(self, pool: EnvPool, index: int):
    super().__init__(pool, index)
    self.actor = None

  @property
  def running(self) -> bool:
    return self.actor is not None

  def _dead(self) -> str | None:
    return None  # a dead actor shows at its next call (RayError)

  def _start(self) -> None:
    import ray  # pylint: disable=import-outside-toplevel
    p = self.pool
    remote = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1,
                        scheduling_strategy="SPREAD")(HostActor)
    self.generation += 1
    self.actor = remote.remote(p.class_path, p.args, p.max_response_bytes,
                               [s for s in sys.path if s])
    try:
      ray.get(self.actor.ready.remote(), timeout=START_TIMEOUT_S)
    except Exception as e:  # the actor's constructor failed, or no node took it in time
      self._kill()
      raise EnvError("crashed", f"environment actor did not start: {type(e).__name__}: {e}") from None

  def _kill(self) -> None:
    actor, self.actor = self.actor, None
    if actor is not None:
      import ray  # pylint: disable=import-outside-toplevel
      try:
        ray.kill(actor, no_restart=True)
      except Exception:  # already gone, or Ray is shutting down
        pass

  def _exchange(self, request: dict, frame: bytes):
    del frame  # the actor takes the request itself; the frame proved it is JSON
    import ray  # pylint: disable=import-outside-toplevel
    from ray.exceptions import GetTimeoutError, RayError  # pylint: disable=import-outside-toplevel
    t0 = time.monotonic()
    try:
      answer = ray.get(self.actor.answer.remote(request), timeout=self.pool.timeout_s)
    except GetTimeoutError:
      self._restart(f"{request['op']} ran past {self.pool.timeout_s:g} s")
      raise EnvError("timeout", f"{request['op']} ran past {self.pool.timeout_s:g} s") from None
    except RayError as e:
      self._restart(f"it died during {request['op']} after {time.monotonic() - t0:.1f} s")
      raise EnvError("crashed", f"the environment's actor died: {type(e).__name__}") from None
    if not isinstance(answer, bytes):
      raise _Garbage(f"a {type(answer).__name__}, not a frame")
    self._body_size(answer)
    return self._parse(answer[worker_lib.HEADER.size:])

  def close(self) -> None:
    self._kill()


class RayEnvPool(EnvPool):
  """``EnvPool`` with Ray actors for workers."""

  place = _RayPlace
