"""Multi-process glue: one JAX program over the devices of several processes (``jax.distributed``).

Every process of a group runs the same code on the same host-side inputs (multi-controller SPMD);
a mesh built from ``jax.devices()`` then spans all processes, and jitted functions run their
collectives across them (on CPU through Gloo, so the multi-host path is exercised on one machine).
Host arrays become global arrays with ``sharding.global_rows``; replicated results (metrics, the
policy version) are read on any process; Orbax saves and restores with every process writing or
reading its own shards.

``initialize`` must run before anything touches a JAX backend in the process.
"""

from __future__ import annotations

import os
import socket

import jax
from jax.experimental import multihost_utils

from areal_jax import config as config_lib
from areal_jax import sharding


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port free on ``host`` right now (for a coordinator or a listener)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def initialize(coordinator: str, num_processes: int, process_id: int,
               local_device_ids=None, timeout_s: int = 120) -> None:
  """Joins the group of ``num_processes`` processes whose process 0 serves ``coordinator``
  (``host:port``). CPU collectives go through Gloo (a no-op setting on GPU/TPU backends)."""
  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is not in [0, {num_processes})")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id, local_device_ids=local_device_ids,
                             initialization_timeout=timeout_s)


def learner_mesh(mesh_config):
  """The learner mesh over every device of the group (``mesh.learner`` axes, resolved against the
  group's device count); process-major, so each process holds a contiguous block of it."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  sizes = config_lib.mesh_sizes(mesh_config.learner, len(devices), "mesh.learner")
  return sharding.make_mesh(sizes, devices)


def barrier(name: str) -> None:
  """All processes of the group reach ``name`` before any goes on (no-op in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def is_primary() -> bool:
  return jax.process_index() == 0


def local_device_count_env(n: int) -> dict:
  """Environment for a CPU learner process with ``n`` devices of its own."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return {"XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])}
