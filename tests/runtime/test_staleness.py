"""Staleness control: the admission bound, the strict per-sample bound, no deadlock, resume."""

import json
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from areal_jax.runtime.staleness import StalenessController

ADMIT, FINISH, TRAIN, PUBLISH = range(4)


class Sim:
  """Drives a controller as sampler + learner would, checking every bound from its own bookkeeping."""

  def __init__(self, ctl: StalenessController):
    self.ctl = ctl
    self.b, self.eta, self.c = ctl.batch_size, ctl.eta, ctl.max_concurrent
    self.p = self.s = ctl.version
    self.accepted = ctl.accepted
    self.admit_v: dict[int, int] = {}
    self.running: list[int] = []  # admission order
    self.next_gid = 0
    self.trained: list[tuple[int, int]] = []  # (step, admit version)

  def expected_capacity(self) -> int:
    r = len(self.running)
    return min(self.c - r, (self.eta + self.p + 1) * self.b - (self.accepted + r))

  def admit(self) -> bool:
    cap = self.ctl.capacity()
    assert cap == self.expected_capacity()
    if cap <= 0:
      assert self.ctl.try_admit(-1) is None
      return False
    gid, self.next_gid = self.next_gid, self.next_gid + 1
    version = self.ctl.admit(gid)
    assert version == self.p
    self.admit_v[gid] = version
    self.running.append(gid)
    # The admission bound: floor((N - 1) / B) <= p + eta for the N-th non-rejected group.
    assert self.accepted + len(self.running) <= (self.eta + self.p + 1) * self.b
    assert len(self.running) <= self.c
    return True

  def finish(self, index: int, accept: bool) -> bool:
    if not self.running:
      return False
    gid = self.running.pop(index % len(self.running))
    self.ctl.finish(gid, accept, payload=gid)
    self.accepted += accept
    return True

  def train(self) -> bool:
    ready = self.ctl.batch_ready()
    batch = self.ctl.take_batch(self.s, timeout=0)
    assert ready == (batch is not None)
    if batch is None:
      return False
    assert len(batch) == self.b
    versions = [self.admit_v[g] for g in batch]
    assert versions == sorted(versions)
    for v in versions:
      assert 0 <= self.s - v <= self.eta, (self.s, v, self.eta)
      if self.eta == 0:  # synchronous: batch s comes entirely from version s
        assert v == self.s
      self.trained.append((self.s, v))
    self.s += 1
    return True

  def publish(self) -> bool:
    if self.p >= self.s:
      return False
    self.p = self.s
    self.ctl.publish(self.p)
    return True

  def can_progress(self) -> bool:
    return (self.ctl.batch_ready() or bool(self.running) or self.ctl.capacity() > 0
            or self.p < self.s)

  def run(self, ops) -> None:
    for op, k, accept in ops:
      assert self.can_progress(), f"deadlock: {self.ctl.stats()}"
      if op == ADMIT:
        self.admit()
      elif op == FINISH:
        self.finish(k, accept)
      elif op == TRAIN:
        self.train()
      else:
        self.publish()

  def drain(self, steps: int, rng: random.Random) -> None:
    """Makes ``steps`` more learner steps with adversarial completion order (newest first)."""
    target = self.s + steps
    for _ in range(100_000):
      if self.s >= target:
        return
      if self.train() or self.publish():
        continue
      if self.running and (rng.random() < 0.7 or self.ctl.capacity() <= 0):
        self.finish(len(self.running) - 1, rng.random() < 0.8)
      elif not self.admit():
        assert self.running, f"deadlock: {self.ctl.stats()}"
    raise AssertionError("no progress")


ops_strategy = st.lists(
    st.tuples(st.sampled_from([ADMIT, ADMIT, FINISH, FINISH, TRAIN, PUBLISH]),
              st.integers(0, 1000), st.integers(0, 4).map(lambda r: r != 0)),
    max_size=250)
config_strategy = st.tuples(st.sampled_from([0, 1, 2, 4]), st.integers(1, 4), st.integers(0, 6))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=config_strategy, ops=ops_strategy, seed=st.integers(0, 2**16))
def test_random_interleavings_respect_both_bounds(config, ops, seed):
  eta, b, extra_c = config
  sim = Sim(StalenessController(b, eta, max(1, b - 2 + extra_c)))  # C below, at and above B
  sim.run(ops)
  sim.drain(eta + 3, random.Random(seed))
  assert max((s - v for s, v in sim.trained), default=0) <= eta


@settings(max_examples=150, deadline=None)
@given(config=config_strategy, ops=ops_strategy, more=ops_strategy, seed=st.integers(0, 2**16))
def test_resume_restores_capacity_and_keeps_the_bound(config, ops, more, seed):
  eta, b, extra_c = config
  c = max(1, b - 2 + extra_c)
  sim = Sim(StalenessController(b, eta, c))
  sim.run(ops)
  sim.drain(1, random.Random(seed))
  if sim.p < sim.s:
    sim.publish()
  v = sim.s
  state = json.loads(json.dumps(sim.ctl.state_dict()))
  restored = StalenessController(b, eta, c)
  restored.load_state_dict(state)
  assert (restored.version, restored.learner_version, restored.accepted) == (v, v, v * b)
  assert (restored.running, restored.queued, restored.rejected) == (0, 0, sim.ctl.rejected)

  # An uninterrupted run at version v whose queue is empty has the same capacity.
  straight = StalenessController(b, eta, c)
  for step in range(v):
    for gid in range(b):
      straight.admit((step, gid))
      straight.finish((step, gid), True)
    assert straight.take_batch(step, timeout=0) is not None
    straight.publish(step + 1)
  assert restored.capacity() == straight.capacity() == min(c, (eta + 1) * b)
  assert restored.state_dict() == dict(straight.state_dict(), rejected=sim.ctl.rejected)

  after = Sim(restored)
  after.run(more)
  after.drain(eta + 2, random.Random(seed + 1))


def test_eta0_is_synchronous():
  b = 3
  ctl = StalenessController(b, eta=0, max_concurrent=2 * b)
  for version in range(4):
    gids = [(version, k) for k in range(b)]
    assert [ctl.try_admit(g) for g in gids] == [version] * b
    assert ctl.capacity() == 0 and ctl.try_admit("extra") is None  # nothing of batch i+1 yet
    for g in reversed(gids):
      assert not ctl.batch_ready()
      ctl.finish(g, True, payload=g)
    assert ctl.capacity() == 0
    assert sorted(ctl.take_batch(version, timeout=0)) == gids
    assert ctl.capacity() == 0  # still 0 until version + 1 reaches the sampler
    ctl.publish(version + 1)


def test_rejected_groups_free_budget():
  ctl = StalenessController(batch_size=2, eta=0, max_concurrent=4)
  assert ctl.try_admit("a") == 0 and ctl.try_admit("b") == 0
  assert ctl.capacity() == 0
  ctl.finish("a", False)
  assert ctl.capacity() == 1 and ctl.rejected == 1 and ctl.accepted == 0
  assert ctl.try_admit("c") == 0
  ctl.finish("b", True, "b")
  ctl.finish("c", True, "c")
  assert ctl.take_batch(0, timeout=0) == ["b", "c"]


def test_long_group_is_trained_within_the_bound():
  """Completion order != admission order: the admission rule alone would let g1 go stale.

  eta=1, B=1, C=2: g1 and g2 start at version 0; g1 is very long. The learner trains g2 (step 0).
  A naive learner would train g3 (version 1) at step 1 and find g1 still running, then train g1 at
  step 2 with staleness 2. Ours waits for g1 at step 1, its deadline.
  """
  ctl = StalenessController(batch_size=1, eta=1, max_concurrent=2)
  assert ctl.try_admit("g1") == 0 and ctl.try_admit("g2") == 0
  ctl.finish("g2", True, "g2")
  assert ctl.take_batch(0, timeout=0) == ["g2"]
  ctl.publish(1)
  assert ctl.try_admit("g3") == 1
  ctl.finish("g3", True, "g3")
  assert not ctl.batch_ready()  # g3 is finished, but g1 must be trained at step 1
  assert ctl.take_batch(1, timeout=0.01) is None
  ctl.finish("g1", True, "g1")
  assert ctl.take_batch(1, timeout=0) == ["g1"]
  ctl.publish(2)
  assert ctl.take_batch(2, timeout=0) == ["g3"]


def test_guard_only_waits_when_a_deadline_requires_it():
  """With slack (eta=2) the learner skips a running old group and trains finished ones."""
  ctl = StalenessController(batch_size=1, eta=2, max_concurrent=3)
  assert [ctl.try_admit(g) for g in "abc"] == [0, 0, 0]
  ctl.finish("c", True, "c")
  assert ctl.take_batch(0, timeout=0) == ["c"]  # a and b (deadline 2) are still running
  ctl.publish(1)
  ctl.finish("b", True, "b")
  assert ctl.take_batch(1, timeout=0) == ["b"]
  ctl.publish(2)
  assert ctl.try_admit("d") == 2
  ctl.finish("d", True, "d")
  assert ctl.take_batch(2, timeout=0) is None  # a's deadline is step 2
  ctl.finish("a", True, "a")
  assert ctl.take_batch(2, timeout=0) == ["a"]


def test_errors_are_clear():
  ctl = StalenessController(2, 1)
  with pytest.raises(ValueError, match="take_batch"):
    ctl.take_batch(3, timeout=0)
  with pytest.raises(KeyError, match="no such running group"):
    ctl.finish("nope", True)
  ctl.admit("x")
  with pytest.raises(ValueError, match="already running"):
    ctl.admit("x")
  ctl.publish(1)
  with pytest.raises(ValueError, match="must not decrease"):
    ctl.publish(0)
  with pytest.raises(ValueError, match="eta"):
    StalenessController(2, -1)
  full = StalenessController(1, 0)
  full.admit("y")
  with pytest.raises(TimeoutError, match="no admission capacity"):
    full.admit("z", timeout=0.01)


@pytest.mark.parametrize("eta", [0, 2])
def test_threaded_producer_and_consumer(eta):
  b, c, steps = 4, 6, 15
  ctl = StalenessController(b, eta, c)
  violations, errors, trained = [], [], []
  gid_lock, counter = threading.Lock(), [0]

  def worker(seed):
    rng = random.Random(seed)
    try:
      while True:
        with gid_lock:
          gid = counter[0]
          counter[0] += 1
        try:
          admit_v = ctl.admit(gid, timeout=None)
        except RuntimeError:  # closed
          return
        first_token_v = ctl.version
        time.sleep(rng.choice([0.0005, 0.001, 0.002, 0.02]))  # long tail
        ctl.finish(gid, rng.random() < 0.85, payload=(gid, admit_v, first_token_v))
    except Exception as e:  # surfaced by the main thread
      errors.append(e)

  def learner():
    try:
      for s in range(steps):
        batch = ctl.take_batch(s, timeout=20)
        if batch is None:
          raise TimeoutError(f"learner starved at step {s}: {ctl.stats()}")
        for gid, admit_v, first_v in batch:
          trained.append(gid)
          if s - first_v > eta or s - admit_v > eta:
            violations.append((s, gid, admit_v, first_v))
        time.sleep(0.002)  # train
        ctl.publish(s + 1)
    except Exception as e:
      errors.append(e)

  workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(c)]
  consumer = threading.Thread(target=learner, daemon=True)
  for t in workers + [consumer]:
    t.start()
  consumer.join(60)
  ctl.close()
  for t in workers:
    t.join(5)
  assert not consumer.is_alive() and not any(t.is_alive() for t in workers)
  assert not errors, errors
  assert not violations, violations
  assert len(trained) == len(set(trained)) == steps * b
  assert ctl.learner_version == steps
