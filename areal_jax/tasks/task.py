"""The ``Task`` interface the runtime uses: examples, a resumable train iterator, prompts, a reward.

A task owns two splits of examples (``dict`` with at least ``id``, ``question``, ``answer``), loaded
lazily and cached. Subclasses only say how a split is loaded (:meth:`Task._load`). A task knows
nothing of the runtime, sampler or learner.

``Task`` pickles without its cached rows, so ``task.reward`` (or the module-level
:attr:`Task.reward_fn`) can be sent to reward worker processes cheaply.
"""

from __future__ import annotations

from typing import Any

import grain

from areal_jax.tasks import data, prompts
from areal_jax.tasks import reward as reward_lib

SPLITS = ("train", "test")


def task_settings(task_config: Any = None) -> dict:
  """The ``task`` config sub-tree as a plain dict over the defaults of ``areal_jax.config``.

  Accepts a ``ConfigDict``, a mapping, or None (all defaults). An unknown key is an error.
  """
  from areal_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  settings = config_lib.base_config().task.to_dict()
  if task_config is None:
    return settings
  given = task_config.to_dict() if hasattr(task_config, "to_dict") else dict(task_config)
  unknown = sorted(set(given) - set(settings))
  if unknown:
    raise KeyError(f"unknown task config keys {unknown}; valid keys: {sorted(settings)}")
  settings.update(given)
  return settings


class Task:
  """Base class; see the module docstring. Construct through ``areal_jax.tasks.get_task``."""

  name = "task"
  reward_fn = staticmethod(reward_lib.reward)  # (completion_text, example) -> float; picklable

  def __init__(self, task_config: Any = None):
    self.settings = task_settings(task_config)
    s = self.settings
    self.prompt_format = prompts.PromptFormat(system_prompt=s["system_prompt"],
                                              instruction=s["instruction"],
                                              use_chat_template=bool(s["use_chat_template"]),
                                              enable_thinking=bool(s["enable_thinking"]))
    self._rows: dict[str, data.Rows] = {}
    if s["reward"] != "answer":  # a module-level function: still pickles by reference
      if s["reward"] not in reward_lib.REWARDS:
        raise ValueError(f"task.reward={s['reward']!r} is not one of {sorted(reward_lib.REWARDS)}")
      self.reward_fn = reward_lib.REWARDS[s["reward"]]

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_rows"] = {}  # reloaded on demand in the other process
    return state

  def __repr__(self):
    return f"{type(self).__name__}({self.name!r})"

  # --- examples -------------------------------------------------------------------------------

  def _load(self, split: str) -> data.Rows:
    raise NotImplementedError(f"{type(self).__name__} does not say how to load a split")

  def _split(self, split: str) -> data.Rows:
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if split not in self._rows:
      self._rows[split] = self._load(split)
    return self._rows[split]

  def examples(self, split: str) -> list[dict]:
    """All usable examples of ``split`` ("train" | "test"), in file (or generation) order."""
    return self._split(split).rows

  @property
  def skipped(self) -> dict[str, int]:
    """Malformed rows skipped so far per loaded split (``task.skip_malformed=True``)."""
    return {split: rows.skipped for split, rows in self._rows.items()}

  def train_dataset(self, seed: int, epochs: int | None = 1) -> grain.MapDataset:
    """The train split shuffled by ``seed`` (a new order every epoch), ``epochs`` times (None: endless)."""
    return data.train_dataset(self.examples("train"), seed, epochs)

  def train_iterator(self, seed: int, epochs: int | None = 1) -> grain.DatasetIterator:
    """A resumable iterator over :meth:`train_dataset`: ``get_state()`` is a JSON-able dict."""
    return data.train_iterator(self.examples("train"), seed, epochs)

  def test_examples(self, limit: int | None = None) -> list[dict]:
    """The first ``limit`` test examples (all when None), always the same ones, as copies."""
    rows = self.examples("test")
    if limit is not None:
      if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
      rows = rows[:limit]
    return [dict(r) for r in rows]

  # --- prompts and reward ---------------------------------------------------------------------

  def prompt_messages(self, example: dict) -> list[dict]:
    """The chat messages for an example (system prompt if configured, question + instruction)."""
    return self.prompt_format.messages(example["question"])

  def prompt_text(self, example: dict, tokenizer=None) -> str:
    """The prompt string (chat template applied when ``task.use_chat_template``)."""
    return self.prompt_format.text(example["question"], tokenizer)

  def prompt_ids(self, example: dict, tokenizer) -> list[int]:
    """``tokenizer.encode(prompt_text(example, tokenizer))``."""
    return self.prompt_format.ids(example["question"], tokenizer)

  def reward(self, completion_text: str, example: dict) -> float:
    """``task.reward="answer"`` (default): 1.0 if the completion's final answer equals the
    example's ``#### N``, else 0.0; ``"digit_share"``: a toy dense reward (benchmarks). Never raises."""
    return self.reward_fn(completion_text, example)
