"""What a run prints when a checkpoint is damaged: one warning, the resume line and the step lines;
no traceback of the reads still in flight, no asyncio message (``--verbosity=1``: the first
traceback). The checkpoints come from one short tiny run per test process (finished_run.py, shared
with test_checkpoint.py), copied per test."""

import asyncio
import glob
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import finished_run  # noqa: E402
from finished_run import RUN, STEPS  # noqa: E402
from test_trainer import ROOT, TINY, tiny_config  # noqa: E402

from areal_jax.runtime import orbax_reads  # noqa: E402

NOISE = ("Traceback", "Event loop is closed", "Task exception was never retrieved",
         "Task was destroyed", "tensorstore_spec", "never awaited")


def test_a_failed_orbax_run_cancels_and_awaits_its_other_reads():
  from orbax.checkpoint._src import asyncio_utils

  assert orbax_reads.install() and orbax_reads.install()  # idempotent
  ended = []

  async def read(i):
    try:
      if i == 0:
        raise OSError("a truncated file")
      await asyncio.sleep(60)  # a read still in flight (a slow bucket)
    finally:
      ended.append(i)

  async def restore():
    return await asyncio.gather(*(read(i) for i in range(4)))

  with pytest.raises(OSError, match="truncated"):
    asyncio_utils.run_sync(restore())
  assert sorted(ended) == [0, 1, 2, 3]  # each one ended (cancelled) before run_sync returned

  async def fine():
    return 7
  assert asyncio_utils.run_sync(fine()) == 7


def test_a_read_failing_in_the_last_pass_of_a_failed_run_is_not_logged(caplog):
  """A second read fails in the very pass that stops the loop (after the gather gave up): its
  exception is retrieved all the same, so nothing is logged when the task is collected."""
  import gc
  import logging

  from orbax.checkpoint._src import asyncio_utils

  orbax_reads.install()

  async def restore():
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()

    async def read(f):
      await f

    tasks = [asyncio.ensure_future(read(first)), asyncio.ensure_future(read(second))]
    together = asyncio.gather(*tasks)
    # the second read fails two passes after the first: with the pass that stops the loop
    tasks[0].add_done_callback(lambda _: loop.call_soon(second.set_exception, OSError("second")))
    loop.call_soon(first.set_exception, OSError("a truncated file"))
    return await together

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    with pytest.raises(OSError, match="truncated"):
      asyncio_utils.run_sync(restore())
    gc.collect()
  assert not [n for n in NOISE if n in caplog.text], caplog.text


def test_a_damaged_weights_version_is_one_warning(tmp_path, capfd):
  """Every data file of the newest version cut short: a rollout worker (or the server's watcher)
  warns in one line, without TensorStore's spec, and loads the version before it."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from areal_jax.runtime import weight_transfer as wt

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  sharded = NamedSharding(mesh, P("data"))
  params = {f"layer{i}": {"w": jax.device_put(np.full((8, 64), i, np.float32), sharded)}
            for i in range(8)}
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded), params)
  pub, receiver = wt.OrbaxPublisher(tmp_path, keep=3), wt.OrbaxReceiver(tmp_path, target)
  for v in (1, 2):
    pub.publish(params, v)
  for path in glob.glob(str(tmp_path / "2" / "**" / "d" / "*"), recursive=True):
    os.truncate(path, os.path.getsize(path) // 2)
  capfd.readouterr()
  version, _ = receiver.fetch_newer(None)
  pub.close()
  receiver.close()
  assert version == 1
  out, err = capfd.readouterr()
  lines = (out + err).strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("warning: weights version 2 under "), lines
  assert not [n for n in NOISE if n in out + err]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """A finished 3-step run with checkpoints 1, 2 and 3 (finished_run.RUN)."""
  return finished_run.workdir(tmp_path_factory)


def damaged_copy(src, dst, which):
  """``dst``: a copy of the run whose newest checkpoint has every data file (``all``) or the largest
  one (``one``: some arrays) cut short."""
  shutil.copytree(src, dst)
  files = glob.glob(str(dst / "checkpoints" / str(STEPS) / "state" / "**" / "d" / "*"),
                    recursive=True)
  for path in files if which == "all" else [max(files, key=os.path.getsize)]:
    os.truncate(path, os.path.getsize(path) // 2)
  return dst


@pytest.mark.slow
@pytest.mark.parametrize("which", ["all", "one"])
def test_a_rerun_past_a_damaged_checkpoint_prints_its_progress_only(tiny_run, tmp_path, which):
  """Rerun with more steps (other settings than the checkpoints were saved with: still damage)."""
  workdir = damaged_copy(tiny_run, tmp_path / "run", which)
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={workdir}"]
  cmd += [f"--config.{key}={value}" for key, value in RUN.items() if key != "train.total_steps"]
  cmd += [f"--config.train.total_steps={STEPS + 1}"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  err, lines = out.stderr.splitlines(), out.stdout.splitlines()
  # the memory plans' one line each (on CPU too: the host's memory is their budget), then progress
  plans = [line.split(":")[0] for line in lines[:2]]
  assert plans == ["learner memory plan", "sampler memory plan"], lines
  lines = lines[2:]
  assert len(err) == 1 and err[0].startswith(f"warning: checkpoint {STEPS} is unusable: state/"), err
  assert "moved aside" in err[0] and "trying an older one" in err[0]
  assert lines[0] == f"resumed from {workdir / 'checkpoints'} at version {STEPS - 1}", lines
  assert [line.split()[:2] for line in lines[1:-1]] == [["step", f"{s}/{STEPS + 1}"]
                                                        for s in (STEPS, STEPS + 1)], lines
  assert lines[-1].startswith("curves: ") and len(lines) == 4
  assert not [n for n in NOISE if n in out.stdout + out.stderr]


@pytest.mark.slow
def test_verbosity_shows_the_first_traceback_only(tiny_run, tmp_path, capsys):
  from absl import logging

  from areal_jax import learner as learner_lib
  from areal_jax import models
  from areal_jax.runtime import checkpoint as ckpt_lib
  from areal_jax.runtime import meshes

  workdir = damaged_copy(tiny_run, tmp_path / "run", "all")
  c = tiny_config(**RUN)
  model, _ = models.load(c.model.source, dtype=c.model.dtype, seed=c.seed)
  learner = learner_lib.Learner(model, c.actor, meshes.build(c.mesh)[0],
                                temperature=c.rollout.temperature, total_steps=STEPS,
                                max_seq_len=c.rollout.max_prompt_len + 16)
  before = logging.get_verbosity()
  logging.set_verbosity(1)
  try:
    ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3, config=c)
    assert ckpt.restore_latest(learner.state)[0] == STEPS - 1
    ckpt.close()
  finally:
    logging.set_verbosity(before)
  err = capsys.readouterr().err
  assert err.count("Traceback") == 1 and err.count(f"checkpoint {STEPS} is unusable") == 1, err
  assert "Event loop is closed" not in err
