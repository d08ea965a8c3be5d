"""GSM8K grade-school math word problems.

The package ships a copy of GSM8K (``data/gsm8k/{train,test}.jsonl``, 7,473 and 1,319 problems,
MIT license in ``data/gsm8k/LICENSE``). ``task.train_path`` / ``task.test_path`` may point at another
copy instead: JSON lines, or a Hugging Face dataset stored locally as Parquet or Arrow files (a file
or a directory; a directory holding several splits, like a hub snapshot with
``main/train-*.parquet`` and ``main/test-*.parquet``, gives each split its own files). A row
needs a non-empty string ``question`` and a string ``answer`` whose last ``#### N`` gives the
numeric answer; an ``id`` column is kept when present.
"""

from __future__ import annotations

import importlib.resources
import pathlib

from areal_jax.tasks import data
from areal_jax.tasks import reward as reward_lib
from areal_jax.tasks.task import Task


def shipped_path(split: str) -> pathlib.Path:
  """The packaged JSON-lines file of a split."""
  path = importlib.resources.files("areal_jax.tasks").joinpath("data", "gsm8k", f"{split}.jsonl")
  path = pathlib.Path(str(path))
  if not path.is_file():
    raise FileNotFoundError(f"the shipped GSM8K copy is missing: {path} (is the package data "
                            f"installed? see [tool.setuptools.package-data] in pyproject.toml)")
  return path


def validate_row(row: dict) -> str | None:
  """None for a usable row, else what is wrong with it."""
  question, answer = row.get("question"), row.get("answer")
  if not isinstance(question, str) or not question.strip():
    return f"'question' must be a non-empty string, got {_short(question)}"
  if not isinstance(answer, str):
    return f"'answer' must be a string, got {_short(answer)}"
  if "####" not in answer:
    return "'answer' has no '#### <number>' final answer"
  if reward_lib.reference_answer(answer) is None:
    tail = answer[answer.rfind("####"):][:60]
    return f"'answer' final answer is not a number: {tail!r}"
  return None


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def to_examples(rows: list[dict], prefix: str) -> list[dict]:
  """Keeps ``id`` (or numbers the rows ``prefix-i``), ``question`` and ``answer``."""
  out = []
  for i, row in enumerate(rows):
    rid = row.get("id")
    out.append({"id": str(rid) if rid is not None else f"{prefix}-{i}",
                "question": row["question"].strip(), "answer": row["answer"]})
  return out


class GSM8KTask(Task):
  """GSM8K with the \\boxed{} prompt and the numeric ``####`` reward."""

  name = "gsm8k"

  def _load(self, split: str) -> data.Rows:
    given = self.settings[f"{split}_path"]
    path = pathlib.Path(given).expanduser() if given else shipped_path(split)
    rows = data.read_rows(path, validate_row, skip_malformed=bool(self.settings["skip_malformed"]),
                          split=split)
    rows.rows = to_examples(rows.rows, f"gsm8k-{split}")
    return rows
