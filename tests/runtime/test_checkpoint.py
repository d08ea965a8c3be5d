"""Damaged run directories: real checkpoints of one short tiny run (finished_run.py: written once
per test process, copied per test) are truncated, stripped of their metadata, replaced by another
model's shapes or made unwritable; resume falls back to the newest good checkpoint, rewinds
consistently, and the expected faults end in short messages."""

import errno
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import finished_run  # noqa: E402
from finished_run import ETA, RUN, STEPS  # noqa: E402
from processes import running  # noqa: E402
from test_trainer import ROOT, TINY, check_run, tiny_config  # noqa: E402

from areal_jax.runtime import checkpoint as ckpt_lib  # noqa: E402
from areal_jax.runtime.errors import RunDirError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """A finished 3-step run with checkpoints 1, 2, 3, and the learner state it expects."""
  from areal_jax import learner as learner_lib
  from areal_jax import models
  from areal_jax.runtime import meshes

  workdir = finished_run.workdir(tmp_path_factory)
  c = tiny_config(**RUN)
  learner_mesh, _ = meshes.build(c.mesh)
  model, _ = models.load(c.model.source, dtype=c.model.dtype, seed=c.seed)
  learner = learner_lib.Learner(model, c.actor, learner_mesh, temperature=c.rollout.temperature,
                                total_steps=STEPS, max_seq_len=c.rollout.max_prompt_len + 16)
  return workdir, learner.state


@pytest.fixture
def run(tiny_run, tmp_path):
  src, state = tiny_run
  workdir = tmp_path / "run"
  shutil.copytree(src, workdir)
  return workdir, state


def truncate_largest_array_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  biggest = max(files, key=os.path.getsize)
  with open(biggest, "r+b") as f:
    f.truncate(os.path.getsize(biggest) // 3)


def corrupt_dirs(ckpt_dir, step):
  return sorted(p for p in os.listdir(ckpt_dir) if p.startswith(f"{step}.corrupt-"))


@pytest.mark.slow
def test_truncated_arrays_fall_back_to_the_previous_checkpoint(run, capsys):
  workdir, state = run
  ckpt_dir = workdir / "checkpoints"
  truncate_largest_array_file(ckpt_dir / "3")
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  step, restored, meta = ckpt.restore_latest(state)
  ckpt.close()
  assert step == 2 and meta["version"] == 2 and int(restored["version"]) == 2
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "checkpoint 3 is unusable" in err[0] and "state/" in err[0], err
  [moved] = corrupt_dirs(ckpt_dir, 3)  # kept, not deleted, with the damaged files in it
  assert os.path.isdir(ckpt_dir / moved / "state")
  assert sorted(p for p in os.listdir(ckpt_dir) if p.isdigit()) == ["1", "2"]


def test_missing_metadata_file_is_named(run, capsys):
  workdir, state = run
  os.remove(workdir / "checkpoints" / "3" / "meta" / "metadata")
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  assert ckpt.restore_latest(state)[0] == 2
  ckpt.close()
  err = capsys.readouterr().err
  assert "checkpoint 3" in err and "meta/metadata" in err


def test_checkpoint_of_another_model_is_not_restored(run, capsys):
  workdir, state = run
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5)
  _, _, meta = ckpt.restore_latest(state)
  wider = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
                       if np.ndim(x) == 2 else np.asarray(x), state)
  ckpt.save(4, wider, dict(meta, version=4))
  step, restored, _ = ckpt.restore_latest(state)
  ckpt.close()
  assert step == 3
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.shape == want.shape and got.dtype == want.dtype
  err = capsys.readouterr().err
  assert "checkpoint 4 is unusable" in err and "another model" in err
  assert corrupt_dirs(workdir / "checkpoints", 4)


def test_a_checkpoint_saved_with_other_settings_is_named_and_left_in_place(run, capsys):
  """The run's checkpoints record its settings: a rerun whose model they do not fit (another
  model.source in the same workdir) stops naming the keys that differ, and moves nothing aside;
  arrays that do not fit under the same settings are still damage."""
  workdir, state = run
  ckpt_dir = workdir / "checkpoints"
  c = tiny_config(**RUN)
  other = tiny_config(**{**RUN, "model.source": "small", "train.total_steps": 9})
  wider = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
                       if np.ndim(x) == 2 else np.asarray(x), state)
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5, config=other)
  with pytest.raises(RunDirError) as info:
    ckpt.restore_latest(wider)
  ckpt.close()
  message = str(info.value)
  assert message.startswith(f"checkpoint 3 in {ckpt_dir} does not fit this run: state/"), message
  assert ("saved with other settings: model.source: 'tiny' then, 'small' now; "
          f"train.total_steps: {STEPS} then, 9 now.") in message
  assert "--config.train.resume=False" in message
  assert sorted(os.listdir(ckpt_dir)) == ["1", "2", "3"]  # nothing moved aside
  assert capsys.readouterr().err == ""

  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5, config=c)
  _, _, meta = ckpt.restore_latest(state)  # the run's own settings: restored
  assert meta["config"]["model"]["source"] == "tiny"
  ckpt.save(4, wider, dict(meta, version=4))  # the same settings, arrays of another shape: damage
  assert ckpt.restore_latest(state)[0] == 3
  ckpt.close()
  assert corrupt_dirs(ckpt_dir, 4) and "checkpoint 4 is unusable" in capsys.readouterr().err


def test_no_usable_checkpoint_stops_and_never_starts_over(run):
  workdir, state = run
  for step in (1, 2, 3):
    truncate_largest_array_file(workdir / "checkpoints" / str(step))
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  with pytest.raises(RunDirError) as e:
    ckpt.restore_latest(state)
  ckpt.close()
  msg = str(e.value)
  assert all(f"checkpoint {s}:" in msg for s in (1, 2, 3))
  assert "--config.train.resume=False" in msg and len(msg.splitlines()) <= 6
  # Everything was moved aside, so a second attempt finds no step: it must still refuse.
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  with pytest.raises(RunDirError, match="moved aside earlier"):
    ckpt.restore_latest(state)
  ckpt.close()
  # resume=False starts over, keeping the old directory.
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3, resume=False)
  assert ckpt.restore_latest(state) is None
  ckpt.close()
  [old] = glob.glob(str(workdir / "checkpoints.old-*"))
  assert len(corrupt_dirs(old, 1) + corrupt_dirs(old, 2) + corrupt_dirs(old, 3)) == 3


@pytest.mark.parametrize("keep_every, kept", [(0, [6, 7]), (3, [3, 6, 7])])
def test_the_newest_and_every_kth_checkpoint_are_kept(tmp_path, keep_every, kept):
  ckpt = ckpt_lib.Checkpointer(str(tmp_path), keep=2, keep_every=keep_every)
  for step in range(1, 8):
    ckpt.save(step, {"w": np.full(3, step, np.float32)}, {"step": step})
  assert ckpt.steps() == kept
  ckpt.close()
  assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == kept


def _fail_json_write(monkeypatch, err):
  def fail(self, x, directory):
    raise err
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", fail)


@pytest.mark.parametrize("err", [OSError(errno.ENOSPC, "No space left on device"),
                                 PermissionError(errno.EACCES, "Permission denied"),
                                 OSError(errno.EIO, "Input/output error")], ids=str)
@pytest.mark.slow
def test_failed_save_leaves_the_previous_checkpoint(run, monkeypatch, err):
  workdir, state = run
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  _, restored, meta = ckpt.restore_latest(state)
  _fail_json_write(monkeypatch, err)
  with pytest.raises(RunDirError) as e:
    ckpt.save(4, restored, dict(meta, version=4))
  assert err.strerror in str(e.value) and "checkpoint 3 is intact" in str(e.value)
  monkeypatch.undo()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2", "3"]  # no half-written 4
  assert ckpt.steps() == [1, 2, 3]
  ckpt.close()
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  assert ckpt.restore_latest(state)[0] == 3
  ckpt.close()


def test_save_failing_after_its_commit_keeps_the_checkpoint(run, monkeypatch):
  """A learner process lost just after Orbax renamed the step into place fails the save at its last
  barrier: the committed checkpoint is complete and stays; the next run resumes from it."""
  from orbax.checkpoint._src.path import atomicity

  workdir, state = run
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5)
  _, restored, meta = ckpt.restore_latest(state)
  commit = atomicity.on_commit_callback

  async def commit_then_fail(*args, **kwargs):
    await commit(*args, **kwargs)
    raise RuntimeError("Barrier timed out: learner process 1 is gone")

  monkeypatch.setattr(atomicity, "on_commit_callback", commit_then_fail)
  with pytest.raises(RunDirError) as e:
    ckpt.save(4, restored, dict(meta, version=4))
  assert "checkpoint 4 was written completely" in str(e.value) and "Barrier" in str(e.value)
  monkeypatch.undo()
  ckpt.close()
  assert ckpt_lib.committed(str(workdir / "checkpoints" / "4"))
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5)
  step, _, meta4 = ckpt.restore_latest(state)
  ckpt.close()
  assert step == 4 and meta4["version"] == 4


@pytest.mark.slow
def test_learner_processes_agree_on_each_checkpoint(tmp_path):
  """Two processes restore one run directory: a checkpoint one process cannot use is unusable for
  both, they fall back to the same older one, and only process 0 moves it aside."""
  from areal_jax.runtime import distributed

  coordinator = f"127.0.0.1:{distributed.free_port()}"
  worker = pathlib.Path(__file__).parent / "checkpoint_worker.py"
  with running([sys.executable, str(worker), str(i), "2", coordinator, str(tmp_path)]
               for i in range(2)) as procs:
    logs = [p.communicate(timeout=240)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
  got = [json.loads((tmp_path / f"restored.{i}.json").read_text()) for i in range(2)]
  step1 = (np.arange(32, dtype=np.float32).reshape(8, 4)).tolist()
  for out in got:
    for case in ("one_host", "all_hosts"):
      assert out[case] == dict(step=1, w=step1, version=1), (case, out[case])
  listing = got[0]["listing"]
  assert listing[0] == "1" and len(listing) == 3, listing
  assert listing[1].startswith("2.corrupt-") and listing[2].startswith("3.corrupt-"), listing
  warned = [[line for line in log.splitlines() if line.startswith("warning: checkpoint")]
            for log in logs]
  assert "checkpoint 2 is unusable: unusable on learner process 1" in warned[0][0], warned
  assert "simulated" in warned[1][0] and "moved aside by learner process 0" in warned[1][0], warned
  assert "checkpoint 3 is unusable" in warned[0][1] and "meta/metadata" in warned[0][1], warned


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_fails_the_save_cleanly(run):
  workdir, state = run
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=3)
  _, restored, meta = ckpt.restore_latest(state)
  os.chmod(workdir / "checkpoints", 0o555)
  try:
    with pytest.raises(RunDirError, match="could not save checkpoint 4"):
      ckpt.save(4, restored, dict(meta, version=4))
  finally:
    os.chmod(workdir / "checkpoints", 0o755)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2", "3"]
  ckpt.close()


def audit(workdir, steps):
  """check_run's audit, plus: no example trained twice, metrics and dumps cover 1..steps once."""
  rows, samples = check_run(str(workdir), steps, ETA)
  trained = [s["example_id"] for s in samples if s["index"] == 0]
  assert len(trained) == len(set(trained)) == steps * 4
  return rows, samples


@pytest.mark.slow
def test_resumed_run_rewinds_past_a_damaged_checkpoint_and_finishes(run, capsys):
  from areal_jax.runtime import trainer

  workdir, _ = run
  truncate_largest_array_file(workdir / "checkpoints" / "3")
  capsys.readouterr()
  trainer.run(tiny_config(**dict(RUN, **{"train.total_steps": STEPS + 1})), str(workdir))
  out = capsys.readouterr()
  assert f"resumed from {workdir / 'checkpoints'} at version 2" in out.out
  assert out.err.count("is unusable") == 1
  audit(workdir, STEPS + 1)  # steps 3 and 4 retrained once each, rows after 2 replaced


@pytest.mark.slow
def test_run_stops_on_a_failed_save_then_resumes(run, monkeypatch):
  """Resumed at 3, the run trains step 4 and stops on its failed save, leaving checkpoints 1-3;
  the rerun redoes step 4 (the run's last: one step past the failure is all it must cross)."""
  from areal_jax.runtime import trainer

  workdir, _ = run
  real = ckpt_lib.Checkpointer.save

  def save(self, step, state, meta):
    if step == 4:
      _fail_json_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    return real(self, step, state, meta)

  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
  c = tiny_config(**dict(RUN, **{"train.total_steps": 4}))
  with pytest.raises(RunDirError, match="No space left on device"):
    trainer.run(c, str(workdir))
  monkeypatch.undo()
  assert sorted(p for p in os.listdir(workdir / "checkpoints")) == ["1", "2", "3"]
  trainer.run(c, str(workdir))
  audit(workdir, 4)


@pytest.mark.slow
@pytest.mark.parametrize("verbosity", [None, 1])
def test_launch_prints_no_usable_checkpoint_briefly(run, verbosity):
  workdir, _ = run
  for step in (1, 2, 3):
    os.remove(workdir / "checkpoints" / str(step) / "meta" / "metadata")
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={workdir}",
         f"--config.train.total_steps={STEPS}"] + ([f"--verbosity={verbosity}"] if verbosity else [])
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  if verbosity:
    assert "Traceback" in out.stderr
  else:
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr and len(lines) <= 12, out.stderr
    assert any(line.startswith("error: no usable checkpoint") for line in lines)
    assert "--config.train.resume=False" in out.stderr


def test_rewind_drops_the_trajectory_dumps_of_redone_steps(run):
  from areal_jax.runtime import trainer

  workdir, _ = run
  (workdir / "trajectories" / "step_000002.jsonl.tmp").write_text("torn\n")
  trainer._TrajectoryDump.drop_after(str(workdir), 1)  # pylint: disable=protected-access
  assert sorted(os.listdir(workdir / "trajectories")) == ["step_000000.jsonl"]


@pytest.mark.slow
def test_resume_false_starts_over_keeping_the_old_run(run):
  from areal_jax.runtime import trainer

  workdir, _ = run
  trainer.run(tiny_config(**dict(RUN, **{"train.total_steps": 1, "train.resume": False})),
              str(workdir))
  audit(workdir, 1)
  for name, content in (("checkpoints", ["1", "2", "3"]),
                        ("trajectories", [f"step_{s:06d}.jsonl" for s in range(3)])):
    [old] = glob.glob(str(workdir / f"{name}.old-*"))
    assert sorted(os.listdir(old)) == content
  [old_metrics] = glob.glob(str(workdir / "metrics.jsonl.old-*"))
  assert len(open(old_metrics).read().splitlines()) == STEPS
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]
