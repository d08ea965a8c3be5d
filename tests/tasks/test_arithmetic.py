"""The synthetic arithmetic task: determinism, correct answers, and the difficulty knobs."""

import re

import pytest

from areal_jax.tasks import arithmetic, get_task
from areal_jax.tasks import reward as R


def task(**kw):
  return get_task({"name": "arithmetic", "num_train": 300, "num_test": 50, **kw})


def simulate(question):
  """Computes the answer from the question text alone (independently of the generator)."""
  sentences = re.split(r"(?<=[.?])\s+", question)
  value = int(re.search(r" has (\d+) ", sentences[0]).group(1))
  ops = 0
  for s in sentences[1:-1]:
    ops += 1
    if m := (re.search(r"gives [A-Z]\w+ (\d+) ", s) or re.search(r"(?:buys|finds) (\d+) more", s)):
      value += int(m.group(1))
    elif m := re.search(r"(?:gives|loses|sells) (\d+)", s):
      assert int(m.group(1)) <= value, s
      value -= int(m.group(1))
    elif m := re.search(r"(\d+) times as many", s):
      value *= int(m.group(1))
    elif m := re.search(r"among (\d+) people", s):
      assert value % int(m.group(1)) == 0, s
      value //= int(m.group(1))
    else:
      raise AssertionError(f"unparsed sentence {s!r}")
  assert sentences[-1].startswith("How many")
  return value, ops


def test_deterministic_and_seeded():
  a, b = task(), task()
  assert a.examples("train") == b.examples("train")
  assert a.test_examples() == b.test_examples()
  other = task(seed=1)
  assert [e["question"] for e in other.examples("train")] != [e["question"] for e in a.examples("train")]


def test_example_i_does_not_depend_on_split_size():
  small = get_task({"name": "arithmetic", "num_train": 40, "num_test": 50})
  assert small.examples("train") == task().examples("train")[:40]


@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_answers_are_correct(difficulty):
  t = task(difficulty=difficulty, max_operand=15)
  for e in t.examples("train") + t.test_examples():
    expected, ops = simulate(e["question"])
    assert ops == difficulty
    assert R.reference_answer(e["answer"]) == expected
    assert e["answer"].splitlines()[-1] == f"#### {expected}"
    for line in e["answer"].splitlines()[1:-1]:  # every worked step is right
      a, op, b, c = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)\.$", line).groups()
      assert eval(f"{a} {op.replace('/', '//')} {b}") == int(c), line  # pylint: disable=eval-used
    assert t.reward(f"So the answer is \\boxed{{{expected}}}.", e) == 1.0
    assert t.reward(f"\\boxed{{{expected + 1}}}", e) == 0.0


def test_operands_respect_max_operand():
  for max_operand in (2, 5, 30):
    for e in task(difficulty=3, max_operand=max_operand).examples("train"):
      for line in e["answer"].splitlines()[1:-1]:
        a, op, b = re.search(r"(\d+) ([-+*/]) (\d+) =", line).groups()
        limit = min(max_operand, arithmetic.MAX_FACTOR) if op in "*/" else max_operand
        assert 1 <= int(b) <= limit, (line, max_operand)
      start = int(re.search(r"starts with (\d+)", e["answer"]).group(1))
      assert 1 <= start <= max_operand


def test_difficulty_makes_problems_longer():
  lengths = [sum(len(e["answer"].splitlines()) for e in task(difficulty=d).test_examples())
             for d in (1, 2, 3)]
  assert lengths == [50 * (d + 2) for d in (1, 2, 3)]


def test_test_questions_never_appear_in_train():
  t = task(max_operand=3)  # a small space, so collisions would happen
  assert not {e["question"] for e in t.test_examples()} & {e["question"] for e in t.examples("train")}
  assert len(t.examples("train")) == 300


def test_ids_are_unique_and_examples_well_formed():
  t = task()
  for split in ("train", "test"):
    rows = t.examples(split)
    assert len({e["id"] for e in rows}) == len(rows)
    assert all(set(e) == {"id", "question", "answer"} for e in rows)


@pytest.mark.parametrize("bad,match", [({"difficulty": 0}, "difficulty"), ({"max_operand": 1}, "max_operand"),
                                       ({"num_test": 0}, "num_test")])
def test_invalid_knobs(bad, match):
  with pytest.raises(ValueError, match=match):
    task(**bad).examples("train")
