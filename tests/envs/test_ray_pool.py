"""Pool workers as Ray actors on a local cluster: an episode plays; a hang or a death ends its
episode with its kind and the actor is replaced. Slow: a local Ray cluster starts (the pool's
logic is the process pool's, which tests/envs/test_pool.py covers fast)."""

import asyncio

import pytest

from areal_jax.envs.base import EnvError

pytestmark = pytest.mark.slow
SYNTHETIC = "areal_jax.envs.synthetic:SyntheticEnv"
GUARD_S = 120


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
  ray = pytest.importorskip("ray")
  from areal_jax.envs.ray_pool import RayEnvPool
  ray.init(num_cpus=1, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
           object_store_memory=96 * 2**20, log_to_driver=False)
  p = RayEnvPool(SYNTHETIC, {}, workers=1, timeout_s=2.0)
  yield p
  p.close()
  ray.shutdown()


async def play(pool, fault=None):
  env = pool.env()
  try:
    await env.reset({})
    if fault:
      await env.step(f"fault:{fault}")
    return [await env.step("a"), await env.step("b")]
  finally:
    await env.close()


def run(coro):
  return asyncio.run(asyncio.wait_for(coro, GUARD_S))


def test_an_episode_plays_on_an_actor(pool):
  assert run(play(pool))[-1] == ("obs 2", 1.0, True, {"t": 2})


@pytest.mark.parametrize("fault,kind", [("hang", "timeout"), ("exit", "crashed")])
def test_a_fault_replaces_the_actor(pool, fault, kind):
  before = pool.stats()
  actor = pool.workers[0].actor
  with pytest.raises(EnvError) as e:
    run(play(pool, fault))
  assert e.value.kind == kind
  after = pool.stats()
  assert after["restarts"] == before["restarts"] + 1
  assert after["failures"][kind] == before["failures"][kind] + 1
  assert pool.workers[0].actor is not actor
  assert run(play(pool))[-1] == ("obs 2", 1.0, True, {"t": 2})  # the next episode plays
