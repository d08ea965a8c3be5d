"""The environment interface, awaitable, and the adapter for in-process blocking environments.

An environment plays one episode: ``await reset(example) -> observation`` (a string),
``await step(action) -> (observation, reward, done, info)`` (``action`` is the policy's text, the
observation a string inserted into the conversation, ``reward`` a finite number, ``info`` a dict
of JSON values), ``await close()``. ``Env`` is that interface; three kinds implement it:

- in process: ``InProcessEnv`` runs a blocking environment (``reset/step/close`` as plain methods,
  e.g. ``PythonEnv``, ``CalculatorEnv``) on a thread pool, so it never blocks the event loop, and
  an async one directly; a call past its time limit ends the episode (the thread cannot be killed:
  use a pool for environments that may hang);
- a pool of worker processes on this host (``pool.py``);
- remote over HTTP (``remote.py``, the reference server ``serve.py``).

Every failure is an ``EnvError`` of one kind (``FAILURES``): "timeout" (a call ran past its
limit), "crashed" (the environment raised, its process died, or its state was lost),
"garbage" (a result that is not the interface's), "too_large" (a result over the size bound).
The episode then ends with that reason; no kind retries a ``step`` (it is not idempotent).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import importlib
import inspect
import json
import math
from typing import Any

FAILURES = ("timeout", "crashed", "garbage", "too_large")
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20
StepResult = tuple[str, float, bool, dict]


class EnvError(Exception):
  """An environment call failed; ``kind`` is one of ``FAILURES``."""

  def __init__(self, kind: str, message: str):
    if kind not in FAILURES:
      raise ValueError(f"EnvError kind {kind!r} is not one of {FAILURES}")
    super().__init__(f"{kind}: {message}")
    self.kind, self.message = kind, message


class Env(abc.ABC):
  """One episode's environment, awaitable. Not shared between episodes."""

  @abc.abstractmethod
  async def reset(self, example: dict) -> str:
    """Starts the episode of ``example``; the first observation ("" when the prompt says all)."""

  @abc.abstractmethod
  async def step(self, action: str) -> StepResult:
    """The environment's answer to the policy's text ``action``."""

  async def acquire(self) -> None:
    """Waits for what the episode needs before its first call (a place in a pool); ``reset``
    does it when not done before. Not an environment call: callers timing ``reset`` await it
    first, so the wait for a place is not counted as the environment's latency."""

  async def close(self) -> None:
    """Releases what the episode holds; never raises."""


def load_class(path: str) -> type:
  """The class named ``"package.module:Class"``."""
  module, sep, name = str(path).partition(":")
  if not sep or not module or not name:
    raise ValueError(f"environment class {path!r} must be 'package.module:Class'")
  try:
    obj = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"environment class {path!r} cannot be loaded: {e}") from None
  if not isinstance(obj, type):
    raise ValueError(f"environment class {path!r} is not a class")
  return obj


def parse_args(text: str | dict | None) -> dict:
  """Constructor arguments of an environment class: a JSON object (text) or a dict."""
  if isinstance(text, dict):
    return dict(text)
  if not text:
    return {}
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"environment arguments {text!r} are not JSON: {e}") from None
  if not isinstance(value, dict):
    raise ValueError(f"environment arguments {text!r} must be a JSON object")
  return value


def check_observation(obs: Any, max_bytes: int) -> str:
  """``obs`` if it is a string of at most ``max_bytes`` (UTF-8), else the ``EnvError``."""
  if not isinstance(obs, str):
    raise EnvError("garbage", f"observation is a {type(obs).__name__}, not a string")
  if len(obs) > max_bytes or len(obs.encode("utf-8", "replace")) > max_bytes:
    raise EnvError("too_large", f"observation of {len(obs)} characters exceeds {max_bytes} bytes")
  return obs


def check_step(result: Any, max_bytes: int) -> StepResult:
  """A step's result as ``(observation, reward, done, info)``, validated, else ``EnvError``."""
  if not isinstance(result, (tuple, list)) or len(result) != 4:
    raise EnvError("garbage", "step did not return (observation, reward, done, info)")
  obs, reward, done, info = result
  obs = check_observation(obs, max_bytes)
  if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
    raise EnvError("garbage", f"reward {reward!r} is not a finite number")
  if not isinstance(done, bool):
    raise EnvError("garbage", f"done {done!r} is not a bool")
  if not isinstance(info, dict):
    raise EnvError("garbage", f"info is a {type(info).__name__}, not a dict")
  return obs, float(reward), done, info


def is_async(env: Any) -> bool:
  """Whether ``env``'s ``reset`` and ``step`` are coroutine functions."""
  return all(inspect.iscoroutinefunction(getattr(env, m, None)) for m in ("reset", "step"))


class InProcessEnv(Env):
  """An environment object of this process behind the awaitable interface, with time and size
  limits. Blocking methods run on ``executor`` (None: the event loop's default thread pool);
  coroutine methods are awaited. Results are validated (``check_step``)."""

  def __init__(self, env: Any, timeout_s: float = 30.0,
               max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
               executor: cf.Executor | None = None):
    if timeout_s <= 0:
      raise ValueError(f"timeout_s={timeout_s} must be > 0")
    self.env, self.timeout_s, self.max_bytes = env, float(timeout_s), int(max_response_bytes)
    self.executor, self._async = executor, is_async(env)

  async def _call(self, name: str, *args):
    method = getattr(self.env, name)
    if self._async:
      call = method(*args)
    else:
      call = asyncio.get_running_loop().run_in_executor(self.executor, method, *args)
    try:
      return await asyncio.wait_for(call, self.timeout_s)
    except asyncio.TimeoutError:
      raise EnvError("timeout", f"{name} ran past {self.timeout_s:g} s") from None
    except EnvError:
      raise
    except Exception as e:  # the environment's own error ends the episode, not the run
      raise EnvError("crashed", f"{name} raised {type(e).__name__}: {e}") from None

  async def reset(self, example: dict) -> str:
    return check_observation(await self._call("reset", example), self.max_bytes)

  async def step(self, action: str) -> StepResult:
    return check_step(await self._call("step", action), self.max_bytes)

  async def close(self) -> None:
    if getattr(self.env, "close", None) is None:
      return
    try:
      await self._call("close")
    except EnvError:
      pass  # nothing to hand back: the episode is over either way


class InProcessEnvs:
  """Episodes' environments in this process: ``Class(**args)`` each, behind ``InProcessEnv``.
  Blocking ones share ``threads`` threads of their own (so a slow one never holds the event loop,
  nor the loop's default pool)."""

  def __init__(self, cls: type | str, args: dict | str | None = None, threads: int = 2,
               timeout_s: float = 30.0, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
    if threads < 1:
      raise ValueError(f"threads={threads} must be >= 1")
    self.cls = load_class(cls) if isinstance(cls, str) else cls
    self.args, self.timeout_s, self.max_bytes = parse_args(args), float(timeout_s), int(max_response_bytes)
    self._executor = cf.ThreadPoolExecutor(threads, thread_name_prefix="env")

  def env(self) -> InProcessEnv:
    try:
      env = self.cls(**self.args)
    except Exception as e:
      raise EnvError("crashed", f"{self.cls.__name__}(**{self.args}) raised {type(e).__name__}: {e}") from None
    return InProcessEnv(env, self.timeout_s, self.max_bytes, self._executor)

  def stats(self) -> dict:
    return {}

  def close(self) -> None:
    self._executor.shutdown(wait=False, cancel_futures=True)
