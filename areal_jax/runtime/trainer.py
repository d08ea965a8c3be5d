"""The training run, top to bottom: ``run(config, workdir)``.

Two device meshes work at the same time. The sampler mesh generates rollouts without pause (the
rollout controller keeps its slots full, within the staleness bound); the learner mesh trains on
batches of finished groups and publishes each new policy version to the sampler, which applies it
between two decode steps (partial rollouts). ``rollout.max_head_offpolicyness = 0`` makes the same
loop synchronous RL.

Follow one batch: controller admits a prompt group -> engine generates n samples -> reward pool
scores them -> staleness queue -> ``take_batch`` here -> ``learner.train_step`` -> publish.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import config as config_lib
from areal_jax import host_memory, tasks, workflows
from areal_jax import learner as learner_lib
from areal_jax.rollout_api import SamplingParams
from areal_jax.runtime import (checkpoint, engines, episode_stats, errors, learner_group, meshes,
                               model_source, plots, ray_cluster, ray_rollout, weight_transfer)
from areal_jax.runtime.checkpoint import Checkpointer
from areal_jax.runtime.controller import RolloutController
from areal_jax.runtime.metrics import MetricsWriter
from areal_jax.runtime.rewards import RewardPool
from areal_jax.runtime.staleness import StalenessController


WAIT_NOTE_S = 30.0  # a step waiting this long for its batch prints a line, then as often again


def run(config, workdir: str, wrap_engine=None) -> dict:
  """Trains until ``train.total_steps`` policy versions exist; resumes from ``workdir``.

  ``wrap_engine`` (optional) wraps the rollout engine, e.g. to shape a benchmark workload.
  With ``runtime.mode="ray"`` the rollout engines run in Ray actors (``ray_rollout``) on a cluster
  joined (or started) for the duration of the run. Returns the last step's metrics.
  """
  with ray_cluster.session(config.runtime):
    return _run(config, workdir, wrap_engine)


def _run(config, workdir: str, wrap_engine=None) -> dict:
  if config.runtime.mode == "ray":  # pin the learner before JAX starts its threads
    engine, transfer = ray_rollout.build(config, workdir)
  config_lib.validate(config, jax.device_count())
  errors.make_run_dir(workdir)
  _write_config(config, workdir)
  c_roll, c_act, c_train = config.rollout, config.actor, config.train
  learner_mesh, sampler_mesh = meshes.build(config.mesh, remote_sampler=config.runtime.mode == "ray")
  # On CPU the devices' buffers are malloc's: fewer heaps, and what a phase frees handed back
  # (host_memory.release) before the next one allocates
  host_cpu = all(d.platform == "cpu" for d in learner_mesh.devices.flat)
  if host_cpu:
    host_memory.limit_arenas()
    host_memory.map_large_buffers()
    host_memory.release_after_compiles()

  # The task's data first: a missing or malformed train (or eval) file is named before the model
  # loads and the memory plans compile
  task = tasks.get_task(config.task)
  task.examples("train")
  if c_train.eval_every:
    task.examples("test")
  model, tokenizer = model_source.load(config)
  learner, group = _build_learner(config, workdir, model, learner_mesh)
  if config.runtime.mode == "local":  # (in ray mode the workers hold the engines, built above)
    # memory plans (colocated: the sampler's slots first, the learner's micro-batch beside them)
    engine = engines.build_planned(config, model, tokenizer, sampler_mesh,
                                   None if group else learner)
    transfer = _build_transfer(config, workdir, learner, model, learner_mesh, sampler_mesh, group)
  elif group:  # the group's processes publish; the workers read its versions directly
    transfer = engine.announcer = learner.announcer()
  del model  # (its host copy of the weights: the learner and the sampler hold their own)
  if wrap_engine is not None:
    engine = wrap_engine(engine)
  if not c_train.resume:  # a fresh start keeps the previous run's records aside, never deletes them
    tag = f".old-{checkpoint.utc_tag()}"
    for name in ("metrics.jsonl", "trajectories"):
      checkpoint.move_aside(os.path.join(workdir, name), tag)
  ckpt = (learner.checkpointer() if group  # (closing it stops the group)
          else Checkpointer.of_run(workdir, config, resume=c_train.resume))

  # Resume from the newest usable checkpoint (damaged ones are moved aside): learner state, policy
  # version, data position and unfinished groups; the metrics rows and trajectory dumps written
  # after it belong to the abandoned timeline and are dropped.
  version, meta = 0, {}
  found = ckpt.restore_latest(learner.state)
  if found is not None:
    version, state, meta = found
    learner.load_state(state)
    print(f"resumed from {ckpt.directory} at version {version}", flush=True)
  data_iter = task.train_iterator(seed=config.seed, epochs=c_train.epochs)
  if meta.get("data_state") is not None:
    data_iter.set_state(meta["data_state"])
  staleness = StalenessController(c_act.batch_size, c_roll.max_head_offpolicyness,
                                  c_roll.max_concurrent_rollouts or c_act.batch_size)
  staleness.resume(version)  # accepted = version x B: the bound holds after a restart

  rewards = RewardPool(task.reward_fn, c_roll.reward_workers, c_roll.reward_timeout_s)
  params = SamplingParams(temperature=c_roll.temperature, top_p=c_roll.top_p, top_k=c_roll.top_k,
                          max_new_tokens=c_roll.max_new_tokens)
  controller = RolloutController(
      engine, task, tokenizer, staleness, data_iter, rewards, n_samples=c_roll.n_samples,
      params=params, max_prompt_len=c_roll.max_prompt_len,
      filter_uniform_groups=c_roll.filter_uniform_groups, seed=config.seed,
      next_group_id=meta.get("next_group_id", 0), pending=meta.get("pending"),
      workflow=workflows.get(c_roll.workflow, config),
      max_concurrent_episodes=c_roll.max_concurrent_episodes)
  engine.update_params(transfer.send(learner.params(), version), version)
  writer = MetricsWriter(workdir, c_train.total_steps, resume_step=version)
  totals = meta.get("totals", dict(groups_accepted=0, groups_rejected=0, wall_time_s=0.0))
  dump = _TrajectoryDump(workdir) if c_train.dump_trajectories else None
  _TrajectoryDump.drop_after(workdir, version)

  stop = _StopFlag()
  engine.start()
  controller.start()
  last_stats, last_t, t_start = dict(controller.stats), time.time(), time.time()
  result = {}
  try:
    for step in range(version, c_train.total_steps):
      # 1. Wait for B accepted groups, none older than the bound allows.
      t0 = time.time()
      batch, note_at = None, t0 + WAIT_NOTE_S
      while batch is None:
        batch = staleness.take_batch(step, timeout=0.5)
        controller.check()
        if stop.requested:
          raise KeyboardInterrupt
        if batch is None and controller.data_exhausted and staleness.idle():
          raise RuntimeError(f"the training data ran out at step {step}: raise train.epochs")
        if batch is None and time.time() >= note_at:  # a long wait shows its progress
          writer.waiting(step + 1, time.time() - t0, c_act.batch_size, staleness.queued,
                         staleness.running, controller.stats["gen_tokens"] - last_stats["gen_tokens"])
          note_at += WAIT_NOTE_S
      wait_s = time.time() - t0

      # 2. Train: recompute proximal logprobs, advantages, ppo_n_minibatches updates.
      if config.mesh.colocated:
        engine.pause()
      if host_cpu:  # what generating freed goes back before the step's temporaries are mapped
        host_memory.release()
      t1 = time.time()
      metrics = learner.train_step([g.samples for g in batch], [g.rewards for g in batch])
      train_s = time.time() - t1
      controller.mark_trained([g.group_id for g in batch])

      # 3. Publish version step + 1 to the sampler (in flight, or between sequences).
      t2 = time.time()
      if not c_roll.partial_rollouts:
        controller.pause_admission()
        controller.wait_idle()
      engine.update_params(transfer.send(learner.params(), step + 1), step + 1)
      staleness.publish(step + 1)
      controller.resume_admission()
      if config.mesh.colocated:
        engine.resume()
      if host_cpu:  # the step's freed buffers and the previous version, back to the system
        host_memory.release()
      publish_s = time.time() - t2

      # 4. Report.
      now = time.time()
      stats = dict(controller.stats)
      sampler_compiles = engine.compile_stats()  # cumulative: programs and seconds
      delta = {k: stats[k] - last_stats[k] for k in stats}
      period = now - last_t
      last_stats, last_t = stats, now
      totals["groups_accepted"] += delta["groups_accepted"]
      totals["groups_rejected"] += delta["groups_rejected"]
      samples = [s for g in batch for s in g.samples]
      staleness_s = [step - min(s.versions) for s in samples if s.versions]
      row = dict(
          step=step + 1, version=step + 1,
          reward_mean=float(np.mean([r for g in batch for r in g.rewards])),
          groups_accepted=totals["groups_accepted"], groups_rejected=totals["groups_rejected"],
          staleness_mean=float(np.mean(staleness_s)) if staleness_s else 0.0,
          staleness_max=int(max(staleness_s, default=0)),
          turns_mean=float(np.mean([s.metadata.get("turns", 1) for s in samples])),
          tool_call_frac=episode_stats.tool_call_frac(samples),
          behav_weight_max=metrics.get("behav_weight_max"), clip_frac=metrics.get("clip_frac"),
          loss=metrics.get("loss"), grad_norm=metrics.get("grad_norm"),
          gen_tokens_per_s=delta["gen_tokens"] / max(period, 1e-9),
          train_tokens_per_s=metrics.get("tokens", 0) / max(train_s, 1e-9),
          learner_wait_s=wait_s, sampler_idle_frac=min(1.0, delta["idle_s"] / max(period, 1e-9)),
          weight_publish_s=publish_s, step_time_s=period,
          wall_time_s=totals["wall_time_s"] + now - t_start,
          compiles=metrics.get("compiles"), reward_failures=stats["reward_failures"],
          sampler_compiles=sampler_compiles.get("compiles"),
          sampler_compile_s=sampler_compiles.get("compile_s"),
          prompts_too_long=stats["prompts_too_long"],
          **controller.step_metrics(),
          **{f"learner/{k}": v for k, v in metrics.items()})
      if c_train.eval_every and (step + 1) % c_train.eval_every == 0:
        row.update(evaluate(controller, task, c_train))
      writer.write(row)
      if dump is not None:
        dump.write(step, batch)
      result = row

      # 5. Checkpoint (atomic; a crash before this point redoes the step after resume).
      if (step + 1) % c_train.checkpoint_every == 0 or step + 1 == c_train.total_steps:
        _save(ckpt, learner, controller, staleness, step + 1, totals, t_start)
  except KeyboardInterrupt:
    print("interrupted: saving a checkpoint before exiting", flush=True)
    if learner.version > (ckpt.latest_step() or 0):
      _save(ckpt, learner, controller, staleness, learner.version, totals, t_start)
  finally:
    stop.restore()
    controller.stop()
    engine.stop()
    rewards.close()
    writer.close()
    ckpt.close()
  try:  # the run's results are saved; a plotting problem must not turn it into a failure
    print(f"curves: {plots.plot_run(workdir)}", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"could not plot {workdir}/metrics.jsonl: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
  return result


def evaluate(controller: RolloutController, task, c_train) -> dict:
  """Greedy pass@1 (and sampled mean@k) on the held-out split, outside the staleness bound."""
  return evaluate_groups(controller, task, c_train)[0]


def evaluate_groups(controller: RolloutController, task, c_train, progress=None):
  """:func:`evaluate`, also returning the scored groups: ``(metrics, greedy, sampled)``.

  ``greedy`` holds one single-sample group per test example, ``sampled`` one group of
  ``train.eval_samples`` completions per example (empty when that is 1). ``progress(phase, done,
  total)``, if given, is called as examples finish (phase "greedy" or "sampled").
  """
  examples = task.test_examples(c_train.eval_size)
  max_new = controller.params.max_new_tokens
  greedy = controller.evaluate(examples, 1, SamplingParams(greedy=True, max_new_tokens=max_new),
                               progress=_phase(progress, "greedy"))
  out = {"eval_accuracy": float(np.mean([g.rewards[0] > 0.5 for g in greedy]))}
  sampled = []
  if c_train.eval_samples > 1:
    sampled = controller.evaluate(examples, c_train.eval_samples, SamplingParams(
        temperature=c_train.eval_temperature, max_new_tokens=max_new), progress=_phase(progress, "sampled"))
    out[f"eval_mean@{c_train.eval_samples}"] = float(np.mean([r > 0.5 for g in sampled for r in g.rewards]))
  return out, greedy, sampled


def _phase(progress, phase: str):
  """``progress(done, total)`` for one evaluation phase of ``progress(phase, done, total)``."""
  return None if progress is None else functools.partial(progress, phase)


def _build_learner(config, workdir: str, model, learner_mesh):
  """``(learner, is_group)``: the learner in this process (its memory plan comes with the
  sampler's: ``engines.build_planned``; in ray mode here), or a group of
  ``runtime.learner_processes`` processes (``learner_group.py``; the driver's learner mesh
  unused)."""
  if learner_group.check_config(config) > 1:
    return learner_group.LearnerGroup(config, workdir), True
  c_roll = config.rollout
  learner = learner_lib.Learner(model, config.actor, learner_mesh, temperature=c_roll.temperature,
                                total_steps=config.train.total_steps,
                                max_seq_len=c_roll.max_prompt_len + c_roll.max_new_tokens)
  if config.runtime.mode != "local":  # (the rollout workers plan their own devices)
    engines.plan_learner(config, learner)
  return learner, False


def _build_transfer(config, workdir: str, learner, model, learner_mesh, sampler_mesh, group: bool):
  """The weight transfer from the learner to this process's sampler mesh."""
  if group:  # the group's processes publish Orbax versions; the driver restores them
    return learner.transfer(config.weights, model, sampler_mesh,
                            weight_transfer.version_dtype(config))
  if learner.lora is not None:  # only the adapters are published (replicated on the sampler)
    shardings = jax.tree.map(lambda _: NamedSharding(sampler_mesh, P()), learner.params())
  else:
    shardings = weight_transfer.target_shardings(model, sampler_mesh)
  return weight_transfer.build(config.weights, workdir, learner_mesh, sampler_mesh,
                               learner.params(), shardings=shardings,
                               dtype=weight_transfer.version_dtype(config))


def _save(ckpt, learner, controller, staleness, version, totals, t_start) -> None:
  snap = controller.snapshot()
  totals = dict(totals, wall_time_s=totals["wall_time_s"] + time.time() - t_start)
  meta = dict(version=version, totals=totals, staleness=staleness.state_dict(), **snap)
  ckpt.save(version, learner.state, meta)


def _write_config(config, workdir: str) -> None:
  with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
    f.write(config.to_json_best_effort(indent=2))


class _TrajectoryDump:
  """``<workdir>/trajectories/step_<n>.jsonl``: every trained sample, for audits."""

  def __init__(self, workdir: str):
    self.dir = os.path.join(workdir, "trajectories")
    os.makedirs(self.dir, exist_ok=True)

  @staticmethod
  def drop_after(workdir: str, version: int) -> None:
    """Deletes the dumps of steps a resume from ``version`` redoes (``step_<n>`` trains version n+1)."""
    directory = os.path.join(workdir, "trajectories")
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
      m = re.fullmatch(r"step_(\d+)\.jsonl(\.tmp)?", name)
      if m and int(m.group(1)) >= version:
        os.remove(os.path.join(directory, name))

  def write(self, step: int, batch) -> None:
    path = os.path.join(self.dir, f"step_{step:06d}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      for g in batch:
        for s, r in zip(g.samples, g.rewards):
          f.write(json.dumps(dict(
              trained_at_version=step, group_id=g.group_id, example_id=g.example.get("id"), index=s.index,
              admit_version=g.admit_version, reward=r, prompt_tokens=s.prompt_tokens,
              tokens=s.tokens, versions=s.versions, logprobs=s.logprobs, loss_mask=s.loss_mask,
              finish_reason=s.finish_reason, staleness=step - min(s.versions, default=step))) + "\n")
    os.replace(path + ".tmp", path)


class _StopFlag:
  """Turns SIGINT/SIGTERM into a clean stop at the next step boundary (with a checkpoint)."""

  def __init__(self):
    self.requested = False
    self._old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. a notebook worker): keep default handling
        pass

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def restore(self) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
