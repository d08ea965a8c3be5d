"""Environments over HTTP: the reference server and the client, on loopback, round trip and faults."""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from areal_jax.envs.base import EnvError, InProcessEnvs
from areal_jax.envs.remote import RemoteEnvs
from areal_jax.envs.serve import EnvServer

SYNTHETIC = "areal_jax.envs.synthetic:SyntheticEnv"
GUARD_S = 60


def run(coro):
  return asyncio.run(asyncio.wait_for(coro, GUARD_S))


@contextlib.contextmanager
def serving(app):
  """``app`` on 127.0.0.1 (a free port) in a thread; yields its URL; stopped at the end."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
  thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
  thread.start()
  deadline = time.monotonic() + GUARD_S
  while not server.started and time.monotonic() < deadline:
    time.sleep(0.01)
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(GUARD_S)
    sock.close()
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def env_server():
  """A server of the synthetic environment in process, each call limited to 0.5 s."""
  envs = InProcessEnvs(SYNTHETIC, {"hang_s": 1.0}, threads=2, timeout_s=0.5)
  server = EnvServer(envs, SYNTHETIC, max_episodes=2)
  with serving(server.app) as url:
    yield server, url
  envs.close()


async def play(envs, actions=("a", "b")):
  env = envs.env()
  try:
    out = [await env.reset({"id": 1})]
    for a in actions:
      out.append(await env.step(a))
    return out
  finally:
    await env.close()
    await envs.aclose()


def test_round_trip(env_server):
  server, url = env_server
  out = run(play(RemoteEnvs(url)))
  assert out == ["obs 0", ("obs 1", 0.0, False, {"t": 1}), ("obs 2", 1.0, True, {"t": 2})]
  assert server.episodes == {}  # closed


@pytest.mark.parametrize("fault,kind", [("hang", "timeout"), ("raise", "crashed"),
                                        ("garbage", "garbage"), ("huge", "too_large")])
def test_a_failed_call_ends_the_episode_with_its_kind(env_server, fault, kind):
  server, url = env_server
  envs = RemoteEnvs(url, timeout_s=5.0)

  async def main():
    env = envs.env()
    await env.reset({})
    with pytest.raises(EnvError) as e:
      await env.step(f"fault:{fault}")
    with pytest.raises(EnvError, match="unknown_episode|no episode"):  # the server dropped it
      await env.step("x")
    await env.close()
    await envs.aclose()
    return e.value
  assert run(main()).kind == kind
  assert server.episodes == {}


def test_client_bounds_time_and_size(env_server):
  _, url = env_server

  async def big(_):
    return JSONResponse({"observation": "x" * 5000})

  async def main(url, big_url):
    slow, small = RemoteEnvs(url, timeout_s=0.1), RemoteEnvs(big_url, max_response_bytes=1024)
    env = slow.env()
    await env.reset({})
    errors = []
    for call in (env.step("fault:hang"), small.env().reset({})):
      with pytest.raises(EnvError) as e:
        await call
      errors.append(e.value.kind)
    await env.close()
    await slow.aclose()
    await small.aclose()
    return errors
  with serving(Starlette(routes=[Route("/reset", big, methods=["POST"])])) as big_url:
    assert run(main(url, big_url)) == ["timeout", "too_large"]


def test_a_full_server_delays_resets_and_bad_requests_are_named(env_server):
  server, url = env_server

  async def main():
    envs = RemoteEnvs(url, timeout_s=5.0)
    held = [envs.env(), envs.env()]  # the server's two places
    for env in held:
      await env.reset({})
    third = envs.env()
    waiting = asyncio.ensure_future(third.reset({}))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # busy: it waits, as back-pressure
    await held[0].close()
    assert await waiting == "obs 0"
    impatient = RemoteEnvs(url, timeout_s=0.6)
    with pytest.raises(EnvError, match="timeout: the environment server stayed full"):
      await impatient.env().reset({})
    await impatient.aclose()
    for env in (held[1], third):
      await env.close()
    errors = []
    for body in ({"episode_id": "../x", "example": {}}, {"episode_id": "a", "example": 3}):
      with pytest.raises(EnvError) as e:
        await envs.post("/reset", body)
      errors.append(e.value.message)
    await envs.aclose()
    return errors
  errors = run(main())
  assert "episode_id must be" in errors[0] and "example must be a JSON object" in errors[1]
  assert server.episodes == {}


def test_a_server_that_answers_garbage_or_nothing():
  async def garbage(_):
    return Response(b"\x00not json", media_type="text/plain")

  async def wrong_shape(_):
    return JSONResponse({"observation": "o"})  # no reward, done, info

  app = Starlette(routes=[Route("/reset", garbage, methods=["POST"]),
                         Route("/step", wrong_shape, methods=["POST"]),
                         Route("/close", wrong_shape, methods=["POST"])])

  async def main(url):
    envs = RemoteEnvs(url, reset_retries=0)
    env = envs.env()
    kinds = []
    for call in (env.reset({}), env.step("a")):
      with pytest.raises(EnvError) as e:
        await call
      kinds.append(e.value.kind)
    await env.close()
    await envs.aclose()
    return kinds
  with serving(app) as url:
    assert run(main(url)) == ["garbage", "garbage"]
  with socket.socket() as s:  # nothing listens there: refused
    s.bind(("127.0.0.1", 0))
    closed_url = f"http://127.0.0.1:{s.getsockname()[1]}"
  with pytest.raises(EnvError, match="crashed"):
    run(play(RemoteEnvs(closed_url, reset_retries=0)))


def test_the_reference_server_command_with_a_pool():
  """``python -m areal_jax.envs.serve`` with worker processes: a worker that dies is restarted."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "areal_jax.envs.serve", f"--env={SYNTHETIC}", "--port=0",
       "--workers=1", "--step_timeout_s=5"], stderr=subprocess.PIPE, text=True)
  try:
    line = proc.stderr.readline()
    assert " on http://127.0.0.1:" in line, line
    url = line.split(" on ")[1].strip()

    async def main():
      envs = RemoteEnvs(url)
      env = envs.env()
      await env.reset({})
      with pytest.raises(EnvError, match="crashed"):
        await env.step("fault:exit")
      out = await play(envs)
      return out
    assert run(main())[-1] == ("obs 2", 1.0, True, {"t": 2})
    import httpx2
    health = httpx2.get(f"{url}/health", timeout=GUARD_S, trust_env=False).json()
    assert health["restarts"] == 1 and health["failures"]["crashed"] == 1
    assert health["episodes"] == 0 and health["env"] == SYNTHETIC
  finally:
    proc.terminate()
    proc.wait(GUARD_S)
    proc.stderr.close()
