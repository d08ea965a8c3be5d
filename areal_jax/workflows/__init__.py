"""Episodes the rollout controller runs per example (``rollout.workflow``); see ``base.py``.

``get(name, config)`` builds one from the run's config (``rollout.max_turns``,
``rollout.turn_discount``). Workflows know nothing of the runtime.
"""

from __future__ import annotations

from areal_jax.workflows.base import Client, Context, Episode, Trajectory, Workflow
from areal_jax.workflows.multi_turn import MultiTurn
from areal_jax.workflows.single_turn import SingleTurn
from areal_jax.workflows.tool import ToolUse

NAMES = ("single_turn", "multi_turn", "tool")

__all__ = ["NAMES", "Client", "Context", "Episode", "MultiTurn", "SingleTurn", "ToolUse",
           "Trajectory", "Workflow", "get"]


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
  raise ValueError(f"rollout.workflow={name!r} is not one of {NAMES}")
