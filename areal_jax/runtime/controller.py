"""The rollout controller: from prompts to accepted, scored groups.

One background thread drives a ``RolloutEngine`` (the JAX sampler, vLLM, or a remote engine):
  1. admits new groups while the staleness controller has capacity (docs/concepts/staleness.md),
     taking prompts first from the ``pending`` list (groups a resumed run must redo) and then the
     data iterator;
  2. gathers the engine's finished samples per group;
  3. scores a complete group in the reward pool (time-limited, failures score 0 and are counted);
  4. accepts the group into the training queue, or rejects it (all rewards equal when filtering is
     on, a reward failure, an engine error), which frees staleness budget.
Evaluation groups go through the same engine but not through the staleness bound.

Workflows (``rollout.workflow``, ``areal_jax.workflows``): "single_turn" keeps the grouped path
above (one request of ``n`` samples per prompt). Any other workflow runs, per admitted group,
``n`` episodes: a blocking workflow's on worker threads (``episodes.EpisodeRunner``), an async
one's on one event loop (``async_episodes.AsyncEpisodeRunner``), at most
``max_concurrent_episodes`` at once either way (the others of the admitted groups wait for a place).
Each turn of an episode is a one-sample engine request (``episodes.TurnClient``), the episode scores
itself (through the reward pool) and the group is accepted or rejected when all ``n`` episodes
have ended: one trajectory and one reward per episode, so GRPO advantages compare whole episodes.
``step_metrics()`` gives the episodes' and the sampler's figures for each step's metrics row.
All state that a checkpoint needs (pending examples, the data iterator, the next group id) is plain
data: ``snapshot()``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from areal_jax import workflows as workflows_lib
from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, SamplingParams
from areal_jax.runtime import async_episodes, episodes
from areal_jax.runtime.episode_stats import EpisodeStats
from areal_jax.runtime.rewards import RewardPool


@dataclasses.dataclass
class Group:
  """A finished, scored prompt group: what the learner trains on."""

  group_id: int
  example: dict
  samples: list[Sample]
  rewards: list[float]
  admit_version: int
  reward_failures: int = 0


@dataclasses.dataclass
class _Running:
  example: dict
  admit_version: int
  samples: list[Sample] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)  # episodes: scored as they end


class RolloutController:

  def __init__(self, engine: RolloutEngine, task, tokenizer, staleness, data_iter, rewards: RewardPool,
               *, n_samples: int, params: SamplingParams, max_prompt_len: int,
               filter_uniform_groups: bool, seed: int, next_group_id: int = 0,
               pending: list[dict] | None = None,
               workflow: workflows_lib.Workflow | None = None, max_concurrent_episodes: int = 0):
    self.engine, self.task, self.tokenizer, self.staleness = engine, task, tokenizer, staleness
    self.data_iter, self.rewards = data_iter, rewards
    self.n, self.params, self.max_prompt_len = n_samples, params, max_prompt_len
    self.filter_uniform, self.seed = filter_uniform_groups, seed
    self._next_id = next_group_id
    self._pending = list(pending or [])
    self._running: dict[int, _Running] = {}
    self._next_eval_id = 0
    self._untrained: dict[int, dict] = {}  # admitted, not yet trained (running, scoring or queued)
    self._scoring: dict[int, Future] = {}
    self._evals: dict[int, _Running] = {}  # evaluation groups (admit_version = -1)
    self._lock = threading.RLock()
    self._stop = threading.Event()
    self._admit_open = threading.Event()
    self._admit_open.set()
    self._error: BaseException | None = None
    self._scorer = ThreadPoolExecutor(rewards.workers, thread_name_prefix="reward")
    self._thread = threading.Thread(target=self._loop, name="rollout-controller", daemon=True)
    # Episodic workflows (None: the grouped single-turn path).
    self.workflow = None if isinstance(workflow, (workflows_lib.SingleTurn, type(None))) else workflow
    self.episode_stats = EpisodeStats()
    if self.workflow is not None:  # every episode of every group that may run at once, or the cap
      ctx = workflows_lib.Context(task, tokenizer, self._episode_reward, max_prompt_len,
                                  self.episode_stats.env_call)
      places = (int(max_concurrent_episodes) or
                n_samples * max(1, getattr(staleness, "max_concurrent", 1)))
      if workflows_lib.is_async(self.workflow):
        self._episodes = async_episodes.AsyncEpisodeRunner(
            self.workflow, ctx, engine, self._stop, places, on_error=self._fail,
            stats=self.episode_stats)
      else:
        self._episodes = episodes.EpisodeRunner(self.workflow, ctx, engine, self._stop, places,
                                                on_error=self._fail, stats=self.episode_stats)
    # idle_s / busy_s: time without / with a request at the engine
    self.stats = dict(gen_tokens=0, groups_accepted=0, groups_rejected=0, reward_failures=0,
                      prompts_too_long=0, engine_errors=0, idle_s=0.0, busy_s=0.0)
    self._reported = dict(idle_s=0.0, busy_s=0.0)
    self._data_exhausted = False

  # ---- lifecycle -------------------------------------------------------------------------------
  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)
    self._scorer.shutdown(wait=False, cancel_futures=True)
    if self.workflow is not None:
      self._episodes.shutdown()
      close = getattr(self.workflow, "close", None)
      if close is not None:  # what the workflow holds for its episodes (an environment pool)
        close()

  def check(self) -> None:
    """Re-raises an error of the controller thread in the caller's thread."""
    if self._error is not None:
      raise RuntimeError("rollout controller failed") from self._error

  @property
  def data_exhausted(self) -> bool:
    return self._data_exhausted and not self._pending

  def pause_admission(self) -> None:
    self._admit_open.clear()

  def resume_admission(self) -> None:
    self._admit_open.set()

  def wait_idle(self, timeout: float | None = None) -> bool:
    """Waits until no training group is being generated (used when partial rollouts are off)."""
    deadline = None if timeout is None else time.time() + timeout
    while True:
      with self._lock:
        if not self._running:
          return True
      self.check()
      if deadline is not None and time.time() > deadline:
        return False
      time.sleep(0.005)

  def snapshot(self) -> dict[str, Any]:
    """What a checkpoint needs to redo unfinished work in the same data order: the examples of
    every admitted group not yet trained (in admission order), then the untouched pending ones."""
    with self._lock:
      redo = [ex for _, ex in sorted(self._untrained.items())] + list(self._pending)
      return dict(pending=redo, next_group_id=self._next_id, data_state=self.data_iter.get_state())

  def mark_trained(self, group_ids) -> None:
    with self._lock:
      for gid in group_ids:
        self._untrained.pop(gid, None)

  # ---- the loop --------------------------------------------------------------------------------
  def _loop(self) -> None:
    try:
      last, last_busy = time.time(), 0.0
      while not self._stop.is_set():
        if self._admit_open.is_set():
          self._admit()
        for sample in self.engine.poll(timeout=0.01):
          self._on_sample(sample)
        self._collect_scores()
        now = time.time()
        if self.workflow is None:  # a group holds the engine from admission to its last sample
          with self._lock:
            busy = (now - last) if (self._running or self._evals) else 0.0
        else:  # turns come and go within one loop turn: the client times them
          busy_total = self._episodes.turns.busy_s()
          busy, last_busy = min(busy_total - last_busy, now - last), busy_total
        with self._lock:
          self.stats["busy_s"] += busy
          self.stats["idle_s"] += now - last - busy
        last = now
    except BaseException as e:  # surfaced to the trainer by check()
      self._error = e

  def step_metrics(self) -> dict[str, Any]:
    """The figures of a step's metrics row over the time since the previous call:
    ``sampler_busy_frac`` (the share of it with a request at the engine; None before any loop
    turn) and the episodes' (``EpisodeStats.report``: in flight, environment calls, failures)."""
    with self._lock:
      now = {k: self.stats[k] for k in ("idle_s", "busy_s")}
    delta = {k: now[k] - self._reported[k] for k in now}
    self._reported = now
    total = delta["idle_s"] + delta["busy_s"]
    busy = delta["busy_s"] / total if total > 0 else None
    return dict(sampler_busy_frac=busy, **self.episode_stats.report())

  def _next_example(self) -> dict | None:
    if self._pending:
      return self._pending.pop(0)
    try:
      return next(self.data_iter)
    except StopIteration:
      self._data_exhausted = True
      return None

  def _admit(self) -> None:
    while self.staleness.capacity() > 0 and not self._data_exhausted_now():
      with self._lock:
        example = self._next_example()
        if example is None:
          return
        tokens = self.task.prompt_ids(example, self.tokenizer)
        if len(tokens) > self.max_prompt_len:
          self.stats["prompts_too_long"] += 1
          continue
        gid = self._next_id
        self._next_id += 1
        version = self.staleness.admit(gid)
        self._running[gid] = _Running(example, version)
        self._untrained[gid] = example
      if self.workflow is not None:
        for i in range(self.n):
          params = dataclasses.replace(self.params, seed=episodes.episode_seed(self.seed, gid, i))
          self._episodes.launch(gid, i, example, params, "train").add_done_callback(
              functools.partial(self._episode_done, gid))
        continue
      params = dataclasses.replace(self.params, seed=self.seed * 1_000_003 + gid)
      self.engine.submit(GroupRequest(gid, tokens, self.n, params, {"kind": "train"}))

  def _data_exhausted_now(self) -> bool:
    return self._data_exhausted and not self._pending

  def _on_sample(self, sample: Sample) -> None:
    with self._lock:
      self.stats["gen_tokens"] += len(sample.tokens)
      if sample.metadata.get("kind") == "turn":
        self._episodes.turns.deliver(sample)
        return
      if sample.metadata.get("kind") == "eval":
        self._evals[sample.group_id].samples.append(sample)
        return
      run = self._running.get(sample.group_id)
      if run is None:
        return
      run.samples.append(sample)
      if len(run.samples) < self.n:
        return
      del self._running[sample.group_id]
    run.samples.sort(key=lambda s: s.index)
    self._scoring[sample.group_id] = self._scorer.submit(self._score, sample.group_id, run)

  def _score(self, gid: int, run: _Running) -> Group:
    texts = [self.tokenizer.decode(s.tokens) for s in run.samples]
    rewards, failed = self.rewards.score(texts, run.example)
    return Group(gid, run.example, run.samples, rewards, run.admit_version, failed)

  def _collect_scores(self) -> None:
    with self._lock:  # episode threads add finished groups
      done = [g for g, f in self._scoring.items() if f.done()]
    for gid in done:
      with self._lock:
        group = self._scoring.pop(gid).result()
        self.stats["reward_failures"] += group.reward_failures
        errors = [s for s in group.samples if s.finish_reason == "error"]
        self.stats["engine_errors"] += bool(errors)
        uniform = len(set(group.rewards)) == 1
        accept = not errors and not (self.filter_uniform and uniform)
        self.stats["groups_accepted" if accept else "groups_rejected"] += 1
        if not accept:
          self._untrained.pop(gid, None)
      self.staleness.finish(gid, accept, group if accept else None)

  # ---- episodes (workflows other than single_turn) ---------------------------------------------
  def _episode_reward(self, text: str, example: dict) -> float:
    """The task's reward of one text in the time-limited reward pool (failures score 0)."""
    rewards, failed = self.rewards.score([text], example)
    if failed:
      with self._lock:
        self.stats["reward_failures"] += failed
    return rewards[0]

  def _fail(self, error: BaseException) -> None:
    self._error = self._error or error

  def _episode_done(self, gid: int, future: Future) -> None:
    """A training episode ended (on its thread or the event loop): its group takes it."""
    ep = None if future.cancelled() else future.result()
    if ep is None:  # stopped, or failed (the run stops)
      return
    with self._lock:
      run = self._running.get(gid)
      if run is None:
        return
      run.samples.append(ep.sample)
      run.rewards.append(ep.reward)
      if len(run.samples) < self.n:
        return
      del self._running[gid]
      order = sorted(range(self.n), key=lambda i: run.samples[i].index)
      group = Group(gid, run.example, [run.samples[i] for i in order],
                    [run.rewards[i] for i in order], run.admit_version)
      done: Future = Future()
      done.set_result(group)
      self._scoring[gid] = done

  def _evaluate_episodes(self, examples, k, params, progress) -> list[Group]:
    """:meth:`evaluate` with the workflow: an episode scores 1 if its final answer is right
    (within ``max_turns``, no per-turn discount), else 0."""
    jobs = []
    for example in examples:
      with self._lock:
        self._next_eval_id -= 1
        jobs.append((self._next_eval_id, example))
    played = self._episodes.evaluate(jobs, k, params, self.seed, self.check, progress)
    return [Group(gid, example, [ep.sample for ep in eps], [float(ep.correct) for ep in eps], -1)
            for (gid, example), eps in zip(jobs, played)]

  # ---- evaluation ------------------------------------------------------------------------------
  def evaluate(self, examples: list[dict], k: int, params: SamplingParams,
               progress=None) -> list[Group]:
    """Generates ``k`` samples per example outside the staleness bound and scores them.

    ``progress(done, total)``, if given, is called whenever more examples have all ``k`` samples.
    With an episodic workflow each sample is an episode (see ``_evaluate_episodes``).
    """
    if self.workflow is not None:
      return self._evaluate_episodes(examples, k, params, progress)
    gids = []
    for example in examples:
      with self._lock:
        self._next_eval_id -= 1  # negative ids never collide with training groups
        gid = self._next_eval_id
        self._evals[gid] = _Running(example, -1)
      tokens = self.task.prompt_ids(example, self.tokenizer)
      self.engine.submit(GroupRequest(gid, tokens, k, params, {"kind": "eval"}))
      gids.append(gid)
    reported = 0
    while True:
      with self._lock:
        done = sum(len(self._evals[g].samples) == k for g in gids)
        if done == len(gids):
          runs = [self._evals.pop(g) for g in gids]
          break
      if progress is not None and done > reported:
        reported = done
        progress(done, len(gids))
      self.check()
      time.sleep(0.01)
    if progress is not None:
      progress(len(gids), len(gids))
    for run in runs:
      run.samples.sort(key=lambda s: s.index)
    return list(self._scorer.map(lambda a: self._score(*a), zip(gids, runs)))
