"""Splits the devices into the learner mesh and the sampler mesh (or one shared, colocated set)."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from areal_jax import config as config_lib
from areal_jax import sharding


def build(mesh_config, devices=None, remote_sampler: bool = False) -> tuple[Mesh, Mesh | None]:
  """``(learner_mesh, sampler_mesh)``: disjoint devices, or, when colocated, the same first
  ``mesh.learner_devices`` devices for both. ``remote_sampler`` (rollout workers in processes of
  their own, ``runtime.mode="ray"``): the learner mesh only, and ``None`` for the sampler's."""
  devices = list(jax.devices() if devices is None else devices)
  if remote_sampler:
    n_l = mesh_config.learner_devices
    if n_l > len(devices):
      raise ValueError(f"mesh.learner_devices={n_l} exceeds the {len(devices)} devices of this "
                       "process (the rollout workers bring their own)")
    return sharding.make_mesh(config_lib.mesh_sizes(mesh_config.learner, n_l, "mesh.learner"),
                              devices[:n_l]), None
  if mesh_config.colocated:
    if mesh_config.learner_devices > len(devices):
      raise ValueError(f"mesh.learner_devices={mesh_config.learner_devices} (colocated) exceeds the "
                       f"{len(devices)} available devices")
    learner_devs = sampler_devs = devices[:mesh_config.learner_devices]
  else:
    n_l, n_s = mesh_config.learner_devices, mesh_config.sampler_devices
    if n_l + n_s > len(devices):
      raise ValueError(f"mesh.learner_devices={n_l} + mesh.sampler_devices={n_s} exceeds the "
                       f"{len(devices)} available devices (set mesh.colocated=True on one device)")
    learner_devs, sampler_devs = devices[:n_l], devices[n_l:n_l + n_s]
  learner = sharding.make_mesh(
      config_lib.mesh_sizes(mesh_config.learner, len(learner_devs), "mesh.learner"), learner_devs)
  sampler = sharding.make_mesh(
      config_lib.mesh_sizes(mesh_config.sampler, len(sampler_devs), "mesh.sampler"), sampler_devs)
  return learner, sampler
