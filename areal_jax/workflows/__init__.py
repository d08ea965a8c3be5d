"""Episodes the rollout controller runs per example (``rollout.workflow``); see ``base.py``.

``get(name, config)`` builds one from the run's config (``rollout.max_turns``,
``rollout.turn_discount``, ``rollout.python_tool``, ``rollout.env``). Workflows know nothing of
the runtime.
"""

from __future__ import annotations

from areal_jax.envs.python_sandbox import Limits, Sandbox
from areal_jax.workflows.base import (AsyncClient, Client, Context, Episode, Trajectory, Workflow,
                                      is_async)
from areal_jax.workflows.multi_turn import MultiTurn
from areal_jax.workflows.python_tool import PythonTool
from areal_jax.workflows.single_turn import SingleTurn
from areal_jax.workflows.tool import ToolUse

NAMES = ("single_turn", "multi_turn", "tool", "python_tool", "env")

__all__ = ["NAMES", "AsyncClient", "Client", "Context", "Episode", "MultiTurn", "PythonTool",
           "SingleTurn", "ToolUse", "Trajectory", "Workflow", "get", "is_async", "sandbox"]


def get(name: str, config=None) -> Workflow:
  """The workflow ``name`` with its settings from ``config`` (the run config; None: defaults)."""
  r = None if config is None else config.rollout
  max_turns = 1 if r is None else int(r.max_turns)
  if name == "single_turn":
    return SingleTurn()
  if name == "multi_turn":
    return MultiTurn(max_turns, 1.0 if r is None else float(r.turn_discount))
  if name == "tool":
    return ToolUse(max_turns)
  if name == "python_tool":
    return PythonTool(max_turns, sandbox(config))
  if name == "env":  # async: an environment of rollout.env per episode (imported when chosen)
    from areal_jax.workflows import env_episode  # pylint: disable=import-outside-toplevel
    return env_episode.EnvEpisode.from_config(config)
  raise ValueError(f"rollout.workflow={name!r} is not one of {NAMES}")


def sandbox(config=None) -> Sandbox:
  """The Python sandbox with the limits of ``rollout.python_tool`` (None: the defaults)."""
  if config is None:
    return Sandbox()
  p = config.rollout.python_tool
  try:
    limits = Limits(wall_s=float(p.wall_s), cpu_s=int(p.cpu_s), memory_mib=int(p.memory_mib),
                    max_processes=int(p.max_processes), max_file_mib=int(p.max_file_mib),
                    max_output_bytes=int(p.max_output_bytes), max_code_bytes=int(p.max_code_bytes))
  except ValueError as e:
    raise ValueError(f"rollout.python_tool: {e}") from None
  return Sandbox(limits, allow_unisolated=bool(p.allow_unisolated))
