"""End to end on the tiny preset: the asynchronous loop runs, the staleness bound holds, partial
rollouts mix versions, and a SIGKILLed run resumes from its last checkpoint."""

import glob
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from areal_jax import config as config_lib
from areal_jax.runtime import metrics as metrics_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"


def tiny_config(**overrides):
  c = config_lib.load(TINY)
  for key, value in overrides.items():
    config_lib.override(c, key, value)
  return c


def trajectories(workdir):
  rows = []
  for path in sorted(glob.glob(os.path.join(workdir, "trajectories", "step_*.jsonl"))):
    with open(path) as f:
      rows += [json.loads(line) for line in f]
  return rows


def check_run(workdir, steps, eta):
  rows = metrics_lib.read(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  for r in rows:
    assert set(metrics_lib.REQUIRED_FIELDS) <= set(r)
    assert isinstance(r["compiles"], int) and r["compiles"] >= 0
    assert r["staleness_max"] <= eta
  samples = trajectories(workdir)
  assert len(samples) == steps * 4 * 4  # B groups x n samples per step
  for s in samples:
    assert s["staleness"] == s["trained_at_version"] - min(s["versions"])
    assert 0 <= s["staleness"] <= eta, s
    assert s["versions"] == sorted(s["versions"])  # versions never go back within a sequence
  return rows, samples


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 2])
def test_tiny_run_respects_the_staleness_bound(tmp_path, eta):
  from areal_jax.runtime import trainer

  steps = 5
  c = tiny_config(**{"rollout.max_head_offpolicyness": eta, "train.total_steps": steps,
                     "train.dump_trajectories": True, "rollout.max_new_tokens": 48})
  if eta:
    # Make generation the bottleneck, as it is in real RL: short prompts (cheap training), long
    # generations (the random model rarely stops) on few slots. Weight updates then land
    # mid-sequence.
    for key, value in {"task.name": "arithmetic", "rollout.max_prompt_len": 384,
                       "rollout.prefill_buckets": (128, 256, 384), "rollout.max_new_tokens": 256,
                       "rollout.num_slots": 4}.items():
      config_lib.override(c, key, value)
  trainer.run(c, str(tmp_path))
  rows, samples = check_run(str(tmp_path), steps, eta)
  # the sampler's compilations, running totals: prefill, insert and generate at least
  sampler = [(r["sampler_compiles"], r["sampler_compile_s"]) for r in rows]
  assert sampler[0][0] >= 3 and sampler[0][1] > 0 and sampler == sorted(sampler)
  if eta == 0:  # synchronous: batch s+1 is generated entirely by version s
    assert all(set(s["versions"]) == {s["trained_at_version"]} for s in samples)
  else:  # partial rollouts: some sequences continue across a weight update
    assert any(len(set(s["versions"])) > 1 for s in samples)
  assert os.listdir(tmp_path / "tensorboard")
  assert os.path.isdir(tmp_path / "checkpoints")


@pytest.mark.slow
def test_sigkill_then_rerun_resumes(tmp_path, tmp_path_factory):
  steps = 6
  cache = tmp_path_factory.mktemp("compile_cache")
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path}",
         f"--config.train.total_steps={steps}", "--config.train.checkpoint_every=1",
         "--config.train.dump_trajectories=True", "--config.rollout.max_head_offpolicyness=1",
         f"--config.runtime.compile_cache_dir={cache}"]
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the session's (conftest.py): the run's key takes over
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpt_dir = tmp_path / "checkpoints"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    done = [p for p in (ckpt_dir.glob("[0-9]*") if ckpt_dir.exists() else []) if p.name.isdigit()]
    if any(int(p.name) >= 2 for p in done):
      break
    time.sleep(0.2)
  assert proc.poll() is None, "the run ended before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  killed_at = max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  assert killed_at < steps

  cached = set(os.listdir(cache))
  assert cached, "the killed run left no compiled programs in runtime.compile_cache_dir"

  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resumed from {ckpt_dir} at version {killed_at}" in out.stdout
  rows, samples = check_run(str(tmp_path), steps, eta=1)
  # No prompt is trained twice, and every one comes from the head of the data order.
  task_config = config_lib.load(TINY).task
  from areal_jax.tasks import get_task

  order = [ex["id"] for ex, _ in zip(get_task(task_config).train_iterator(seed=0, epochs=1),
                                     range(steps * 4 + 4 * 3))]
  trained = [s["example_id"] for s in samples if s["index"] == 0]
  assert len(trained) == len(set(trained)) == steps * 4
  assert set(trained) <= set(order)


@pytest.mark.slow
def test_a_run_whose_sampler_times_its_decode_launches_first(tmp_path, monkeypatch, capsys):
  """The run's sampler offered a launch to time, as on a GPU (``rollout.decode_tuning``; here
  the decode loop in CUDA graphs, options XLA:CPU takes and ignores): it is timed once, before
  the first decode, the one kept printed, and the run trains on it within the staleness bound."""
  import dataclasses

  import jax

  from areal_jax.runtime import trainer
  from areal_jax.sampler import launch_tuning
  from areal_jax.sampler.engine import DecodeEngine

  monkeypatch.setattr(DecodeEngine, "launch_stages", lambda self: [
      lambda kept: [kept, dataclasses.replace(kept, graphs="unrolled")]])
  timed = []

  def measure(call):  # the graphs (every second call) are faster
    jax.block_until_ready(call())
    timed.append(1)
    return 0.5 if len(timed) % 2 == 0 else 1.0

  monkeypatch.setattr(launch_tuning, "wall_seconds", measure)
  # the wait for a batch prints a line at each poll that finds none; the first poll finds none
  # (a first batch can be ready within one poll when the programs come from the compile cache)
  from areal_jax.runtime.staleness import StalenessController
  take_batch, polls = StalenessController.take_batch, []

  def first_poll_empty(self, step=None, timeout=None):
    polls.append(step)
    return None if len(polls) == 1 else take_batch(self, step, timeout)

  monkeypatch.setattr(StalenessController, "take_batch", first_poll_empty)
  monkeypatch.setattr(trainer, "WAIT_NOTE_S", 0.0)
  c = tiny_config(**{"train.total_steps": 2, "train.dump_trajectories": True,
                     "rollout.max_head_offpolicyness": 1})
  trainer.run(c, str(tmp_path))
  check_run(str(tmp_path), 2, eta=1)
  assert len(timed) == 2 * (1 + launch_tuning.ROUNDS)  # once, before the first decode
  out = capsys.readouterr().out
  assert "sampler decode launch: graphs:unrolled (" in out
  # the first batch took the timing, compiles and generation: its wait showed progress
  assert re.search(r"step 1/2  waiting \d+s for \d+ groups: \d+ ready, \d+ generating", out)


@pytest.mark.slow
def test_colocated_run_alternates_on_one_shared_mesh(tmp_path):
  """mesh.colocated: both meshes are the first learner_devices devices, generation pauses while a
  step trains, and the same staleness bound and partial rollouts hold."""
  from areal_jax.runtime import meshes, trainer

  steps = 3
  c = tiny_config(**{"mesh.colocated": True, "mesh.learner_devices": 2,
                     "rollout.max_head_offpolicyness": 1, "train.total_steps": steps,
                     "train.dump_trajectories": True, "rollout.max_new_tokens": 32})
  learner_mesh, sampler_mesh = meshes.build(c.mesh)
  assert list(learner_mesh.devices.flat) == list(sampler_mesh.devices.flat)
  assert len(learner_mesh.devices.flat) == 2
  trainer.run(c, str(tmp_path))
  check_run(str(tmp_path), steps, eta=1)


def test_colocated_mesh_larger_than_the_host_is_rejected():
  c = tiny_config(**{"mesh.colocated": True, "mesh.learner_devices": 16})
  with pytest.raises(ValueError, match="mesh.learner_devices=16"):
    config_lib.validate(c, 8)


@pytest.mark.slow
def test_a_learner_that_cannot_fit_stops_before_the_first_step(tmp_path):
  """The memory plan runs before anything trains: on an impossible budget the run stops naming
  the keys to change, and nothing is written to metrics.jsonl."""
  from areal_jax.runtime import trainer

  c = tiny_config(**{"mesh.device_memory_gib": 1e-4, "actor.micro_batch_tokens": 1024})
  with pytest.raises(MemoryError, match="actor.micro_batch_tokens.*actor.remat.*mesh.learner"):
    trainer.run(c, str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.parametrize("override,says", [
    ("--config.model.source=Qwen2.5-1.5B-Instruct",
     "error: model.source: model source 'Qwen2.5-1.5B-Instruct': no such directory"),
    ("--config.mesh.learner_devices=9", "error: invalid config:"),
])
def test_launch_stops_a_bad_model_source_or_config_with_a_brief_message(tmp_path, override, says):
  """A model that is not there, or settings the devices cannot take: one message naming the key,
  no traceback, exit status 1, nothing trained (both fail before anything compiles)."""
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path}",
         override]
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  assert says in out.stderr
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.slow
def test_launch_stops_a_sampler_that_cannot_fit_with_a_brief_message(tmp_path):
  """The learner fits a small budget (at a smaller micro-batch) but not even a group's slots of
  the sampler do: launch.py prints the plan's message (no traceback) and exits 1, nothing
  trained."""
  cmd = [sys.executable, str(ROOT / "launch.py"), f"--config={TINY}", f"--workdir={tmp_path}",
         "--config.train.total_steps=1", "--config.mesh.device_memory_gib=0.15",
         # one halving, to one row of the longest sequence (each larger plan compiles ~10 s)
         "--config.actor.micro_batch_tokens=4096"]
  env = dict(os.environ)  # (conftest.py's XLA_FLAGS: 8 devices, the tests' compile flags)
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert "error: sampler memory plan: does not fit" in out.stderr
  assert "rollout.n_samples" in out.stderr
  assert "actor.micro_batch_tokens=4096 does not fit" in out.stdout  # the learner's plan lowered it
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


@pytest.mark.slow
def test_lora_run_publishes_and_checkpoints_adapters_then_exports(tmp_path):
  """actor.lora: the Orbax weight versions and the run checkpoint hold adapters only; resuming
  continues from them; the export writes a PEFT adapter dir (and merged weights) of the latest."""
  import jax
  import numpy as np
  from flax import nnx

  from areal_jax import export, models
  from areal_jax.evaluate import restore_adapters
  from areal_jax.models import lora
  from areal_jax.runtime import trainer

  c = tiny_config(**{"actor.lora.rank": 4, "actor.lora.alpha": 8.0, "actor.lora.dropout": 0.1,
                     "train.total_steps": 2, "train.checkpoint_every": 1,
                     "weights.transfer": "orbax", "weights.keep": 1, "rollout.max_new_tokens": 16})
  trainer.run(c, str(tmp_path))
  steps = lambda: [r["step"] for r in metrics_lib.read(str(tmp_path / "metrics.jsonl"))]
  assert steps() == [1, 2]
  published = [p for p in (tmp_path / "weights" / "2").rglob("*") if p.is_file()]
  base, _ = models.load("tiny")
  full_bytes = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(base, nnx.Param)))
  # float32 x 2 layers x rank 4 x (q, o: 64 + 64; k, v: 64 + 32; gate, up, down: 64 + 128)
  adapter_bytes = 4 * 2 * 4 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
  assert adapter_bytes < sum(p.stat().st_size for p in published) < full_bytes / 2

  config_lib.override(c, "train.total_steps", 3)  # resume from the adapters of version 2
  trainer.run(c, str(tmp_path))
  assert steps() == [1, 2, 3]
  lcfg = lora.LoraConfig.from_config(c.actor.lora)
  adapters = restore_adapters(str(tmp_path / "checkpoints" / "3"), base, lcfg)
  assert np.abs(np.asarray(adapters["layers"][0]["mlp"]["down"]["b"])).max() > 0
  paths = export.export(c, str(tmp_path), str(tmp_path / "peft"), str(tmp_path / "merged"))
  back, lcfg2 = lora.load_peft(paths["adapter"], nnx.to_pure_dict(nnx.state(base, nnx.Param)))
  assert lcfg2.rank == 4 and lcfg2.scale == 2.0
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(x, y)
  merged, _ = models.load(paths["merged"])
  expected = lora.merged_model(base, adapters, lcfg)
  np.testing.assert_array_equal(merged.layers[1].attn.q[...], expected.layers[1].attn.q[...])


def device_bytes() -> dict[int, int]:
  """Bytes of the distinct device buffers alive, per device id (an array viewing another's
  buffer, as a replica's view of a replicated shard, counted once)."""
  import jax
  seen, out = set(), {}
  for a in jax.live_arrays():
    for s in a.addressable_shards:
      key = (s.device.id, s.data.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
  return out


@pytest.mark.parametrize("data_parallel", ["replicas", "sharded"])
@pytest.mark.slow
def test_weight_versions_leave_one_copy_per_device(data_parallel):
  """Set up as a run does (learner on 2 devices, sampler on 2), then publish versions: each
  sampler device holds one version of the weights it decodes with (the memory plan's resident
  weights) and each learner device its own state, nothing else: not the float32 copy ``load``
  makes on the first device, not the transfer's copy in the learner's dtype, not the version the
  sampler was built with."""
  import gc

  import jax
  from areal_jax import sharding
  from areal_jax.runtime import engines, meshes, model_source, trainer

  c = tiny_config(**{"mesh.learner_devices": 2, "mesh.sampler_devices": 2,
                     "model.dtype": "bfloat16", "rollout.data_parallel": data_parallel})
  gc.collect()
  before = device_bytes()
  model, tokenizer = model_source.load(c)
  learner_mesh, sampler_mesh = meshes.build(c.mesh)
  learner, _ = trainer._build_learner(c, "/unused", model, learner_mesh)
  engine = engines.build_planned(c, model, tokenizer, sampler_mesh, learner)
  transfer = trainer._build_transfer(c, "/unused", learner, model, learner_mesh, sampler_mesh,
                                     False)
  held = [e.engine for e in getattr(engine, "replicas", [engine])]
  for version in range(3):  # (no rollout loop running: each version lands at once)
    engine.update_params(transfer.send(learner.params(), version), version)
  gc.collect()
  now = device_bytes()
  grown = {d: now.get(d, 0) - before.get(d, 0) for d in set(now) | set(before)}
  learner_ids = [d.id for d in learner_mesh.devices.flat]
  sampler_ids = [d.id for d in sampler_mesh.devices.flat]
  state = jax.tree.leaves(learner._state)
  for d in learner_ids:
    assert grown[d] == sum(s.data.nbytes for x in state for s in x.addressable_shards
                           if s.device.id == d), (d, grown)
  weights = sharding.device_bytes(held[0].params)  # (per device, bfloat16 matmul weights)
  assert all(grown[d] == weights for d in sampler_ids), (weights, grown)
  others = set(grown) - set(learner_ids) - set(sampler_ids)
  assert all(grown[d] == 0 for d in others), grown
