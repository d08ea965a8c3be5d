"""The reference environment server: ``python -m areal_jax.envs.serve --env=module:Class``.

It speaks the protocol of ``remote.py`` (``POST /reset``, ``/step``, ``/close``, ``GET /health``)
for the environment class named by ``--env`` (built with ``--args``, a JSON object, once per
episode). With ``--workers=0`` the environments run in this process (blocking ones on threads);
with ``--workers=N`` in a pool of N worker processes (``pool.py``), where a call past
``--step_timeout_s`` kills its worker, which is started again. It binds 127.0.0.1 unless
``--host`` says otherwise. Bounds: request bodies of ``--max_request_bytes``, answers of
``--max_response_bytes``, ``--max_episodes`` episodes at once (at most the pool's places; then 503
``busy``), and an episode untouched for ``--idle_timeout_s`` is dropped.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from areal_jax.envs.base import DEFAULT_MAX_RESPONSE_BYTES, Env, EnvError, InProcessEnvs
from areal_jax.envs.pool import EnvPool

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
STATUS = {"bad_request": 400, "unknown_episode": 404, "busy": 503, "timeout": 504,
          "crashed": 502, "garbage": 502, "too_large": 502}


class _Refused(Exception):

  def __init__(self, kind: str, message: str, status: int | None = None):
    super().__init__(message)
    self.kind, self.message, self.status = kind, message, status or STATUS[kind]


def _error(kind: str, message: str, status: int) -> JSONResponse:
  return JSONResponse({"error": {"kind": kind, "message": message}}, status_code=status)


class EnvServer:
  """The episodes of one server: ``envs`` (``InProcessEnvs`` or ``EnvPool``) makes each one's
  ``Env``; ``app`` is the Starlette application."""

  def __init__(self, envs, name: str, max_episodes: int = 256,
               max_request_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, idle_timeout_s: float = 600.0):
    self.envs, self.name = envs, name
    self.max_episodes, self.max_request_bytes = int(max_episodes), int(max_request_bytes)
    self.idle_timeout_s = float(idle_timeout_s)
    self.episodes: dict[str, list] = {}  # id -> [Env, last used (monotonic)]
    self.app = Starlette(routes=[
        Route("/reset", self._route(self.reset), methods=["POST"]),
        Route("/step", self._route(self.step), methods=["POST"]),
        Route("/close", self._route(self.close), methods=["POST"]),
        Route("/health", self.health, methods=["GET"]),
    ])

  def _route(self, handler):
    async def endpoint(request: Request) -> JSONResponse:
      try:
        return JSONResponse(await handler(await self._body(request)))
      except _Refused as e:
        return _error(e.kind, e.message, e.status)
    return endpoint

  async def _body(self, request: Request) -> dict:
    body = bytearray()
    async for chunk in request.stream():
      body += chunk
      if len(body) > self.max_request_bytes:
        raise _Refused("too_large", f"request exceeds {self.max_request_bytes} bytes", 413)
    try:
      data = json.loads(bytes(body))
    except ValueError:
      raise _Refused("bad_request", "the body is not JSON") from None
    if not isinstance(data, dict):
      raise _Refused("bad_request", "the body is not a JSON object")
    episode = data.get("episode_id")
    if not isinstance(episode, str) or not _ID.match(episode):
      raise _Refused("bad_request", "episode_id must be 1 to 128 characters of [A-Za-z0-9_.-]")
    return data

  async def _drop(self, episode: str) -> bool:
    entry = self.episodes.pop(episode, None)
    if entry is not None:
      await entry[0].close()
    return entry is not None

  async def _sweep(self) -> None:
    now = time.monotonic()
    for episode in [k for k, (_, t) in self.episodes.items() if now - t > self.idle_timeout_s]:
      await self._drop(episode)

  async def _call(self, episode: str, call):
    try:
      return await call
    except EnvError as e:
      await self._drop(episode)
      raise _Refused(e.kind, e.message) from None

  async def reset(self, data: dict) -> dict:
    episode, example = data["episode_id"], data.get("example")
    if not isinstance(example, dict):
      raise _Refused("bad_request", "example must be a JSON object")
    await self._sweep()
    await self._drop(episode)
    if len(self.episodes) >= self.max_episodes:
      raise _Refused("busy", f"the server holds its most episodes ({self.max_episodes})")
    try:
      env: Env = self.envs.env()
    except EnvError as e:
      raise _Refused(e.kind, e.message) from None
    self.episodes[episode] = [env, time.monotonic()]
    return {"observation": await self._call(episode, env.reset(example))}

  async def step(self, data: dict) -> dict:
    episode, action = data["episode_id"], data.get("action")
    if not isinstance(action, str):
      raise _Refused("bad_request", "action must be a string")
    entry = self.episodes.get(episode)
    if entry is None:
      raise _Refused("unknown_episode", f"no episode {episode} (never reset, closed or dropped)")
    entry[1] = time.monotonic()
    obs, reward, done, info = await self._call(episode, entry[0].step(action))
    entry[1] = time.monotonic()
    return {"observation": obs, "reward": reward, "done": done, "info": info}

  async def close(self, data: dict) -> dict:
    return {"closed": await self._drop(data["episode_id"])}

  async def health(self, _: Request) -> JSONResponse:
    stats = self.envs.stats()
    return JSONResponse({"status": "ok", "env": self.name, "episodes": len(self.episodes), **stats})


def build(args: argparse.Namespace) -> EnvServer:
  """The server the command line describes."""
  max_episodes = args.max_episodes
  if args.workers > 0:  # no more episodes than the pool has places: "busy" instead of a queue
    envs = EnvPool(args.env, args.args, args.workers, args.episodes_per_worker,
                   args.step_timeout_s, args.max_response_bytes)
    max_episodes = min(max_episodes, args.workers * args.episodes_per_worker)
  else:
    envs = InProcessEnvs(args.env, args.args, args.threads, args.step_timeout_s,
                         args.max_response_bytes)
  return EnvServer(envs, args.env, max_episodes, args.max_request_bytes, args.idle_timeout_s)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m areal_jax.envs.serve", description=__doc__.split("\n")[0])
  p.add_argument("--env", required=True, help="the environment class, package.module:Class")
  p.add_argument("--args", default="", help="its constructor's keyword arguments, a JSON object")
  p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
  p.add_argument("--port", type=int, default=8900, help="port to listen on (0: any free one)")
  p.add_argument("--workers", type=int, default=0, help="worker processes; 0: in this process")
  p.add_argument("--episodes_per_worker", type=int, default=1, help="episodes a worker holds")
  p.add_argument("--threads", type=int, default=4, help="threads of in-process environments")
  p.add_argument("--step_timeout_s", type=float, default=30.0, help="time limit of a call")
  p.add_argument("--max_episodes", type=int, default=256, help="episodes held at once")
  p.add_argument("--max_request_bytes", type=int, default=DEFAULT_MAX_RESPONSE_BYTES,
                 help="largest request body")
  p.add_argument("--max_response_bytes", type=int, default=DEFAULT_MAX_RESPONSE_BYTES,
                 help="largest answer of the environment")
  p.add_argument("--idle_timeout_s", type=float, default=600.0,
                 help="an episode untouched this long is dropped")
  return p


def main(argv: list[str] | None = None) -> int:
  import uvicorn
  args = parser().parse_args(argv)
  server = build(args)
  sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((args.host, args.port))
  except OSError as e:
    server.envs.close()
    print(f"areal_jax.envs.serve: cannot listen on {args.host}:{args.port} ({e.strerror})",
          file=sys.stderr)
    return 2
  sock.listen(2048)  # connections queue from now on: the line below says the server is there
  port = sock.getsockname()[1]
  print(f"areal_jax.envs.serve: {args.env} on http://{args.host}:{port}", file=sys.stderr, flush=True)
  config = uvicorn.Config(server.app, log_level="warning", lifespan="off")
  try:
    uvicorn.Server(config).run(sockets=[sock])
  finally:
    server.envs.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
