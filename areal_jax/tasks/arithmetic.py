"""Synthetic arithmetic word problems in the GSM8K format, for CPU demos with small models.

A problem starts a person off with some items and applies ``difficulty`` operations (gain, loss,
"k times as many", equal sharing), then asks how many are left. The answer is a worked solution,
one line per step, ending in ``#### N`` like GSM8K, so the same prompt and reward apply.

Generation is deterministic: example ``i`` of a split depends only on (``seed``, split, ``i``,
``difficulty``, ``max_operand``), through Python's string-seeded ``random.Random`` (stable across
platforms and versions). Knobs (``task.*``):

- ``difficulty``: the number of operations (>= 1);
- ``max_operand``: the largest number added, removed or started with (>= 2); factors and divisors
  are at most ``min(max_operand, 10)``, and intermediate values stay whole and non-negative;
- ``num_train`` / ``num_test``: split sizes; no train question repeats a test question;
- ``seed``: the generation seed (fixed across runs, unlike the run's shuffle seed).

At ``difficulty=1`` a problem is one small addition, subtraction, multiplication or exact division.
Measured with SmolLM2-135M-Instruct (GGUF Q4_1 run by transformers on CPU, greedy, the default
\\boxed{} prompt through its chat template, 160 new tokens, 32 test problems, ``max_operand=20``):
5/32 = 0.16 right at ``difficulty=1``, 2/32 = 0.06 at ``difficulty=2``.
"""

from __future__ import annotations

import random

from areal_jax.tasks import data
from areal_jax.tasks.task import Task

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor",
         "Wen", "Yara", "Zoe")
ITEMS = (("apple", "apples"), ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"),
         ("pencil", "pencils"), ("cookie", "cookies"), ("stamp", "stamps"), ("shell", "shells"),
         ("coin", "coins"), ("card", "cards"), ("balloon", "balloons"), ("toy car", "toy cars"),
         ("seashell", "seashells"), ("candy", "candies"), ("flower", "flowers"), ("egg", "eggs"))
MAX_FACTOR = 10
OPS = ("add", "sub", "mul", "div")


def _count(k: int, item: tuple[str, str]) -> str:
  return f"{k} {item[0] if k == 1 else item[1]}"


def _feasible(op: str, value: int, max_operand: int, cap: int) -> bool:
  factor_max = min(max_operand, MAX_FACTOR)
  if op == "sub":
    return value >= 1
  if op == "mul":
    return 2 <= factor_max and value >= 1 and value * 2 <= cap
  if op == "div":
    return any(value % k == 0 for k in range(2, min(factor_max, value) + 1))
  return True


def make_problem(rng: random.Random, difficulty: int, max_operand: int) -> tuple[str, str, int]:
  """One problem: ``(question, worked answer ending in '#### N', N)``."""
  name, friend = rng.sample(NAMES, 2)
  item = rng.choice(ITEMS)
  cap = max_operand * MAX_FACTOR * 2  # keeps repeated "times as many" from exploding
  value = rng.randint(1, max_operand)
  sentences = [f"{name} has {_count(value, item)}."]
  steps = [f"{name} starts with {_count(value, item)}."]
  for _ in range(difficulty):
    op = rng.choice([o for o in OPS if _feasible(o, value, max_operand, cap)])
    factor_max = min(max_operand, MAX_FACTOR)
    if op == "add":
      k = rng.randint(1, max_operand)
      sentences.append(rng.choice((f"{friend} gives {name} {_count(k, item)}.",
                                   f"Then {name} buys {k} more.",
                                   f"{name} finds {k} more {item[0] if k == 1 else item[1]}.")))
      new = value + k
      steps.append(f"After getting {k} more: {value} + {k} = {new}.")
    elif op == "sub":
      k = rng.randint(1, min(max_operand, value))
      sentences.append(rng.choice((f"{name} gives {_count(k, item)} to {friend}.",
                                   f"Then {name} loses {k} of them.",
                                   f"{name} sells {_count(k, item)}.")))
      new = value - k
      steps.append(f"After giving away {k}: {value} - {k} = {new}.")
    elif op == "mul":
      k = rng.randint(2, max(2, min(factor_max, cap // value)))
      sentences.append(rng.choice((f"Then {name} ends up with {k} times as many {item[1]} as before.",
                                   f"{name} collects more until {name} has {k} times as many as before.")))
      new = value * k
      steps.append(f"{k} times as many: {value} * {k} = {new}.")
    else:
      k = rng.choice([d for d in range(2, min(factor_max, value) + 1) if value % d == 0])
      sentences.append(f"{name} shares the {item[1]} equally among {k} people, {name} included, "
                       f"and keeps one share.")
      new = value // k
      steps.append(f"One share of {k}: {value} / {k} = {new}.")
    value = new
  sentences.append(f"How many {item[1]} does {name} have now?")
  steps.append(f"#### {value}")
  return " ".join(sentences), "\n".join(steps), value


def generate(split: str, count: int, seed: int, difficulty: int, max_operand: int,
             avoid: frozenset[str] = frozenset()) -> list[dict]:
  """``count`` examples of a split; questions in ``avoid`` are skipped (keeping later ones stable)."""
  if difficulty < 1:
    raise ValueError(f"task.difficulty={difficulty} must be >= 1")
  if max_operand < 2:
    raise ValueError(f"task.max_operand={max_operand} must be >= 2")
  if count < 1:
    raise ValueError(f"task.num_{split}={count} must be >= 1")
  out, index = [], 0
  while len(out) < count:
    if index >= 20 * count + 1000:
      raise ValueError(f"could not generate {count} distinct {split} problems at difficulty={difficulty}, "
                       f"max_operand={max_operand}; lower task.num_{split} or raise task.max_operand")
    rng = random.Random(f"arithmetic:{seed}:{split}:{difficulty}:{max_operand}:{index}")
    question, answer, _ = make_problem(rng, difficulty, max_operand)
    if question not in avoid:
      out.append({"id": f"arith-{split}-{index}", "question": question, "answer": answer})
    index += 1
  return out


class ArithmeticTask(Task):
  """Generated arithmetic word problems; same prompt and reward as GSM8K."""

  name = "arithmetic"

  def _load(self, split: str) -> data.Rows:
    s = self.settings
    args = dict(seed=int(s["seed"]), difficulty=int(s["difficulty"]), max_operand=int(s["max_operand"]))
    test = generate("test", int(s["num_test"]), **args)
    if split == "test":
      return data.Rows(rows=test)
    avoid = frozenset(e["question"] for e in test)
    return data.Rows(rows=generate("train", int(s["num_train"]), avoid=avoid, **args))
