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

from typing import Any

from areal_jax.tasks.arithmetic import ArithmeticTask
from areal_jax.tasks.data import MalformedRowError
from areal_jax.tasks.gsm8k import GSM8KTask
from areal_jax.tasks.task import Task, task_settings

TASKS: dict[str, type[Task]] = {"gsm8k": GSM8KTask, "arithmetic": ArithmeticTask}


def get_task(task_config: Any = None) -> Task:
  """The task named by ``task_config.name`` (a ``config.task`` sub-tree, a dict, or None: GSM8K)."""
  name = task_settings(task_config)["name"]
  if name not in TASKS:
    raise ValueError(f"task.name={name!r} is not one of {sorted(TASKS)}")
  return TASKS[name](task_config)


__all__ = ["ArithmeticTask", "GSM8KTask", "MalformedRowError", "TASKS", "Task", "get_task",
           "task_settings"]
