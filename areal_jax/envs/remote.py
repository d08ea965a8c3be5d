"""Environments reached over HTTP: the JSON protocol and its client.

The protocol (``serve.py`` is the reference server). Every request is a ``POST`` of a JSON object;
the episode id is chosen by the client (1 to 128 characters of ``[A-Za-z0-9_.-]``):

- ``POST /reset {"episode_id": ID, "example": {...}}`` -> ``{"observation": TEXT}``: a new
  environment for the episode (one already under that id is replaced, so a retried reset is safe);
- ``POST /step {"episode_id": ID, "action": TEXT}`` -> ``{"observation": TEXT, "reward": NUMBER,
  "done": BOOL, "info": {...}}``;
- ``POST /close {"episode_id": ID}`` -> ``{"closed": BOOL}``;
- ``GET /health`` -> ``{"status": "ok", "env": "module:Class", "episodes": N, ...}``.

An error is ``{"error": {"kind": KIND, "message": TEXT}}`` with a status: 400 ``bad_request``, 404
``unknown_episode`` (never reset, closed, or dropped after a failure or ``idle_timeout_s``), 413
``too_large`` (the request), 503 ``busy`` (the server holds its most episodes), and for a failed
environment call 504 ``timeout``, 502 ``crashed`` | ``garbage`` | ``too_large`` (the server then
drops that episode).

``RemoteEnvs(url, timeout_s, max_response_bytes)``: ``env()`` is one episode's ``Env`` over it.
Each request may wait ``timeout_s`` for the connection and between the bytes of the answer; an
answer over ``max_response_bytes`` is cut off. Failures map onto ``base.FAILURES``: a timeout is
"timeout"; a refused or broken connection, an unknown episode or another error "crashed"; an
answer that is not the protocol's JSON "garbage"; too long an answer "too_large". A reset is tried
once more after a timeout or a lost connection; one answered ``busy`` is tried again every
``BUSY_PAUSE_S`` for up to ``timeout_s`` (back-pressure: a full server delays episodes, and only
then fails them, "timeout"). A step is never tried twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref

import httpx2

from areal_jax.envs.base import (DEFAULT_MAX_RESPONSE_BYTES, FAILURES, Env, EnvError, StepResult,
                                 check_observation, check_step)

BUSY_PAUSE_S = 0.5


class RemoteEnvs:
  """An environment server's episodes. One HTTP client per event loop that uses it."""

  def __init__(self, url: str, timeout_s: float = 30.0,
               max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, reset_retries: int = 1):
    url = str(url).rstrip("/")
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"environment server url {url!r} must start with http:// or https://")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s={timeout_s} must be > 0")
    self.url, self.timeout_s, self.max_bytes = url, float(timeout_s), int(max_response_bytes)
    self.reset_retries = int(reset_retries)
    self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def env(self) -> RemoteEnv:
    return RemoteEnv(self)

  def stats(self) -> dict:
    return {}

  def _client(self) -> httpx2.AsyncClient:
    loop = asyncio.get_running_loop()
    client = self._clients.get(loop)
    if client is None:
      # pool=None: waiting for a free connection is back-pressure, not a failure
      client = httpx2.AsyncClient(base_url=self.url, trust_env=False,
                                  timeout=httpx2.Timeout(self.timeout_s, pool=None))
      self._clients[loop] = client
    return client

  async def post(self, path: str, payload: dict) -> dict:
    """The JSON answer of ``POST path``, or the ``EnvError`` its failure maps onto."""
    try:
      async with self._client().stream("POST", path, json=payload) as r:
        length = r.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
          raise EnvError("too_large", f"answer of {length} bytes exceeds {self.max_bytes}")
        body = bytearray()
        async for chunk in r.aiter_bytes():
          body += chunk
          if len(body) > self.max_bytes:
            raise EnvError("too_large", f"answer exceeds {self.max_bytes} bytes")
        status = r.status_code
    except httpx2.TimeoutException as e:
      raise EnvError("timeout", f"{path} ran past {self.timeout_s:g} s ({type(e).__name__})") from None
    except (httpx2.HTTPError, httpx2.StreamError, OSError) as e:
      raise EnvError("crashed", f"{path}: {type(e).__name__}: {e}") from None
    except TypeError as e:  # the payload (an example, an action) is not JSON
      raise EnvError("garbage", f"{path}: the request is not JSON: {e}") from None
    try:
      data = json.loads(bytes(body))
    except ValueError:
      raise EnvError("garbage", f"{path} answered {status} with {bytes(body[:200])!r}, not JSON") from None
    if not isinstance(data, dict):
      raise EnvError("garbage", f"{path} answered {str(data)[:200]!r}, not a JSON object")
    if status >= 400:
      error = data.get("error") if isinstance(data.get("error"), dict) else {}
      kind, message = error.get("kind"), f"{path} answered {status}: {error.get('message')}"
      if kind == "busy":
        raise _Busy(message)
      raise EnvError(kind if kind in FAILURES else "crashed", message)
    return data

  async def aclose(self) -> None:
    """Closes this event loop's HTTP client."""
    client = self._clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
      await client.aclose()

  def close(self) -> None:
    self._clients.clear()


class _Busy(Exception):
  pass


def _field(data: dict, key: str, path: str):
  if key not in data:
    raise EnvError("garbage", f"{path} answer lacks {key!r}")
  return data[key]


class RemoteEnv(Env):
  """One episode on an environment server."""

  def __init__(self, envs: RemoteEnvs):
    self.envs, self.id = envs, uuid.uuid4().hex
    self._open = False

  async def reset(self, example: dict) -> str:
    payload = {"episode_id": self.id, "example": example}
    self._open = True  # from here on a close is owed, even if the reset fails
    attempt, deadline = 0, time.monotonic() + self.envs.timeout_s
    while True:
      try:
        data = await self.envs.post("/reset", payload)
        break
      except _Busy as e:  # back-pressure: wait for a place, up to the time limit
        if time.monotonic() + BUSY_PAUSE_S > deadline:
          raise EnvError("timeout", f"the environment server stayed full for "
                         f"{self.envs.timeout_s:g} s: {e}") from None
        await asyncio.sleep(BUSY_PAUSE_S)
      except EnvError as e:
        if e.kind not in ("timeout", "crashed") or attempt >= self.envs.reset_retries:
          raise
        attempt += 1
    return check_observation(_field(data, "observation", "/reset"), self.envs.max_bytes)

  async def step(self, action: str) -> StepResult:
    try:
      data = await self.envs.post("/step", {"episode_id": self.id, "action": action})
    except _Busy as e:
      raise EnvError("crashed", str(e)) from None
    result = tuple(_field(data, k, "/step") for k in ("observation", "reward", "done", "info"))
    return check_step(result, self.envs.max_bytes)

  async def close(self) -> None:
    if not self._open:
      return
    self._open = False
    try:
      await self.envs.post("/close", {"episode_id": self.id})
    except (EnvError, _Busy):
      pass  # the server drops idle episodes itself
