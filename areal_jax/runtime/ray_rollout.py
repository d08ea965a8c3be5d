"""``runtime.mode="ray"``: rollout workers as Ray actors, driven from the learner's process.

The driver (this process) stays the learner and keeps the staleness controller and the rollout
controller, unchanged: ``RayRolloutEngine`` is just another ``RolloutEngine`` to them. It fans groups
out to ``rollout.workers`` actors (``ray_worker.RolloutWorker``, least loaded first) and streams
their samples back. A group's samples are held here until all ``n`` have arrived from one attempt,
then released together.

Faults: a worker that dies (SIGKILL, OOM, a lost node) fails its outstanding calls with
``RayActorError``; Ray restarts it (up to ``runtime.max_worker_restarts`` times). Its unfinished
groups are resubmitted whole once it is back (any of their samples that had already arrived are
discarded, so each group is trained once, with all ``n`` samples from one attempt), after it has
been told the current weights version. Resubmitted groups keep their admission, so the staleness
controller's accounting and bound are untouched: the learner waits for them like for any slow group.

Weights: the learner publishes versions with Orbax under ``weights.path`` (``<workdir>/weights``
by default; a bucket for multi-host runs), without waiting for the write to finish
(``OrbaxAnnouncer``, or a learner group's processes: only the copy out of device memory blocks it);
``update_params`` then announces the version to every worker, which loads it from storage between
decode steps. With ``actor.lora`` a version holds only the adapters; each worker merges them into
the base it built from ``model.source``. With ``weights.transfer="jax_transfer"``
(``jax_transfer.JaxTransferPublisher``) the workers pull it from the learner's memory instead: the
announcement carries each worker's ticket (the learner's transfer server address and a uuid of its
own). Each request carries the version announced when it was
sent, and a worker starts it only once it runs that version.

Hardware: on CPU the cores this process may use are split into one set for the learner (the driver
pins itself to it) and one per worker (``runtime.learner_cores``); each worker gets
``mesh.sampler_devices`` fake devices. On GPU / TPU (``runtime.worker_devices``) each worker asks
Ray for ``mesh.sampler_devices`` chips.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample
from areal_jax.runtime import errors, ray_worker, weight_transfer
from areal_jax.runtime.ray_cluster import plan_cores


class OrbaxAnnouncer(weight_transfer.StorageAnnouncer):
  """The learner's side of the weights in ray mode: ``send`` starts an Orbax save and returns as
  soon as the arrays are out of device memory; the workers read the version once it is finalized."""

  def __init__(self, path: str, keep: int, dtype=None):
    self.path = path
    self.publisher = weight_transfer.OrbaxPublisher(path, keep, dtype)

  def send(self, params, version: int) -> None:
    self.publisher.publish(params, version, wait=False)

  @property
  def last_publish_s(self) -> float:
    return self.publisher.last_publish_s

  def close(self) -> None:
    self.publisher.close()


def build(config, workdir: str):
  """``(RayRolloutEngine, announcer)`` for ``runtime.mode="ray"``; call inside ``session``.

  On CPU the driver pins itself to the learner's cores here (before the learner compiles). With a
  learner group (``runtime.learner_processes > 1``) the announcer is None: the group publishes the
  versions into the same directory (``LearnerGroup.announcer``, set by the caller).
  """
  r, w = config.rollout, config.weights
  # absolute: a worker's working directory need not be this process's
  path = w.path or os.path.abspath(os.path.join(os.fspath(workdir), "weights"))
  if w.transfer not in ("orbax", "jax_transfer"):
    print(f"runtime.mode='ray': weights go to the rollout workers through Orbax under {path} "
          f"(weights.transfer={w.transfer!r} applies to one process only)", flush=True)
  plan = None
  if config.runtime.worker_devices == "cpu":
    plan = plan_cores(r.workers, config.runtime.learner_cores)
    if plan is None:
      print(f"warning: {len(os.sched_getaffinity(0))} cores cannot give the learner and "
            f"{r.workers} rollout workers one core each: nothing is pinned", file=sys.stderr, flush=True)
    else:
      ray_worker.pin_process(plan[0])
      print(f"cores: learner {plan[0]}, rollout workers {plan[1]}", flush=True)
  if config.runtime.learner_processes > 1:  # the group publishes (LearnerGroup.announcer)
    announcer = None
  elif w.transfer == "jax_transfer":  # (after pinning: the transfer server starts JAX's backend)
    import ray  # pylint: disable=import-outside-toplevel
    from areal_jax.runtime import jax_transfer  # pylint: disable=import-outside-toplevel
    host = ray.util.get_node_ip_address() if config.runtime.ray_address else "127.0.0.1"
    announcer = jax_transfer.JaxTransferPublisher(host, weight_transfer.version_dtype(config))
    print(f"weights: rollout workers pull each version from {announcer.address} "
          "(weights.transfer='jax_transfer')", flush=True)
  else:
    announcer = OrbaxAnnouncer(path, w.keep, weight_transfer.version_dtype(config))
  engine = RayRolloutEngine(config, path, [None] * r.workers if plan is None else plan[1])
  engine.announcer = announcer
  return engine, announcer


# ---- the engine ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Group:
  request: GroupRequest
  worker: int
  attempt: int = 0
  sent: bool = False
  samples: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Worker:
  actor: object
  live: bool = False
  ready_ref: object = None  # the "ready" probe while starting or restarting
  poll_ref: object = None
  restarts: int = 0
  died_s: float = 0.0
  probe_failures: int = 0
  stats: dict = dataclasses.field(default_factory=dict)


class RayRolloutEngine(RolloutEngine):
  """Rollout workers on a Ray cluster behind the ``RolloutEngine`` interface (see the module doc)."""

  def __init__(self, config, weights_path: str, worker_cores, poll_s: float = 0.05):
    import ray  # pylint: disable=import-outside-toplevel

    self.ray, self.poll_s = ray, poll_s
    self.max_restarts = config.runtime.max_worker_restarts
    self.restart_timeout_s = 600.0  # a restarted worker rebuilds its model and engine
    kind, n_dev = config.runtime.worker_devices, config.mesh.sampler_devices
    resources = {} if kind == "cpu" else ({"num_gpus": n_dev} if kind == "gpu"
                                          else {"resources": {"TPU": n_dev}})
    self.resources = resources
    # The workers import this very checkout (the driver may run from a clone that is not the
    # installed one): its root goes first on their PYTHONPATH.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                     if p and p != root])
    actor_cls = ray.remote(ray_worker.RolloutWorker).options(
        max_restarts=self.max_restarts, max_task_retries=0, max_concurrency=8, num_cpus=0,
        runtime_env={"env_vars": {"PYTHONPATH": path}}, **resources)
    self.workers = [_Worker(actor_cls.remote(config, weights_path, cores)) for cores in worker_cores]
    self._groups: dict[int, _Group] = {}
    self._lock = threading.RLock()
    self._version = 0
    self.announcer = None
    self.resubmitted: list[int] = []  # group ids redone after a worker died (for audits and tests)
    # (version, time, workers' CPU seconds, workers' seconds reading weights) at each update
    self.history: list[tuple[int, float, float, float]] = []

  # ---- lifecycle ---------------------------------------------------------------------------------
  def start(self) -> None:
    """Waits until every worker has built its engine. A worker killed meanwhile (e.g. by Ray's
    memory monitor) is waited for through its restart; one that cannot start raises here."""
    now = time.time()
    for w in self.workers:
      w.died_s, w.probe_failures = now, 0
      w.ready_ref = w.actor.info.remote()
    while True:
      refs = {w.ready_ref: i for i, w in enumerate(self.workers) if w.ready_ref is not None}
      if not refs:
        return
      if time.time() - now > self.restart_timeout_s:
        raise RuntimeError(
            f"rollout workers {sorted(refs.values())} did not start within "
            f"{self.restart_timeout_s:.0f} s: does the Ray cluster have what each asks for "
            f"({self.resources or 'CPU only'}; runtime.worker_devices, mesh.sampler_devices)?")
      for ref in self.ray.wait(list(refs), num_returns=1, timeout=1.0)[0]:
        self._on_ready(refs[ref], "ready", ref)

  def stop(self) -> None:
    """Stops every worker (unfinished groups are dropped) and closes the weights publisher."""
    with self._lock:
      stops = [w.actor.stop.remote() for w in self.workers if w.live]
      try:
        self.ray.get(stops, timeout=30)
      except Exception:  # pylint: disable=broad-except  (dead or stuck: killed below)
        pass
      for w in self.workers:
        self.ray.kill(w.actor, no_restart=True)
        w.live = False
    if self.announcer is not None:
      self.announcer.close()

  def worker_info(self) -> list[dict]:
    """``info()`` of every worker (pid, cores, devices, version); blocks until they answer."""
    return self.ray.get([w.actor.info.remote() for w in self.workers], timeout=600)

  # ---- RolloutEngine -----------------------------------------------------------------------------
  @property
  def version(self) -> int:
    return self._version

  def submit(self, request: GroupRequest) -> None:
    with self._lock:
      load = [sum(g.worker == i for g in self._groups.values()) for i in range(len(self.workers))]
      live = [i for i, w in enumerate(self.workers) if w.live] or list(range(len(self.workers)))
      group = _Group(request, min(live, key=lambda i: load[i]))
      self._groups[request.group_id] = group
      if self.workers[group.worker].live:
        self._send(group)

  def update_params(self, params, version: int) -> None:
    """Announces ``version`` (already handed to the announcer); ``params`` is not used here."""
    del params
    with self._lock:
      self._version = int(version)
      for i, w in enumerate(self.workers):
        if w.live:
          self._notify(i)
      self.history.append((self._version, time.time(),
                           sum(w.stats.get("cpu_s", 0.0) for w in self.workers),
                           sum(w.stats.get("load_s", 0.0) for w in self.workers)))

  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    deadline = float("inf") if timeout is None else time.time() + timeout
    out = []
    while True:
      with self._lock:
        refs = {}
        for i, w in enumerate(self.workers):
          if w.ready_ref is not None:
            refs[w.ready_ref] = (i, "ready")
          elif w.poll_ref is not None:
            refs[w.poll_ref] = (i, "poll")
      left = min(1.0, max(0.0, deadline - time.time()))
      ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=left) if refs else ([], [])
      if refs:  # everything else that is done by now too
        ready = self.ray.wait(list(refs), num_returns=len(refs), timeout=0)[0] or ready
      for ref in ready:
        i, kind = refs[ref]
        out += self._on_ready(i, kind, ref)
      if out or time.time() >= deadline:
        return out
      if not refs:
        time.sleep(min(0.01, left))

  def abort(self, group_id: int) -> None:
    with self._lock:
      g = self._groups.get(group_id)
      if g is not None and g.sent and self.workers[g.worker].live:
        self.workers[g.worker].actor.abort.remote(group_id)

  def pause(self) -> None:
    for w in self.workers:
      if w.live:
        w.actor.pause.remote()

  def resume(self) -> None:
    for w in self.workers:
      if w.live:
        w.actor.resume.remote()

  # ---- internals -------------------------------------------------------------------------------
  def _notify(self, i: int) -> None:
    """Announces the current version to worker ``i`` (with its ticket when the weights need one)."""
    w = self.workers[i]
    ticket = None if self.announcer is None else self.announcer.ticket(i, w.restarts)
    if ticket is None:
      w.actor.notify.remote(self._version)
    else:
      w.actor.notify.remote(self._version, ticket)

  def _send(self, g: _Group) -> None:
    g.sent = True
    meta = dict(g.request.metadata, _attempt=g.attempt)
    self.workers[g.worker].actor.submit.remote(dataclasses.replace(g.request, metadata=meta),
                                               self._version)

  def _on_ready(self, i: int, kind: str, ref) -> list[Sample]:
    w = self.workers[i]
    try:
      value = self.ray.get(ref)
    except self.ray.exceptions.RayTaskError:  # the worker raised: a bug, not a lost process
      raise
    except self.ray.exceptions.RayError as e:  # the process died (SIGKILL, Ray's OOM killer, ...)
      if kind == "ready":  # still restarting: ask again shortly
        self._on_probe_failure(i, e)
      else:
        self._on_death(i, e)
      return []
    if kind == "ready" and value.get("fault"):  # it started, but on a fault a person fixes
      raise errors.remote_error(f"rollout worker {i}", *value["fault"])
    with self._lock:
      if kind == "ready":  # back after a restart: current weights, then its groups again
        w.ready_ref, w.live = None, True
        w.stats.update(value)
        self._notify(i)
        for g in self._groups.values():
          if g.worker == i and not g.sent:
            self._send(g)
        w.poll_ref = w.actor.poll.remote(self.poll_s)
        return []
      samples, stats = value
      w.stats.update(stats)
      w.poll_ref = w.actor.poll.remote(self.poll_s)
      out = []
      for s in samples:
        g = self._groups.get(s.group_id)
        if g is None or s.metadata.get("_attempt") != g.attempt:
          continue  # an older attempt of a resubmitted group
        s.metadata.pop("_attempt", None)
        g.samples.append(s)
        if len(g.samples) == g.request.n:
          del self._groups[s.group_id]
          out += g.samples
      return out

  def _on_death(self, i: int, error: Exception) -> None:
    with self._lock:
      w = self.workers[i]
      w.live, w.poll_ref = False, None
      w.restarts += 1
      if self.announcer is not None:  # its offer will not be taken: the next incarnation gets one
        self.announcer.drop(i)
      if self.max_restarts >= 0 and w.restarts > self.max_restarts:
        raise RuntimeError(f"rollout worker {i} died {w.restarts} times "
                           f"(runtime.max_worker_restarts={self.max_restarts})") from error
      redo = [g for g in self._groups.values() if g.worker == i]
      for g in redo:  # whole groups again, once the worker is back
        g.attempt, g.sent, g.samples = g.attempt + 1, False, []
        self.resubmitted.append(g.request.group_id)
      print(f"rollout worker {i} died ({type(error).__name__}); waiting for its restart "
            f"({w.restarts}/{self.max_restarts}), then redoing its {len(redo)} unfinished groups",
            file=sys.stderr, flush=True)
      w.died_s, w.probe_failures = time.time(), 0
      w.ready_ref = w.actor.info.remote()

  def _on_probe_failure(self, i: int, error: Exception) -> None:
    w = self.workers[i]
    w.probe_failures += 1
    dead = isinstance(error, self.ray.exceptions.ActorDiedError) and w.probe_failures >= 3
    if dead or time.time() - w.died_s > self.restart_timeout_s:
      cause = (str(error).strip().splitlines() or [type(error).__name__])[-1][:400]
      what = "could not start" if w.restarts == 0 else (
          f"did not come back after dying ({w.restarts} restarts, "
          f"runtime.max_worker_restarts={self.max_restarts})")
      raise RuntimeError(f"rollout worker {i} {what}: {cause}") from error
    time.sleep(0.1)
    w.ready_ref = w.actor.info.remote()
