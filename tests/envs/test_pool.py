"""The pool of environment worker processes: faults end their episode with a counted kind and
the worker is restarted, back-pressure when every place is taken, no process left behind."""

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

from areal_jax.envs.base import EnvError
from areal_jax.envs.pool import EnvPool

SYNTHETIC = "areal_jax.envs.synthetic:SyntheticEnv"
GUARD_S = 60  # a stalled test fails here instead of hanging the suite


def run(coro):
  return asyncio.run(asyncio.wait_for(coro, GUARD_S))


@pytest.fixture
def make_pool():
  pools = []

  def make(class_path=SYNTHETIC, **kw):
    kw.setdefault("args", {"huge_bytes": 10 * 1024 * 1024})
    pools.append(EnvPool(class_path, **kw))
    return pools[-1]

  yield make
  for p in pools:
    p.close()
  for p in pools:  # every worker process is gone
    assert all(w.proc is None for w in p.workers)


def alive(pid: int) -> bool:
  """The process exists and is not a zombie (an orphan's reaper may be slow to reap it)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


async def play(pool, actions=("a", "b")):
  env = pool.env()
  try:
    out = [await env.reset({})]
    for a in actions:
      out.append(await env.step(a))
    return out
  finally:
    await env.close()


def test_episodes_play_on_their_own_workers(make_pool):
  pool = make_pool(workers=2, episodes_per_worker=1)

  async def main():
    a, b = pool.env(), pool.env()
    await asyncio.gather(a.reset({}), b.reset({}))
    placed = {a._worker.index, b._worker.index}
    steps = await asyncio.gather(a.step("x"), b.step("y"))
    await asyncio.gather(a.close(), b.close())
    return placed, steps
  placed, steps = run(main())
  assert placed == {0, 1}
  assert steps == [("obs 1", 0.0, False, {"t": 1})] * 2
  assert pool.stats()["episodes"] == 0 and pool.stats()["restarts"] == 0


@pytest.mark.parametrize("fault,kind,restarted", [
    ("hang", "timeout", True), ("exit", "crashed", True), ("raise", "crashed", False),
    ("garbage", "garbage", False), ("huge", "too_large", False)])
def test_a_fault_ends_its_episode_and_the_pool_goes_on(make_pool, fault, kind, restarted):
  pool = make_pool(workers=1, timeout_s=1.0, max_response_bytes=1 << 20)
  pool.start()
  pid = pool.workers[0].proc.pid

  async def main():
    env = pool.env()
    await env.reset({})
    with pytest.raises(EnvError) as e:
      await env.step(f"fault:{fault}")
    await env.close()
    return e.value, await play(pool)  # the next episode plays in full
  error, after = run(main())
  assert error.kind == kind
  assert after[-1] == ("obs 2", 1.0, True, {"t": 2})
  stats = pool.stats()
  assert stats["failures"][kind] == 1 and sum(stats["failures"].values()) == 1
  assert stats["restarts"] == int(restarted)
  assert (pool.workers[0].proc.pid != pid) == restarted
  if restarted:
    assert not alive(pid)


def test_what_an_environment_prints_does_not_reach_the_protocol(make_pool, capfd):
  pool = make_pool(workers=1)
  assert run(play(pool, ["fault:print", "b"]))[-1] == ("obs 2", 1.0, True, {"t": 2})
  assert "chatter" in capfd.readouterr().err  # the worker's standard output is its stderr


def test_a_restart_loses_the_state_of_every_episode_on_that_worker(make_pool):
  pool = make_pool(workers=1, episodes_per_worker=2)

  async def main():
    a, b = pool.env(), pool.env()
    await a.reset({})
    await b.reset({})
    with pytest.raises(EnvError, match="crashed"):
      await a.step("fault:exit")
    with pytest.raises(EnvError, match="state is lost"):
      await b.step("x")
    await a.close()
    await b.close()
  run(main())
  assert pool.stats()["failures"]["crashed"] == 2 and pool.stats()["restarts"] == 1


def test_reset_is_tried_again_but_step_is_not(make_pool):
  pool = make_pool(workers=1)

  async def main():
    env = pool.env()
    with pytest.raises(EnvError, match="crashed"):
      await env.reset({"fault": "exit"})
    await env.close()
  run(main())
  assert pool.stats()["restarts"] == 2  # two tries of the reset, each killed its worker


def test_a_worker_that_died_between_calls_is_replaced(make_pool):
  pool = make_pool(workers=1)
  pool.start()
  proc = pool.workers[0].proc
  os.kill(proc.pid, 9)
  proc.wait()
  assert run(play(pool))[-1] == ("obs 2", 1.0, True, {"t": 2})
  assert pool.stats()["restarts"] == 1 and sum(pool.stats()["failures"].values()) == 0


def test_a_class_that_cannot_load_is_named(make_pool):
  pool = make_pool("areal_jax.envs.synthetic:Nope", workers=1)
  with pytest.raises(EnvError, match="did not start: .*cannot be loaded"):
    run(play(pool))


def test_back_pressure_waits_for_a_free_place(make_pool):
  pool = make_pool(workers=1, episodes_per_worker=1)

  async def main():
    first = pool.env()
    await first.reset({})
    second, third = pool.env(), pool.env()
    waiting = asyncio.ensure_future(second.reset({}))
    cancelled = asyncio.ensure_future(third.reset({}))
    await asyncio.sleep(0.05)
    assert not waiting.done() and pool.stats()["waiting"] == 2
    cancelled.cancel()  # a waiter that gives up leaves the queue
    await asyncio.sleep(0)
    assert pool.stats()["waiting"] == 1
    await first.close()  # its place goes to the first waiting episode
    assert await waiting == "obs 0"
    await second.close()
    return pool.stats()
  stats = run(main())
  assert stats["episodes"] == 0 and stats["waiting"] == 0


def test_workers_exit_when_the_pool_process_is_killed(tmp_path):
  script = textwrap.dedent(f"""
      import os, sys
      from areal_jax.envs.pool import EnvPool
      pool = EnvPool({SYNTHETIC!r}, workers=2)
      pool.start()
      print(" ".join(str(w.proc.pid) for w in pool.workers), flush=True)
      os._exit(0)  # no close, no atexit
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=GUARD_S, check=True).stdout
  pids = [int(p) for p in out.split()]
  assert len(pids) == 2
  deadline = time.monotonic() + GUARD_S
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(alive(p) for p in pids)
