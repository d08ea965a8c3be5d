"""A worker process of the environment pool (``pool.py``): it hosts episodes' environments.

Started as ``python -m areal_jax.envs.worker SPEC`` (SPEC: a JSON object with ``class_path``,
``args``, ``max_response_bytes``, ``sys_path`` and ``parent``, the pid of the pool's process). It
reads requests on its standard input and answers on its standard output, one at a time, in frames:
a 4-byte big-endian length, then that many bytes of UTF-8 JSON. Whatever the environment prints
goes to standard error (the protocol keeps standard output to itself).

The first frame it sends is ``{"ok": true, "ready": PID}`` once the class is imported (or
``{"ok": false, ...}`` if it cannot be). Requests: ``{"op": "reset", "episode": ID, "example":
{...}}`` builds a new instance (``Class(**args)``) for the episode and answers its first
observation; ``{"op": "step", "episode": ID, "action": TEXT}`` answers ``[observation, reward,
done, info]``; ``{"op": "close", "episode": ID}``. Answers are ``{"ok": true, "result": ...}`` or
``{"ok": false, "kind": KIND, "message": TEXT}`` with a kind of ``base.FAILURES``: an environment
that raises is "crashed", a result that is not JSON "garbage", an answer over
``max_response_bytes`` "too_large" (the episode's environment is then dropped). Async
environments (coroutine ``reset``/``step``) run on an event loop of the worker's.

It exits when its standard input closes or the pool's process is gone.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import struct
import sys
import threading
import time

HEADER = struct.Struct(">I")


def encode(message) -> bytes:
  """A frame: the length header, then the JSON (NaN and infinities are not JSON: ValueError)."""
  body = json.dumps(message, allow_nan=False, separators=(",", ":")).encode("utf-8")
  return HEADER.pack(len(body)) + body


def _read(fd: int, n: int) -> bytes | None:
  chunks, got = [], 0
  while got < n:
    chunk = os.read(fd, min(n - got, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    got += len(chunk)
  return b"".join(chunks)


def _write(fd: int, data: bytes) -> None:
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _exit_with(parent: int) -> None:
  """Ends this process once the pool's process is gone (this one is then adopted)."""

  def watch():
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=watch, name="exit-with-pool", daemon=True).start()


class Host:
  """The environments of the episodes this worker holds, by episode id."""

  def __init__(self, cls: type, args: dict, max_bytes: int):
    self.cls, self.args, self.max_bytes = cls, args, max_bytes
    self.envs: dict[str, object] = {}
    self._loop: asyncio.AbstractEventLoop | None = None

  def _run(self, value):
    if inspect.isawaitable(value):
      if self._loop is None:
        self._loop = asyncio.new_event_loop()
      value = self._loop.run_until_complete(value)
    return value

  def _drop(self, episode: str) -> None:
    env = self.envs.pop(episode, None)
    if env is not None and getattr(env, "close", None) is not None:
      try:
        self._run(env.close())
      except Exception:  # closing a failed environment is best effort
        pass

  def handle(self, request: dict) -> dict:
    op, episode = request.get("op"), str(request.get("episode"))
    try:
      if op == "reset":
        self._drop(episode)
        env = self.envs[episode] = self.cls(**self.args)
        return {"ok": True, "result": self._run(env.reset(request.get("example")))}
      if op == "step":
        env = self.envs.get(episode)
        if env is None:
          return {"ok": False, "kind": "crashed", "message": f"no episode {episode} here"}
        result = self._run(env.step(request.get("action")))
        return {"ok": True, "result": list(result) if isinstance(result, tuple) else result}
      if op == "close":
        self._drop(episode)
        return {"ok": True, "result": None}
      return {"ok": False, "kind": "garbage", "message": f"unknown op {op!r}"}
    except Exception as e:  # the environment's error ends its episode, not this worker
      self._drop(episode)
      return {"ok": False, "kind": "crashed", "message": f"{op} raised {type(e).__name__}: {e}"}

  def answer(self, request: dict) -> bytes:
    """The frame answering ``request``, within the size bound."""
    reply = self.handle(request)
    try:
      frame = encode(reply)
    except (TypeError, ValueError) as e:
      self._drop(str(request.get("episode")))
      return encode({"ok": False, "kind": "garbage", "message": f"result is not JSON: {e}"})
    if len(frame) - HEADER.size > self.max_bytes:
      self._drop(str(request.get("episode")))
      return encode({"ok": False, "kind": "too_large",
                     "message": f"answer of {len(frame)} bytes exceeds {self.max_bytes}"})
    return frame


def main(argv: list[str]) -> int:
  spec = json.loads(argv[1])
  sys.path[:0] = [p for p in spec.get("sys_path", []) if p not in sys.path]
  rfd, wfd = os.dup(0), os.dup(1)  # the protocol's; fds 0 and 1 go to the environment
  os.dup2(2, 1)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  _exit_with(int(spec["parent"]))
  from areal_jax.envs.base import load_class, parse_args  # after sys.path is the pool's
  try:
    host = Host(load_class(spec["class_path"]), parse_args(spec.get("args")),
                int(spec["max_response_bytes"]))
  except Exception as e:
    _write(wfd, encode({"ok": False, "kind": "crashed", "message": str(e)}))
    return 1
  _write(wfd, encode({"ok": True, "ready": os.getpid()}))
  while True:
    header = _read(rfd, HEADER.size)
    if header is None:
      return 0
    body = _read(rfd, HEADER.unpack(header)[0])
    if body is None:
      return 0
    _write(wfd, host.answer(json.loads(body)))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
