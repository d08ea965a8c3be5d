"""Final-answer extraction and numeric comparison on realistic and hostile completions."""

import gc
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_jax.tasks import reward as R


def ex(n):
  return {"id": "x", "question": "q", "answer": f"Some working.\n#### {n}"}


# (completion, reference number after ####, expected reward)
CASES = [
    # \boxed forms
    ("So she earned 5 * 2 = 10 dollars.\n\nThe final answer is \\boxed{10}.", "10", 1),
    ("Total = 1000 widgets. \\boxed{1,000}", "1000", 1),
    ("\\boxed{1{,}000}", "1000", 1),
    ("She pays \\boxed{\\$18}.", "18", 1),
    ("\\boxed{\\$18.00}", "18", 1),
    ("\\boxed{18 \\text{ dollars}}", "18", 1),
    ("\\boxed{\\text{18 dollars}}", "18", 1),
    ("\\boxed{12 \\text{ cm}^2}", "12", 1),
    ("\\boxed{90^\\circ}", "90", 1),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1),
    ("\\boxed{\\frac34}", "0.75", 1),
    ("\\boxed{0.75}", "0.75", 1),
    ("\\boxed{3/4}", "0.75", 1),
    ("\\boxed{1 \\frac{1}{2}}", "1.5", 1),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1),
    ("\\boxed{50\\%}", "50", 1),
    ("\\boxed{50%}", "50", 1),
    ("\\boxed{-5}", "-5", 1),
    ("\\boxed{−5}", "-5", 1),
    ("\\boxed{5}", "-5", 0),
    ("\\boxed{x = 42}", "42", 1),
    ("\\boxed{6 \\times 7 = 42}", "42", 1),
    ("First guess \\boxed{40}, but wait, recheck: \\boxed{42}", "42", 1),
    ("First guess \\boxed{42}, but wait, recheck: \\boxed{40}", "42", 0),
    ("Put the answer in \\boxed{}. ... so the answer is \\boxed{7}", "7", 1),
    ("\\boxed{7} and then an echoed \\boxed{}", "7", 1),
    ("\\boxed{\\left(42\\right)}", "42", 1),
    ("\\boxed {42}", "42", 1),
    ("$\\boxed 42$", "42", 1),
    ("\\fbox{42}", "42", 1),
    ("\\boxed{\\textbf{42}}", "42", 1),
    ("\\boxed{12 or 15}", "12", 0),  # hedging is not an answer
    ("\\boxed{Tuesday}", "2", 0),
    ("\\boxed{42", "42", 1),  # unclosed box: falls back to the last number
    ("\\boxed{\\frac{1}{0}}", "0", 0),
    ("$$\\boxed{1,234.50}$$", "1234.5", 1),
    # GSM8K's own format and "the answer is"
    ("48/2 = 24\n48 + 24 = 72\n#### 72", "72", 1),
    ("#### 72 clips", "72", 1),
    ("#### $1,200", "1200", 1),
    ("The answer is: 42.", "42", 1),
    ("The answer is 42 because 6 times 7 is 42, not 41", "42", 1),
    ("So the final answer is $18.00.", "18", 1),
    ("The final answer is 18 dollars.", "18", 1),
    ("Final Answer: 3/4", "0.75", 1),
    ("Answer: -12", "-12", 1),
    ("**Answer:** 1,000,000", "1000000", 1),
    ("The answer is:\n\n**25**", "25", 1),
    ("The answer is 5 + 3 = 8", "8", 1),
    ("The answer is 0.3333333", "0.3333333", 1),
    # last-number fallback
    ("She has 3 apples and buys 4 more, so she has 7 apples.", "7", 1),
    ("It costs $18.00 in total.", "18", 1),
    ("It takes 50% of the time, i.e. 50", "50", 1),
    ("5 - 3 = 2", "2", 1),
    ("The temperature is -7 degrees", "-7", 1),
    ("He ran 2.50 miles", "2.5", 1),
    ("The answer is 72.0", "72", 1),
    ("Total: 1,000.", "1000", 1),
    ("She ends with 7", "8", 0),
    ("0.33", "0.3333333333", 0),
    # nothing usable
    ("", "1", 0),
    ("I don't know.", "1", 0),
    ("\\boxed{}", "0", 0),
    ("}}}{{{\\boxed{{{{", "0", 0),
    ("\x00\x01\ufffd garbage \\frac{", "0", 0),
]


@pytest.mark.parametrize("completion,ref,expected", CASES)
def test_reward_cases(completion, ref, expected):
  assert R.reward(completion, ex(ref)) == expected, R.extract_answer(completion)


def test_fraction_and_decimal_are_the_same_number():
  assert R.same_number(R.extract_answer("\\boxed{\\frac{3}{4}}"), Fraction(3, 4))
  assert R.same_number(R.extract_answer("0.75"), R.extract_answer("3/4"))
  assert R.same_number(Fraction("0.3333"), Fraction(1, 3)) is False  # off by more than 1e-6
  assert R.same_number(Fraction("0.3333333"), Fraction(1, 3))
  assert not R.same_number(None, Fraction(1))
  assert not R.same_number(Fraction(999999), Fraction(1000000))  # integers compare exactly


def test_reference_answer_parsing():
  assert R.reference_answer("work\n#### 1,234") == 1234
  assert R.reference_answer("#### -3") == -3
  assert R.reference_answer("#### 0.5") == Fraction(1, 2)
  assert R.reference_answer("no marker 5") is None
  assert R.reference_answer("#### five") is None
  assert R.reference_answer(None) is None


def test_bad_examples_score_zero():
  assert R.reward("\\boxed{1}", {}) == 0.0
  assert R.reward("\\boxed{1}", None) == 0.0
  assert R.reward("\\boxed{1}", {"answer": 5}) == 0.0
  assert R.reward(None, ex(1)) == 0.0
  assert R.reward(b"\\boxed{1}", ex(1)) == 0.0
  assert R.reward(12, ex(12)) == 0.0


def test_absurdly_long_numbers_are_no_answer():
  assert R.extract_answer("\\boxed{" + "9" * 5000 + "}") is None
  assert R.reward("The answer is " + "1" * 10_000, ex(1)) == 0.0


PATHOLOGICAL = {
    "text": "word " * 200_000,
    "digits": "1" * 1_000_000,
    "commas": "1," * 500_000,
    "digit-comma-groups": "1,000" * 200_000,
    "boxes-open": "\\boxed{" * 150_000,
    "boxes-closed": "\\boxed{1}" * 110_000,
    "braces": "{" * 1_000_000,
    "fracs": "\\frac{1}{" * 110_000,
    "slashes": "1/" * 500_000,
    "minus": "-1" * 500_000,
    "dots": "1." * 500_000,
    "hashes": "####" * 250_000,
    "answer-is": "the answer is " * 75_000,
    "spaces-digits": "1 " * 500_000,
    "unicode": "\u00e9\u4e2d\U0001f600" * 300_000,
}


@pytest.mark.parametrize("kind", sorted(PATHOLOGICAL))
@pytest.mark.slow
def test_megabyte_inputs_are_fast_and_total(kind):
  # CPU seconds of this thread: the reward's own work (no regex blow-up), not the time the thread
  # waited for a core on a loaded machine (another pytest-xdist worker, another process), nor a
  # garbage collection of the worker's whole heap that happens to start inside the call (seen once
  # in CI: 1.46 s for a call that takes milliseconds).
  text = PATHOLOGICAL[kind] + " so the total is 42"
  gc.collect()
  gc.disable()
  try:
    start = time.thread_time()
    result = R.reward(text, ex(42))
    elapsed = time.thread_time() - start
    assert result in (0.0, 1.0)
    assert elapsed < 0.5, f"{kind}: {elapsed:.2f}s"
    start = time.thread_time()
    assert R.reward(PATHOLOGICAL[kind], ex(42)) in (0.0, 1.0)
    assert time.thread_time() - start < 0.5
  finally:
    gc.enable()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_any_text_gives_zero_or_one(text):
  assert R.reward(text, ex(3)) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**9, 10**9), st.sampled_from(["\\boxed{{{}}}", "#### {}", "The answer is {}.",
                                                    "so it is {} in total"]))
def test_integers_round_trip(n, template):
  text = "Reasoning with 3 and 4. " + template.format(f"{n:,}")
  assert R.reward(text, ex(n)) == 1.0
  assert R.reward(text, ex(n + 1)) == 0.0


# --- task.reward="digit_share": the toy dense reward of the throughput benchmarks ---------------


def test_digit_share_counts_digits_among_non_blank_characters():
  assert R.digit_share("12 ab", {}) == 0.5
  assert R.digit_share("  \n", {}) == 0.0
  assert R.digit_share("", {}) == 0.0
  assert R.digit_share(None, {}) == 0.0
  assert R.digit_share("٣٤", {}) == 0.0  # only ASCII digits count
  assert R.digit_share("\\boxed{7}", {"answer": "#### 7"}) == pytest.approx(1 / 9)


def test_task_reward_option_selects_a_picklable_function_and_rejects_unknown_names():
  import pickle  # pylint: disable=import-outside-toplevel

  from areal_jax.tasks import get_task  # pylint: disable=import-outside-toplevel

  e = {"id": "x", "question": "q", "answer": "#### 7"}
  task = get_task({"name": "arithmetic", "num_train": 4, "num_test": 2, "reward": "digit_share"})
  assert task.reward("7 7 x", e) == pytest.approx(2 / 3)
  assert pickle.loads(pickle.dumps(task)).reward_fn("77", e) == 1.0
  assert pickle.loads(pickle.dumps(task.reward_fn)) is R.digit_share
  assert get_task({"name": "arithmetic", "num_train": 4, "num_test": 2}).reward("x 7", e) == 1.0
  with pytest.raises(ValueError, match="task.reward='nope'"):
    get_task({"name": "arithmetic", "num_train": 4, "num_test": 2, "reward": "nope"})
