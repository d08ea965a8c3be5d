"""The server's side of the trainer process: the core split and the watcher's version following."""

from areal_jax import config as config_lib
from areal_jax.serve import trainer_supervisor


def _config(process=True, train=True, trainer_cores=0):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.trainer_process, config.serve.train = process, train
  config.serve.trainer_cores = trainer_cores
  config.lock()
  return config


def test_cores_are_split_disjoint_and_cover_what_the_process_may_use():
  server, trainer = trainer_supervisor.plan_cores(_config(), available={0, 1, 2, 3, 4})
  assert not set(server) & set(trainer) and set(server) | set(trainer) == {0, 1, 2, 3, 4}
  assert len(server) >= 2 and len(trainer) >= 2
  server, trainer = trainer_supervisor.plan_cores(_config(trainer_cores=1), available={0, 1, 2, 3})
  assert len(trainer) == 1 and len(server) == 3 and not set(server) & set(trainer)


def test_no_pinning_with_one_core_or_without_a_trainer_process():
  assert trainer_supervisor.plan_cores(_config(), available={3}) is None
  assert trainer_supervisor.plan_cores(_config(process=False), available={0, 1}) is None
  assert trainer_supervisor.plan_cores(_config(train=False), available={0, 1}) is None


class _Supervisor:
  announced = None

  def status(self):
    return None if self.announced is None else {"published": self.announced}


class _Receiver:
  published = ()

  def versions(self):
    return list(self.published)

  def fetch(self, v):
    return f"params-{v}"


class _Engine:

  def __init__(self):
    self.version, self.applied = 0, []

  def update_params(self, params, version):
    self.applied.append((params, version))
    self.version = version


def test_watcher_follows_announced_versions_also_back_after_a_crash():
  sup, rec, eng = _Supervisor(), _Receiver(), _Engine()
  watcher = trainer_supervisor.WeightsWatcher(sup, rec, eng, poll_s=0.1)
  assert not watcher.poll()  # nothing announced
  sup.announced = 3
  assert not watcher.poll()  # announced, but not (yet) readable: keep the current weights
  rec.published = (2, 3)
  assert watcher.poll() and eng.applied == [("params-3", 3)]
  assert not watcher.poll()  # already serving it
  sup.announced, rec.published = 2, (1, 2)  # the restarted trainer resumed from version 2
  assert watcher.poll() and eng.version == 2 and watcher.swaps == 2
