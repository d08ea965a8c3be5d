"""The trainer loop: judged turns in, new policy versions out to the serving engine.

Each step takes the oldest ``actor.batch_size`` judged, untrained turns from the store. With
``serve.teacher_at = "trainer"`` the turns the judge left hinted (waiting for the OPD teacher) take
their place in that order too, and the teacher (``serve/teacher.py``, on the learner's devices)
scores the hinted turns of the batch just before its step: every forward it runs is trained, and a
turn with a hint (in the demo, a wrong answer) trains when its turn comes, not when the teacher
has time. The batch's rules:
  * only main turns (never side turns, never a last turn: the judge leaves those unjudgeable), and
    at most ``serve.max_key_share`` of the batch from any one API key (at least one turn), so that
    one user cannot steer the policy alone; a key's turns over its share wait for later batches;
  * a turn whose oldest token is more than ``serve.max_staleness`` versions behind is marked
    ``stale`` (counted, never trained); so is one sampled at another temperature than the learner's
    (``rollout.temperature``: its behaviour logprobs follow another distribution) or greedily. A
    hinted turn marked so is judged without the teacher's forward; with the teacher in the judge,
    the oldest hinted turns (which that teacher, scoring only what trains next, leaves) are looked
    at too;
  * advantages: candidates of one request judged together (the server sampled ``n > 1``) use their
    mean score as the baseline (GRPO-style, ``score - mean``); a single candidate (users send each
    prompt once) uses a running baseline, the exponential moving average of past scores
    (``serve.baseline_decay``). With ``serve.judge = "votes"`` the score (+1 / -1, the judges'
    majority) is the advantage itself: no baseline, no group normalisation (the running baseline
    is still tracked, as a metric); with ``serve.advantage = "signed"`` a rule or model judge's
    score s in [0, 1] is turned into one, ``2 * s - 1`` (a wrong answer -1 however rare right
    ones are). A turn cut off at its token limit has ``serve.cut_off_penalty`` subtracted from its
    advantage (the baseline follows the scores alone). Each turn goes to ``Learner.train_step`` as
    a group of one with its advantage as the reward (``actor.adv_norm = "none"``): the decoupled
    PPO loss is unchanged;
  * the signal (``serve.signal``): "binary" trains ``signal_w_rl * advantage``; "opd" trains the
    turns the teacher scored under a hint, with the per-token advantage
    ``signal_w_opd * (teacher - student)`` that the learner computes after its own forward
    (``learner.distill``; with ``serve.teacher_topk`` the reverse KL to the teacher's top k);
    "combined" trains both on every judged turn (a turn without a verdict: only the teacher's
    term; without a hint: only the score's);
  * the rows are marked ``trained`` with the new version, the version is published to the engine
    (applied between decode steps) and, every ``train.checkpoint_every`` steps, checkpointed
    (learner state + the baseline; the store position is the version itself).
Restart: the newest checkpoint V is restored and the marks of steps after V are rolled back
(``TurnStore.rollback_after``), so the lost steps are redone on the same turns and nothing is
trained twice. Killing the loop mid-step never touches serving.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time

import numpy as np

from areal_jax.rollout_api import Sample
from areal_jax.serve import teacher as teacher_lib
from areal_jax.serve.store import TurnStore, skip_reason

log = logging.getLogger(__name__)
METRICS_FILE = "serve_metrics.jsonl"


def advantages(rows: list[dict], baseline: float | None, decay: float) -> tuple[list[float], float]:
  """Per-row advantages (see the module docstring) and the updated running baseline."""
  scores = [float(r["score"]) for r in rows]
  if baseline is None:
    baseline = float(np.mean(scores))
  by_request: dict[str, list[int]] = {}
  for i, r in enumerate(rows):
    by_request.setdefault(r["request_id"], []).append(i)
  adv = [0.0] * len(rows)
  for members in by_request.values():
    if len(members) > 1:
      mean = float(np.mean([scores[i] for i in members]))
      for i in members:
        adv[i] = scores[i] - mean
    else:
      adv[members[0]] = scores[members[0]] - baseline
  for s in scores:  # the running baseline follows the scores in arrival order
    baseline = decay * baseline + (1.0 - decay) * s
  return adv, baseline


class TrainerLoop:
  """Owns the learner's train steps, in a thread (``start``/``stop``) or the caller's (``run``);
  ``restore`` resumes, stopping checkpoints."""

  def __init__(self, config, workdir: str, store: TurnStore, learner, transfer, engine, ckpt,
               teacher=None):
    """``teacher``: the OPD teacher this loop runs before each step (``serve.teacher_at =
    "trainer"``: it scores the turns the judge left hinted), or None."""
    self.config, self.workdir, self.store = config, workdir, store
    self.learner, self.transfer, self.engine, self.ckpt = learner, transfer, engine, ckpt
    if config.actor.adv_norm != "none":
      raise ValueError(f"serving trains with actor.adv_norm='none' (the trainer loop computes the "
                       f"advantages), got {config.actor.adv_norm!r}")
    self.batch_size = config.actor.batch_size
    share = config.serve.max_key_share
    if not 0.0 < share <= 1.0:
      raise ValueError(f"serve.max_key_share must lie in (0, 1], got {share!r}")
    # the most turns one key id may have in a batch (turns recorded without keys are not capped)
    self.per_key = max(1, int(share * self.batch_size + 1e-9))
    # a score as its advantage, without a baseline (module docstring): the votes judge's +1 / -1
    # as it stands; with serve.advantage "signed", a score in [0, 1] as 2 * s - 1; else None
    self.as_advantage = (float if config.serve.judge == "votes" else
                         (lambda s: 2.0 * s - 1.0) if config.serve.advantage == "signed" else None)
    self.baseline: float | None = None
    self.signal = config.serve.signal
    self.stats = dict(trained=0, stale=0, off_policy_temperature=0, steps=0)
    if self.signal != "binary":
      self.stats["taught"] = 0  # turns trained with the teacher's term
    self.teaching = None if teacher is None or self.signal == "binary" else \
        teacher_lib.TeacherStage(teacher, self.signal, self.stats)
    self.error: str | None = None
    self._stop = threading.Event()
    self._killed = False
    self._thread: threading.Thread | None = None
    self._t0 = time.time()
    self.on_step = None  # called after each train step (the trainer process writes its status)

  def request_stop(self) -> None:
    """Asks ``run`` to return after the current step (it then checkpoints); safe from a signal."""
    self._stop.set()

  @property
  def version(self) -> int:
    return self.learner.version

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def restore(self) -> int:
    """Loads the newest checkpoint (if any), rolls the store back to it; returns the version."""
    version, meta = 0, {}
    found = self.ckpt.restore_latest(self.learner.state)
    if found is not None:
      version, state, meta = found
      self.learner.load_state(state)
    self.baseline = meta.get("totals", {}).get("baseline")
    for k in self.stats:
      self.stats[k] = meta.get("totals", {}).get(k, 0)
    undone = self.store.rollback_after(version)
    if found is not None or undone:
      log.info("trainer resumed at version %d (%d turns to retrain)", version, undone)
    self._truncate_metrics(version)
    return version

  def publish(self) -> None:
    """Hands the learner's version to the engine (same process) or only writes it (``engine`` None:
    the server runs in another process and loads published versions itself)."""
    v = self.learner.version
    if self.engine is None:
      self.transfer.publish(self.learner.params(), v)
    else:
      self.engine.update_params(self.transfer.send(self.learner.params(), v), v)

  def start(self) -> None:
    self._stop.clear()
    self._killed = False
    self._thread = threading.Thread(target=self._run, name="serve-trainer", daemon=True)
    self._thread.start()

  def stop(self, checkpoint: bool = True) -> None:
    """Stops after the current step; ``checkpoint=False`` is a kill (no final checkpoint)."""
    self._killed = not checkpoint
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _run(self) -> None:
    self.run()

  def run(self) -> None:
    """The loop in the calling thread until ``stop``/``request_stop``; ``on_step`` after each step."""
    try:
      while not self._stop.is_set():
        if not self.step():
          self._stop.wait(0.2)
        elif self.on_step is not None:
          self.on_step()
      if not self._killed and self.learner.version > (self.ckpt.latest_step() or 0):
        self.save()
    except Exception as e:  # pylint: disable=broad-except  (the loop dies; serving does not)
      log.exception("trainer loop failed")
      self.error = f"{type(e).__name__}: {e}"
    finally:
      self.store.close()

  def step(self) -> bool:
    """One train step if a batch of judged turns is ready; False when there is none yet."""
    version = self.learner.version
    failed = False  # the teacher is asked at most once a step
    down: set[int] = set()  # hinted turns left waiting for the next step's teacher
    while True:
      rows, skip = self._pick(version, exclude=down)
      for reason, skipped in skip.items():
        # a hinted turn nobody will train: judged without the teacher's forward
        teacher_lib.release(self.store, self.signal,
                            [r for r in skipped if r["judge_status"] == "hinted"])
        self.store.mark([r["id"] for r in skipped], "stale", version + 1)
        self.stats["stale" if reason == "stale" else "off_policy_temperature"] += len(skipped)
      if len(rows) < self.batch_size or self._stop.is_set():
        return False
      waiting = [r for r in rows if r["judge_status"] == "hinted"]
      if not waiting:
        break
      # The teacher scores this batch's hinted turns, then the batch is read again: a turn the
      # teacher could not score may have left it (opd: no signal) and the next one takes its place.
      if not failed and self.teaching.teacher.current:
        # serve.teacher_weights = "current": the policy as it stands teaches, with the hint
        self.teaching.teacher.follow(self.learner.merged_params())
      if failed or not self.teaching.score(self.store, waiting):
        # The teacher failed: a turn that can train on its score alone (combined) does so; the
        # others stay hinted for the next step's teacher.
        failed = True
        alone = [r for r in waiting if self.teaching.trains_without(r)]
        teacher_lib.release(self.store, self.signal, alone)
        down |= {r["id"] for r in waiting} - {r["id"] for r in alone}
    t0 = time.time()
    rewards, baseline = self._rewards(rows)
    samples = [[Sample(r["id"], 0, r["prompt_tokens"], r["completion_tokens"], r["logprobs"],
                       r["versions"], r["finish_reason"])] for r in rows]
    if self.signal == "binary":
      metrics = self.learner.train_step(samples, rewards)
    else:
      teachers = [[self._teacher(r)] for r in rows]
      metrics = self.learner.train_step(samples, rewards, teachers=teachers)
      self.stats["taught"] += sum(t[0] is not None for t in teachers)
    new = version + 1
    self.store.mark([r["id"] for r in rows], "trained", new)
    self.baseline = baseline
    self.stats["trained"] += len(rows)
    self.stats["steps"] += 1
    train_s = time.time() - t0
    t1 = time.time()
    self.publish()
    publish_s = time.time() - t1
    if new % self.config.train.checkpoint_every == 0:
      self.save()
    lag = [version - min(r["versions"]) for r in rows]
    scores = [r["score"] for r in rows if r["score"] is not None]
    self._write_metrics(dict(
        version=new, time_s=time.time(),
        score_mean=float(np.mean(scores)) if scores else None,
        baseline=baseline, staleness_mean=float(np.mean(lag)), staleness_max=int(max(lag)),
        train_s=train_s, publish_s=publish_s, loss=metrics.get("loss"),
        clip_frac=metrics.get("clip_frac"), behav_weight_max=metrics.get("behav_weight_max"),
        **self.stats))
    return True

  def _pick(self, version: int, exclude=frozenset()) -> tuple[list[dict], dict[str, list[dict]]]:
    """The oldest judged (or, with the teacher here, hinted) untrained turns for a batch (at most
    ``serve.max_key_share`` of it from one key; none of the ids in ``exclude``) and, by reason,
    those that may never be trained at ``version``."""
    rows, skip, per_key = [], {}, collections.Counter()
    capped = self.per_key < self.batch_size
    for row in self.store.trainable(4 * self.batch_size + 64 + len(exclude),
                                    4 * self.per_key + 16 if capped else None,
                                    hinted=self.teaching is not None):
      if row["id"] in exclude:
        continue
      reason = self._skip_reason(row, version)
      if reason:
        skip.setdefault(reason, []).append(row)
      elif len(rows) < self.batch_size and (row["key_id"] is None
                                            or per_key[row["key_id"]] < self.per_key):
        rows.append(row)
        per_key[row["key_id"]] += 1
    if self.teaching is None and self.signal != "binary":
      # The judge's teacher (serve.teacher_at = "judge") scores only the hinted turns this loop
      # takes next: the oldest, which it leaves once too old, are looked at here, so that those
      # nobody will train leave the hinted state and are counted.
      for row in self.store.hinted(self.batch_size + 64, oldest=True):
        reason = self._skip_reason(row, version)
        if reason:
          skip.setdefault(reason, []).append(row)
    return rows, skip

  def _rewards(self, rows: list[dict]) -> tuple[list[list[float]], float | None]:
    """Each row's scalar reward (``signal_w_rl`` times its advantage; 0 with ``signal = "opd"``
    and for a row without a score) and the updated running baseline."""
    scored = [r for r in rows if r["score"] is not None]
    if not scored:
      return [[0.0] for _ in rows], self.baseline
    adv, baseline = advantages(scored, self.baseline, self.config.serve.baseline_decay)
    if self.as_advantage is not None:
      adv = [self.as_advantage(float(r["score"])) for r in scored]
    w = 0.0 if self.signal == "opd" else self.config.serve.signal_w_rl
    penalty = self.config.serve.cut_off_penalty  # (after the baseline, which follows scores only)
    by_id = {r["id"]: w * (a - penalty * (r["finish_reason"] == "length"))
             for r, a in zip(scored, adv)}
    return [[by_id.get(r["id"], 0.0)] for r in rows], baseline

  def _teacher(self, row: dict):
    """The row's ``TokenTeacher`` (``signal_w_opd``), None without teacher logprobs or when they
    are not the kind the learner takes (top-k or not: ``serve.teacher_topk``)."""
    from areal_jax.learner.distill import TokenTeacher  # pylint: disable=import-outside-toplevel

    t, k = row.get("teacher"), self.config.serve.teacher_topk
    if not t or len(t.get("logprobs", ())) != len(row["completion_tokens"]):
      return None
    if k and (len(t.get("topk_ids") or ()) != len(t["logprobs"])
              or any(len(ids) != k for ids in t["topk_ids"])):
      return None
    logprobs = t["logprobs"]
    if self.config.serve.opd_center and not k:
      # serve.opd_center: the term's mean over the response (with the behaviour logprobs standing
      # in for the learner's) is taken out, so it moves credit between the response's tokens and
      # the judge's score alone says how good the response was as a whole
      shift = sum(a - b for a, b in zip(logprobs, row["logprobs"])) / max(len(logprobs), 1)
      logprobs = [x - shift for x in logprobs]
    return TokenTeacher(logprobs, self.config.serve.signal_w_opd,
                        t.get("topk_ids") if k else None, t.get("topk_logprobs") if k else None)

  def _skip_reason(self, row: dict, version: int) -> str | None:
    return skip_reason(row, version, self.config.serve.max_staleness,
                       self.config.rollout.temperature)

  def save(self) -> None:
    v = self.learner.version
    totals = dict(self.stats, baseline=self.baseline)
    # The keys a run checkpoint must carry (runtime/checkpoint.REQUIRED_META); serving has no data
    # iterator or pending groups: the store is the data position.
    meta = dict(version=v, data_state={"source": "turn_store"}, next_group_id=0, pending=[],
                staleness={}, totals=totals)
    self.ckpt.save(v, self.learner.state, meta)

  def _metrics_path(self) -> str:
    return os.path.join(self.workdir, METRICS_FILE)

  def _write_metrics(self, row: dict) -> None:
    with open(self._metrics_path(), "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")
    log.info("trained version %d: score %s baseline %s (%.1fs)", row["version"],
             _num(row["score_mean"]), _num(row["baseline"]), row["train_s"])

  def _truncate_metrics(self, version: int) -> None:
    """Drops metric rows of steps after ``version`` (redone after a restart); atomic."""
    path = self._metrics_path()
    if not os.path.exists(path):
      return
    with open(path, encoding="utf-8") as f:
      rows = [line for line in f if line.strip() and json.loads(line).get("version", 0) <= version]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(rows)
    os.replace(path + ".tmp", path)


def _num(x) -> str:
  return "-" if x is None else f"{x:.3f}"
