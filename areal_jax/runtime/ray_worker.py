"""One rollout worker process (``runtime.mode="ray"``): a Ray actor owning its devices and an engine.

The body of the actor is a plain class, ``RolloutWorker``; ``ray_rollout`` wraps it with
``ray.remote`` (restarts, concurrency, resources). On start it

  1. pins every thread of its process to its CPU cores (``os.sched_setaffinity``) and sets its own
     ``XLA_FLAGS`` fake-device count, both *before* JAX is imported here (on GPU/TPU it takes the
     chips Ray assigned to it instead);
  2. builds the model from ``model.source`` and the rollout engine named by ``rollout.backend``
     (``engines.build``) on a mesh of its own devices (with ``actor.lora``: the learner's frozen
     base, into which the engine merges each version's adapters);
  3. waits for the driver to announce a weights version (``notify``; also right after a restart).

A fault a person fixes in 1-2 (``errors.fault_kinds``: ``model.source`` not on this host, a
sampler memory plan that cannot fit its devices) is not raised there (Ray would restart the actor
into the same fault): ``info`` reports it, and the driver raises it under its own type.

A loader thread reads the newest published version (``OrbaxReceiver.fetch_newer``: the full
weights, or with LoRA only the adapters; with ``weights.transfer="jax_transfer"``,
``JaxTransferReceiver.fetch_newer`` pulls the newest version it holds a ticket for, from the
learner's memory) whenever the driver has announced one newer than the engine's (``notify``) and
hands it to the engine, which swaps it in between two decode steps; in-flight sequences continue
and their tokens keep per-token versions (partial rollouts). A loader that fails (weights that
cannot be read, a learner that cannot be reached) ends the process, which Ray restarts: the driver
then redoes its groups and announces the current version afresh. A request submitted with
``min_version`` waits in the worker until its engine runs that version, so no token of a group is
older than the version the driver announced when it sent the group (the staleness bound).

This module imports neither JAX nor Ray at import time: the actor must pin itself first.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time


def pin_process(cores) -> None:
  """Restricts every thread of this process (and threads it starts later) to ``cores``."""
  cores = set(cores)
  for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
    try:
      os.sched_setaffinity(int(tid), cores)
    except (ProcessLookupError, PermissionError):  # a thread that just ended, or a foreign one
      pass
  os.sched_setaffinity(0, cores)


def cpu_seconds() -> float:
  """CPU seconds (user + system) this process has used."""
  ru = resource.getrusage(resource.RUSAGE_SELF)
  return ru.ru_utime + ru.ru_stime


def _exit_stuck(timeout_s: float) -> None:
  """The weights watchdog: a pull that never returns would hold the worker's groups forever."""
  print(f"rollout worker {os.getpid()}: a weights pull took over {timeout_s:.0f} s "
        "(weights.pull_timeout_s); exiting so that Ray restarts it", file=sys.stderr, flush=True)
  os._exit(75)  # pylint: disable=protected-access


class RolloutWorker:
  """Actor body: ``submit`` / ``poll`` / ``abort`` / ``pause`` / ``resume`` / ``version`` / ``notify``."""

  def __init__(self, config, weights_path: str, cores=None):
    self.started = time.time()
    self.fault = None
    try:
      self._start(config, weights_path, cores)
    except Exception as e:  # pylint: disable=broad-except
      from areal_jax.runtime import errors  # pylint: disable=import-outside-toplevel

      if not errors.is_fault(e):
        raise
      # a fault a person fixes (model.source not on this host, a sampler plan that cannot fit on
      # its devices): kept, not raised, so that Ray does not restart the actor into the same
      # fault; the driver's ready probe (info) raises it under its own type
      self.fault = errors.error_fields(e)

  def _start(self, config, weights_path: str, cores) -> None:
    if cores:
      pin_process(cores)
    devices = config.runtime.worker_devices
    if devices == "cpu":
      if "jax" in sys.modules:
        raise RuntimeError("JAX was imported in the rollout worker before its devices were set")
      flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
               if not f.startswith("--xla_force_host_platform_device_count")]
      flags.append(f"--xla_force_host_platform_device_count={config.mesh.sampler_devices}")
      os.environ["XLA_FLAGS"] = " ".join(flags)
      os.environ["JAX_PLATFORMS"] = "cpu"

    import jax  # pylint: disable=import-outside-toplevel
    from areal_jax import config as config_lib, sharding  # pylint: disable=import-outside-toplevel
    from areal_jax.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from areal_jax.runtime import engines, model_source, weight_transfer

    self.jax = jax
    devs = jax.devices()[:config.mesh.sampler_devices]
    if len(devs) < config.mesh.sampler_devices:
      raise RuntimeError(f"rollout worker: mesh.sampler_devices={config.mesh.sampler_devices} but "
                         f"this process sees {len(jax.devices())} {jax.default_backend()} devices")
    mesh = sharding.make_mesh(config_lib.mesh_sizes(config.mesh.sampler, len(devs), "mesh.sampler"),
                              devs)
    model, tokenizer = model_source.load(config)  # (LoRA: the learner's frozen base, as locally)
    lcfg = lora_lib.LoraConfig.from_config(config.actor.get("lora"))
    target = weight_transfer.version_target(model, mesh, lcfg,
                                            weight_transfer.version_dtype(config))
    if config.weights.transfer == "jax_transfer":
      from areal_jax.runtime import jax_transfer  # pylint: disable=import-outside-toplevel
      import ray  # pylint: disable=import-outside-toplevel
      host = ray.util.get_node_ip_address() if ray.is_initialized() else None
      self.receiver = jax_transfer.JaxTransferReceiver(target, host=host)
      self._pull_timeout_s = float(config.weights.get("pull_timeout_s", 120.0))
    else:
      self.receiver = weight_transfer.OrbaxReceiver(weights_path, target)
      self._pull_timeout_s = 0.0  # Orbax reads fail with an error (or wait for a finalized version)
    from areal_jax.learner.memory import device_budget  # pylint: disable=import-outside-toplevel
    self.engine = engines.build(config, model, tokenizer, mesh,
                                memory_budget=device_budget(config.mesh, devs))
    self._lock = threading.Condition()
    self._target = -1  # newest version announced by the driver
    self._held = []  # (request, min_version): waiting for the engine to run min_version
    self._stopping = False
    self.load_s = 0.0
    # The version the engine runs, once read from the publish directory (None: its own initial
    # weights, never used for a request). Nothing is read before the driver announces a version: a
    # resumed run republishes from its checkpoint and a directory may still hold newer versions of
    # the abandoned timeline until then.
    self._loaded: int | None = None
    self.engine.start()
    self._loader = threading.Thread(target=self._load_loop, name="weights-loader", daemon=True)
    self._loader.start()

  # ---- the driver's calls ----------------------------------------------------------------------
  def info(self) -> dict:
    """Process id, devices, version: also the driver's "ready" probe after a restart. ``fault``
    (``errors.error_fields``) when the worker could not start."""
    if self.fault is not None:
      return dict(pid=os.getpid(), fault=self.fault)
    return dict(pid=os.getpid(), version=self._loaded, cores=sorted(os.sched_getaffinity(0)),
                devices=[str(d) for d in self.jax.devices()], started=self.started)

  def submit(self, request, min_version: int = 0) -> None:
    with self._lock:
      if self._loaded is not None and self._loaded >= min_version:
        self.engine.submit(request)
      else:
        self._held.append((request, min_version))
        self._target = max(self._target, min_version)
        self._lock.notify_all()

  def poll(self, timeout: float = 0.05):
    """``(samples, stats)``: finished samples, and the worker's counters for the driver's metrics."""
    samples = self.engine.poll(timeout)
    return samples, dict(cpu_s=cpu_seconds(), wall_s=time.time() - self.started,
                         version=self._loaded, load_s=self.load_s)

  def notify(self, version: int, ticket: dict | None = None) -> None:
    """A new version is published (or about to be finalized): load it between decode steps.
    ``ticket``: where to pull it from (``weights.transfer="jax_transfer"``)."""
    if ticket is not None:
      self.receiver.offer(ticket)
    with self._lock:
      self._target = max(self._target, int(version))
      self._lock.notify_all()

  def abort(self, group_id: int) -> None:
    with self._lock:
      held = [(r, v) for r, v in self._held if r.group_id == group_id]
      self._held = [(r, v) for r, v in self._held if r.group_id != group_id]
    for request, _ in held:  # never reached the engine: submit then abort returns it as aborted
      self.engine.submit(request)
    self.engine.abort(group_id)

  def pause(self) -> None:
    self.engine.pause()

  def resume(self) -> None:
    self.engine.resume()

  def version(self) -> int | None:
    return self._loaded

  def stop(self) -> None:
    if self.fault is not None:  # nothing was started
      return
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    self._loader.join(timeout=10)
    self.engine.stop()
    self.receiver.close()

  # ---- weights -----------------------------------------------------------------------------------
  def _load_loop(self) -> None:
    while True:
      with self._lock:
        while not self._stopping and self._target <= (-1 if self._loaded is None else self._loaded):
          self._lock.wait(timeout=1.0)
        if self._stopping:
          return
      t0 = time.perf_counter()
      watchdog = None
      if self._pull_timeout_s:  # a stalled pull ends the worker like a failed one
        watchdog = threading.Timer(self._pull_timeout_s, _exit_stuck, args=(self._pull_timeout_s,))
        watchdog.daemon = True
        watchdog.start()
      try:
        found = self.receiver.fetch_newer(self._loaded)
      except Exception as e:  # pylint: disable=broad-except
        # Stuck on weights it cannot get, the worker would hold its groups forever: it ends, Ray
        # restarts it and the driver redoes its groups and announces the current version again.
        print(f"rollout worker {os.getpid()}: cannot load weights ({type(e).__name__}: {e}); "
              "exiting so that Ray restarts it", file=sys.stderr, flush=True)
        os._exit(75)  # pylint: disable=protected-access
      finally:
        if watchdog is not None:
          watchdog.cancel()
      if found is None:  # announced but not finalized yet (the learner publishes asynchronously)
        time.sleep(0.02)
        continue
      version, params = found
      self.engine.update_params(params, version)
      self.load_s += time.perf_counter() - t0
      while self.engine.version != version and not self._stopping:  # swapped between decode steps
        time.sleep(0.002)
      with self._lock:
        self._loaded = version
        ready = [(r, v) for r, v in self._held if v <= version]
        self._held = [(r, v) for r, v in self._held if v > version]
        for request, _ in ready:
          self.engine.submit(request)
