"""The task layer: data, prompts and rewards, behind one small interface.

``get_task(config.task)`` returns a :class:`Task`:

- ``train_iterator(seed, epochs=1)``: a resumable ``grain.DatasetIterator`` of examples (dicts with
  ``id``, ``question``, ``answer``), shuffled by ``seed`` anew each epoch; ``epochs=None`` is endless;
  ``get_state()`` / ``set_state()`` resume it exactly;
- ``test_examples(limit=None)``: the first ``limit`` test examples, always the same;
- ``prompt_messages(example)``, ``prompt_text(example, tokenizer)``, ``prompt_ids(example, tokenizer)``;
- ``reward(completion_text, example) -> float`` (also ``Task.reward_fn``, a picklable function).

Tasks: ``"gsm8k"`` (:mod:`areal_jax.tasks.gsm8k`) and ``"arithmetic"``
(:mod:`areal_jax.tasks.arithmetic`). They know nothing of the runtime, sampler or learner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from areal_jax.tasks.task import Task

# Imported when first named (PEP 562): a reward worker process unpickles its reward function from
# ``areal_jax.tasks.reward`` and so imports this package, but needs none of the data pipeline
# (grain, and with it JAX: most of a second of CPU in every worker).
_WHERE = {"ArithmeticTask": "arithmetic", "GSM8KTask": "gsm8k", "MalformedRowError": "data",
          "Task": "task", "task_settings": "task"}
_TASKS = {"gsm8k": "GSM8KTask", "arithmetic": "ArithmeticTask"}


def __getattr__(name: str) -> Any:
  if name == "TASKS":  # task name -> its Task class
    return {task: __getattr__(cls) for task, cls in _TASKS.items()}
  if name in _WHERE:
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_task(task_config: Any = None) -> Task:
  """The task named by ``task_config.name`` (a ``config.task`` sub-tree, a dict, or None: GSM8K)."""
  name = __getattr__("task_settings")(task_config)["name"]
  if name not in _TASKS:
    raise ValueError(f"task.name={name!r} is not one of {sorted(_TASKS)}")
  return __getattr__(_TASKS[name])(task_config)


__all__ = ["ArithmeticTask", "GSM8KTask", "MalformedRowError", "TASKS", "Task", "get_task",
           "task_settings"]
