"""A pool of environment worker processes on this host, behind the awaitable interface.

``EnvPool(class_path, args, workers, episodes_per_worker, timeout_s, max_response_bytes)`` starts
``workers`` processes (``worker.py``), each hosting the environments (``Class(**args)``, one per
episode) of up to ``episodes_per_worker`` episodes; ``pool.env()`` is one episode's ``Env``.

- Placement and back-pressure: ``reset`` takes a place on the least loaded worker; when every
  place is taken it waits (first come, first served) until an episode closes. The waiting
  episodes are the queue, so it is bounded by the episodes in flight.
- Calls to one worker run one at a time, each with a time limit (``timeout_s``) counted from when
  it is sent. A call past it, a worker that dies, an answer that is not a frame of JSON, or a frame
  over ``max_response_bytes`` ends that episode with the kind of failure (``base.FAILURES``), and
  the worker is killed with its process group and started again at once. Every episode it held
  ends "crashed" at its next call (its state is gone), so ``episodes_per_worker=1`` keeps one
  fault to one episode. An environment that raises, or whose result is not JSON or too large,
  ends only its own episode and its worker stays (the worker answers that failure itself).
- Retries: a ``reset`` that timed out or crashed is tried once more (a new environment replaces
  whatever the first try left); a ``step`` never is (it may have acted).

The I/O with each worker runs on a thread of its own, so any event loop may await the pool, and no
loop ever blocks on it. Workers exit when the pool's process is gone; ``close()`` stops them.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures as cf
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref

from areal_jax.envs import worker as worker_lib
from areal_jax.envs.base import (DEFAULT_MAX_RESPONSE_BYTES, FAILURES, Env, EnvError, StepResult,
                                 check_observation, check_step, parse_args)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's interpreter start and the class's import


class _Timeout(Exception):
  pass


class _Garbage(Exception):
  pass


class Place:
  """One place of a pool: a worker and the thread that talks to it (``call`` runs on that thread
  only). A subclass is the kind of worker: ``running``, ``_start``, ``_kill``, ``_dead`` (why a
  worker that stopped between calls stopped, or None) and ``_exchange`` (one request's reply, read
  with ``_body_size`` and ``_parse``; after a timeout or a death it restarts the worker and raises
  the ``EnvError``)."""

  running = False

  def __init__(self, pool: EnvPool, index: int):
    self.pool, self.index = pool, index
    self.generation = 0  # how many workers this place has started; an episode's is its own
    self.load = 0  # episodes placed here (guarded by the pool's lock)
    self.thread = cf.ThreadPoolExecutor(1, thread_name_prefix=f"env-worker-{index}")

  def _restart(self, why: str) -> None:
    """Kills the worker and starts another at once (a failed start is retried at the next call)."""
    log.warning("environment worker %d (%s) restarted: %s", self.index, self.pool.class_path, why)
    self._kill()
    if self.pool._closed:
      return
    self.pool._count("restarts")
    try:
      self._start()
    except EnvError as e:
      log.warning("environment worker %d did not restart: %s", self.index, e.message)

  def call(self, request: dict, generation: int | None) -> tuple[object, int]:
    """Sends ``request``; its result and the worker's generation. ``generation``: the episode's
    (None for a reset: any); a different one means the episode's state is gone."""
    if self.pool._closed:
      raise EnvError("crashed", "the environment pool is closed")
    try:
      frame = worker_lib.encode(request)
    except (TypeError, ValueError) as e:
      raise EnvError("garbage", f"the request is not JSON: {e}") from None
    why = self._dead()
    if why is not None:
      self._restart(why)
    if generation is not None and generation != self.generation:
      raise EnvError("crashed", "the environment's worker was restarted; the episode's state is lost")
    if not self.running:
      self._start()
    try:
      reply = self._exchange(request, frame)
    except OverflowError as e:
      self._restart(str(e))
      raise EnvError("too_large", str(e)) from None
    except _Garbage as e:
      self._restart(f"its answer was not JSON: {e}")
      raise EnvError("garbage", f"answer is not JSON: {e}") from None
    if not isinstance(reply, dict) or "ok" not in reply:
      raise EnvError("garbage", f"answer {str(reply)[:200]!r} is not the protocol's")
    if not reply["ok"]:
      kind = reply.get("kind") if reply.get("kind") in FAILURES else "crashed"
      raise EnvError(kind, str(reply.get("message")))
    return reply.get("result"), self.generation

  def _body_size(self, header: bytes) -> int:
    """The size a frame's header announces (``OverflowError`` past the bound)."""
    (n,) = worker_lib.HEADER.unpack(header[:worker_lib.HEADER.size])
    if n > self.pool.max_response_bytes:
      raise OverflowError(f"answer of {n} bytes exceeds {self.pool.max_response_bytes}")
    return n

  @staticmethod
  def _parse(body: bytes):
    try:
      return json.loads(body)
    except ValueError as e:  # not UTF-8 or not JSON
      raise _Garbage(str(e)) from None


class _Worker(Place):
  """A worker process of this host (``worker.py``), spoken to over its standard input and output."""

  def __init__(self, pool: EnvPool, index: int):
    super().__init__(pool, index)
    self.proc: subprocess.Popen | None = None

  @property
  def running(self) -> bool:
    return self.proc is not None

  def _dead(self) -> str | None:
    if self.proc is not None and self.proc.poll() is not None:
      return f"it had exited with status {self.proc.returncode}"
    return None

  def _start(self) -> None:
    p = self.pool
    spec = dict(class_path=p.class_path, args=p.args, max_response_bytes=p.max_response_bytes,
                sys_path=[s for s in sys.path if s], parent=os.getpid())
    self.proc = subprocess.Popen([sys.executable, "-m", "areal_jax.envs.worker", json.dumps(spec)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                 start_new_session=True)
    os.set_blocking(self.proc.stdin.fileno(), False)
    self.generation += 1
    try:
      ready = self._read(self.proc, time.monotonic() + START_TIMEOUT_S)
    except (_Timeout, _Garbage, EOFError, OverflowError, OSError) as e:
      self._kill()
      raise EnvError("crashed", f"environment worker did not start: {type(e).__name__} {e}") from None
    if not isinstance(ready, dict) or not ready.get("ok"):
      self._kill()
      message = ready.get("message") if isinstance(ready, dict) else ready
      raise EnvError("crashed", f"environment worker did not start: {message}")

  def _kill(self) -> None:
    proc, self.proc = self.proc, None
    if proc is None:
      return
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    proc.wait()
    for f in (proc.stdin, proc.stdout):
      try:
        f.close()
      except OSError:
        pass

  # -- frames -------------------------------------------------------------------------------------
  @staticmethod
  def _write(proc: subprocess.Popen, data: bytes, deadline: float) -> None:
    fd, view = proc.stdin.fileno(), memoryview(data)
    while view:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([], [fd], [], left)[1]:
        raise _Timeout()
      view = view[os.write(fd, view):]

  @staticmethod
  def _read_n(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
    fd, chunks, got = proc.stdout.fileno(), [], 0
    while got < n:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise _Timeout()
      chunk = os.read(fd, min(n - got, 1 << 20))
      if not chunk:
        raise EOFError("the worker closed its output")
      chunks.append(chunk)
      got += len(chunk)
    return b"".join(chunks)

  def _read(self, proc: subprocess.Popen, deadline: float):
    n = self._body_size(self._read_n(proc, worker_lib.HEADER.size, deadline))
    return self._parse(self._read_n(proc, n, deadline))

  def _exchange(self, request: dict, frame: bytes):
    proc, deadline = self.proc, time.monotonic() + self.pool.timeout_s
    try:
      self._write(proc, frame, deadline)
      return self._read(proc, deadline)
    except _Timeout:
      self._restart(f"{request['op']} ran past {self.pool.timeout_s:g} s")
      raise EnvError("timeout", f"{request['op']} ran past {self.pool.timeout_s:g} s") from None
    except (EOFError, OSError):  # a broken pipe, or the pool closed the pipes meanwhile
      try:
        status = proc.wait(timeout=1)
      except subprocess.TimeoutExpired:  # alive but deaf: killed below
        status = None
      self._restart(f"it died during {request['op']} (status {status})")
      raise EnvError("crashed", f"the environment's process died (status {status})") from None

  def close(self) -> None:
    proc = self.proc
    if proc is not None:
      try:
        proc.stdin.close()  # the worker sees the end of its input and exits
        proc.wait(timeout=2)
      except (OSError, subprocess.TimeoutExpired):
        pass
    self._kill()


class EnvPool:
  """Environment worker processes on this host; ``env()`` is one episode's ``Env``. A subclass
  may set ``place`` to another kind of worker (``ray_pool.RayEnvPool``: Ray actors)."""

  place: type[Place] = _Worker

  def __init__(self, class_path: str, args: dict | str | None = None, workers: int = 2,
               episodes_per_worker: int = 1, timeout_s: float = 30.0,
               max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, reset_retries: int = 1):
    if workers < 1 or episodes_per_worker < 1:
      raise ValueError(f"workers={workers} and episodes_per_worker={episodes_per_worker} must be >= 1")
    if timeout_s <= 0 or max_response_bytes < 1024:
      raise ValueError(f"timeout_s={timeout_s} must be > 0 and max_response_bytes="
                       f"{max_response_bytes} >= 1024")
    self.class_path, self.args = str(class_path), parse_args(args)
    self.timeout_s, self.max_response_bytes = float(timeout_s), int(max_response_bytes)
    self.capacity, self.reset_retries = int(episodes_per_worker), int(reset_retries)
    self._lock = threading.Lock()
    self._waiters: collections.deque = collections.deque()
    self._counts = collections.Counter()
    self._closed = False
    self.workers = [self.place(self, i) for i in range(workers)]
    atexit.register(_close_at_exit, weakref.ref(self))

  def env(self) -> PooledEnv:
    """A new episode's environment (it takes its place in the pool at ``reset``)."""
    return PooledEnv(self)

  def start(self) -> None:
    """Starts every worker now (blocking) instead of at their first call."""
    cf.wait([w.thread.submit(w._start) for w in self.workers if not w.running])

  def stats(self) -> dict:
    """Places taken, episodes waiting for one, restarts and failures by kind so far."""
    with self._lock:
      return dict(workers=len(self.workers), episodes=sum(w.load for w in self.workers),
                  waiting=len(self._waiters), restarts=self._counts["restarts"],
                  failures={k: self._counts[k] for k in FAILURES})

  def _count(self, key: str) -> None:
    with self._lock:
      self._counts[key] += 1

  # -- places -------------------------------------------------------------------------------------
  async def _acquire(self) -> Place:
    loop = asyncio.get_running_loop()
    with self._lock:
      if self._closed:
        raise EnvError("crashed", "the environment pool is closed")
      free = [w for w in self.workers if w.load < self.capacity]
      if free and not self._waiters:
        w = min(free, key=lambda w: w.load)
        w.load += 1
        return w
      future = loop.create_future()
      self._waiters.append((loop, future))
    try:
      return await future
    except asyncio.CancelledError:
      with self._lock:
        try:
          self._waiters.remove((loop, future))
        except ValueError:
          pass
      if future.done() and not future.cancelled():
        self._release(future.result())
      raise

  def _release(self, w: Place) -> None:
    """Frees a place on ``w``: the first waiting episode takes it."""
    with self._lock:
      while self._waiters:
        loop, future = self._waiters.popleft()
        try:
          loop.call_soon_threadsafe(self._hand_over, future, w)
          return
        except RuntimeError:  # that episode's loop is closed
          continue
      w.load -= 1

  def _hand_over(self, future: asyncio.Future, w: Place) -> None:
    if future.done():  # cancelled meanwhile: the next one gets it
      self._release(w)
    else:
      future.set_result(w)

  async def _call(self, w: Place, request: dict, generation: int | None):
    try:
      return await asyncio.wrap_future(w.thread.submit(w.call, request, generation))
    except RuntimeError as e:  # the pool closed: its threads take no more calls
      raise EnvError("crashed", f"the environment pool is closed ({e})") from None

  # -- end ----------------------------------------------------------------------------------------
  def close(self) -> None:
    """Stops every worker (blocking, a few seconds at most); episodes still open end "crashed"."""
    with self._lock:
      self._closed = True
      waiters, self._waiters = list(self._waiters), collections.deque()
    for loop, future in waiters:
      try:
        loop.call_soon_threadsafe(_fail, future, EnvError("crashed", "the pool closed"))
      except RuntimeError:
        pass
    for w in self.workers:
      w.close()
      w.thread.shutdown(wait=False, cancel_futures=True)

  async def aclose(self) -> None:
    await asyncio.to_thread(self.close)


def _fail(future: asyncio.Future, error: Exception) -> None:
  if not future.done():
    future.set_exception(error)


def _close_at_exit(ref) -> None:
  pool = ref()
  if pool is not None:
    for w in pool.workers:
      w._kill()


class PooledEnv(Env):
  """One episode's environment in an ``EnvPool``."""

  def __init__(self, pool: EnvPool):
    self.pool, self.id = pool, uuid.uuid4().hex
    self._worker: Place | None = None
    self._generation: int | None = None

  async def acquire(self) -> None:
    if self._worker is None:
      self._worker = await self.pool._acquire()

  async def reset(self, example: dict) -> str:
    await self.acquire()
    request = {"op": "reset", "episode": self.id, "example": example}
    try:
      for attempt in range(self.pool.reset_retries + 1):
        try:
          result, self._generation = await self.pool._call(self._worker, request, None)
          break
        except EnvError as e:
          if e.kind not in ("timeout", "crashed") or attempt == self.pool.reset_retries:
            raise
      return check_observation(result, self.pool.max_response_bytes)
    except EnvError as e:
      self.pool._count(e.kind)
      raise

  async def step(self, action: str) -> StepResult:
    try:
      if self._generation is None:
        raise EnvError("crashed", "step before a successful reset")
      request = {"op": "step", "episode": self.id, "action": action}
      result, _ = await self.pool._call(self._worker, request, self._generation)
      return check_step(result, self.pool.max_response_bytes)
    except EnvError as e:
      self.pool._count(e.kind)
      raise

  async def close(self) -> None:
    w, self._worker = self._worker, None
    if w is None:
      return
    try:
      if self._generation is not None:
        await self.pool._call(w, {"op": "close", "episode": self.id}, self._generation)
    except EnvError:
      pass  # its worker was restarted meanwhile: nothing is left to close
    finally:
      self._generation = None
      self.pool._release(w)
