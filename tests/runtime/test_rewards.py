"""The reward pool: a crashing or hanging reward scores 0, is counted, and never stalls scoring."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import reward_fns  # noqa: E402

from areal_jax.runtime.rewards import RewardPool  # noqa: E402
from areal_jax.tasks import get_task  # noqa: E402


@pytest.mark.slow
def test_scores_crashes_and_timeouts():
  pools = [RewardPool(fn, workers=1, timeout_s=3.0)
           for fn in (reward_fns.ok, reward_fns.crash, reward_fns.hang)]
  ok, crash, hang = pools
  try:
    assert ok.score(["7", "8"], {"answer": "7"}) == ([1.0, 0.0], 0)
    rewards, failed = crash.score(["7", "8"], {"answer": "7"})
    assert rewards == [0.0, 0.0] and failed == 2 and crash.failures == 2
    t0 = time.time()
    rewards, failed = hang.score(["7"], {"answer": "7"})
    assert rewards == [0.0] and failed == 1 and hang.timeouts == 1
    assert time.time() - t0 < 10
    # The hung worker was replaced: the pool keeps scoring (and timing out) without stalling.
    assert hang.score(["7"], {"answer": "7"}) == ([0.0], 1) and hang.timeouts == 2
  finally:
    for pool in pools:
      pool.close()


def test_task_reward_runs_in_workers():
  task = get_task({"name": "gsm8k"})
  example = task.test_examples(1)[0]
  answer = example["answer"].split("####")[-1].strip()
  pool = RewardPool(task.reward_fn, workers=1, timeout_s=30.0)
  try:
    rewards, _ = pool.score([f"so \\boxed{{{answer}}}", "no idea"], example)
  finally:
    pool.close()
  assert rewards == [1.0, 0.0]


_OWNER = """
import os, sys, time
sys.path.insert(0, {here!r})
import reward_fns
from areal_jax.runtime.rewards import RewardPool
pool = RewardPool(reward_fns.ok, workers=2, timeout_s=30.0)
print(*pool._pool._processes, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except FileNotFoundError:
    return False


def test_workers_exit_when_their_owner_is_killed():
  """A run killed with SIGKILL (no clean-up runs) leaves no reward worker behind."""
  owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(here=str(pathlib.Path(__file__).parent))],
                           stdout=subprocess.PIPE, text=True)
  try:
    workers = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(workers) == 2 and all(_alive(pid) for pid in workers)
  finally:
    owner.kill()
    owner.wait()
  deadline = time.time() + 10
  while any(_alive(pid) for pid in workers) and time.time() < deadline:
    time.sleep(0.1)
  survivors = [pid for pid in workers if _alive(pid)]
  for pid in survivors:
    os.kill(pid, signal.SIGKILL)
  assert not survivors, f"reward workers {survivors} outlived their killed owner"
