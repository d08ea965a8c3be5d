"""The run's environments from its config (``rollout.env``): in process, a pool, or remote.

``open_envs(settings)`` returns what makes each episode's ``Env`` (``env()``), with ``stats()``
and ``close()``: ``base.InProcessEnvs`` (kind "inprocess"), ``pool.EnvPool`` ("pool"),
``remote.RemoteEnvs`` ("remote") or ``ray_pool.RayEnvPool`` ("ray": the pool's workers as Ray
actors, with ``runtime.mode="ray"`` only).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from areal_jax.envs.base import DEFAULT_MAX_RESPONSE_BYTES, parse_args

KINDS = ("inprocess", "pool", "remote", "ray")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """The keys of ``rollout.env`` (see areal_jax/config.py)."""

  kind: str = "inprocess"
  class_path: str = ""
  args: str = ""
  workers: int = 2
  episodes_per_worker: int = 1
  url: str = ""
  step_timeout_s: float = 30.0
  max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

  @classmethod
  def from_config(cls, config) -> EnvSettings:
    """The settings of ``config.rollout.env`` (None: the defaults)."""
    if config is None:
      return cls()
    e = config.rollout.env
    if e.kind == "ray" and config.runtime.mode != "ray":
      raise ValueError("rollout.env.kind='ray' (pool workers as Ray actors) needs runtime.mode="
                       f"'ray', got {config.runtime.mode!r}; on one host use kind='pool'")
    return cls(str(e.kind), str(e.class_path), str(e.args), int(e.workers),
               int(e.episodes_per_worker), str(e.url), float(e.step_timeout_s),
               int(e.max_response_bytes))

  def check(self) -> None:
    """Raises ``ValueError`` naming the keys of a setting that cannot work."""
    if self.kind not in KINDS:
      raise ValueError(f"rollout.env.kind={self.kind!r} is not one of {KINDS}")
    if self.kind == "remote" and not self.url:
      raise ValueError("rollout.env.kind='remote' needs rollout.env.url (http://host:port)")
    if self.kind != "remote" and not self.class_path:
      raise ValueError(f"rollout.env.kind={self.kind!r} needs rollout.env.class_path "
                       "(package.module:Class)")
    if self.workers < 1 or self.episodes_per_worker < 1:
      raise ValueError(f"rollout.env.workers={self.workers} and rollout.env.episodes_per_worker="
                       f"{self.episodes_per_worker} must be >= 1")
    if self.step_timeout_s <= 0 or self.max_response_bytes < 1024:
      raise ValueError(f"rollout.env.step_timeout_s={self.step_timeout_s} must be > 0 and "
                       f"rollout.env.max_response_bytes={self.max_response_bytes} >= 1024")
    try:
      parse_args(self.args)
    except ValueError as e:
      raise ValueError(f"rollout.env.args: {e}") from None
    if self.kind in ("pool", "ray"):  # found without importing it here (the workers import it)
      module, sep, name = self.class_path.partition(":")
      try:
        found = bool(sep and name) and importlib.util.find_spec(module) is not None
      except (ImportError, ValueError):
        found = False
      if not found:
        raise ValueError(f"rollout.env.class_path={self.class_path!r}: no such module, or not "
                         "'package.module:Class'")


def open_envs(s: EnvSettings):
  """The environments ``s`` describes (a pool's workers start at their first episode)."""
  s.check()
  if s.kind == "inprocess":
    from areal_jax.envs.base import InProcessEnvs
    return InProcessEnvs(s.class_path, s.args, s.workers, s.step_timeout_s, s.max_response_bytes)
  if s.kind == "pool":
    from areal_jax.envs.pool import EnvPool
    return EnvPool(s.class_path, s.args, s.workers, s.episodes_per_worker, s.step_timeout_s,
                   s.max_response_bytes)
  if s.kind == "ray":
    from areal_jax.envs.ray_pool import RayEnvPool
    return RayEnvPool(s.class_path, s.args, s.workers, s.episodes_per_worker, s.step_timeout_s,
                      s.max_response_bytes)
  from areal_jax.envs.remote import RemoteEnvs
  return RemoteEnvs(s.url, s.step_timeout_s, s.max_response_bytes)
