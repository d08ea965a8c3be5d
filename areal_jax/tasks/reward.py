"""Final-answer extraction and numeric comparison for GSM8K-style rewards.

The final answer of a completion is looked for in this order:

1. the last non-empty ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched so ``\\frac{3}{4}`` inside
   works; its content must hold exactly one number (after the last ``=``), otherwise no answer;
2. the line after the last ``####`` (the GSM8K reference format);
3. the first number after the last "the answer is" / "final answer:" / "answer:";
4. the last number in the completion.

Numbers may carry thousands commas (``1,000``, LaTeX ``1{,}000``), ``$`` / ``\\$``, a ``%``, units
(``18 dollars``, ``\\text{ cm}^2``), trailing zeros (``18.00``), a sign (``-5``, ``\\u22125``), and may be
fractions (``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``, mixed ``1 1/2``). Values are compared exactly as
fractions, with a relative tolerance of 1e-6 when one is not an integer (rounded decimals).

:func:`reward` is total: any input (garbage, a megabyte of text, a non-string) gives 0.0 or 1.0 and
never raises. Every step is linear in the input: ``rfind`` from the end, bounded brace scans, and
regular expressions without nested unbounded repetition; numbers longer than
:data:`MAX_DIGITS` digits are rejected.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_DIGITS = 40  # a longer digit string is not an answer (and int() of huge strings is slow)
MAX_BOXED_CHARS = 1000  # the longest \boxed{} content that is scanned
MAX_BOXED_TRIES = 8  # how many \boxed occurrences are tried from the end
SEGMENT_CHARS = 300  # how much text after "####" / "the answer is" is parsed
TAIL_CHARS = 8000  # the "last number" fallback looks only at the end of the completion
REL_TOL = Fraction(1, 10**6)

_NUM = r"(?:\d+(?:,\d{3}(?!\d))*(?:\.\d+)?|\.\d+)"
_FRAC_ARG = r"[-−]?\d+(?:\.\d+)?"
# One numeric value. Alternatives go from the longest form to the shortest.
_VALUE_RE = re.compile(
    r"(?P<neg>(?<![\w)\]}])[-−])?(?<![\w.])(?:"
    rf"(?P<mi>\d+)\s*\\frac\{{(?P<mn>\d+)\}}\{{(?P<md>\d+)\}}"  # 1 \frac{1}{2}
    rf"|\\frac\{{(?P<fn>{_FRAC_ARG})\}}\{{(?P<fd>{_FRAC_ARG})\}}"  # \frac{3}{4}
    r"|\\frac(?P<sn>\d)(?P<sd>\d)"  # \frac34
    r"|(?P<ai>\d+)[ \t]+(?P<an>\d+)/(?P<ad>\d+)(?![\d/])"  # 1 1/2
    rf"|(?P<p>{_NUM})[ \t]*/[ \t]*(?P<q>{_NUM})(?![\d/])"  # 3/4
    rf"|(?P<n>{_NUM})"
    r")")

_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]{0,200})\}")
_UNIT_POWER_RE = re.compile(r"(?<=[A-Za-z}])\s*\^\s*\{?\s*[23]\s*\}?")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_ANSWER_PHRASES = ("final answer is", "final answer:", "the answer is", "answer is", "answer:")


def _digits_ok(s: str) -> bool:
  return sum(c.isdigit() for c in s) <= MAX_DIGITS


def _num(s: str) -> Fraction:
  return Fraction(s.replace(",", "").replace("−", "-"))


def _match_value(m: re.Match) -> Fraction | None:
  """The value of one ``_VALUE_RE`` match, or None (too long, zero denominator)."""
  if not _digits_ok(m.group(0)):
    return None
  g = m.groupdict()
  if g["mi"] is not None:
    den = int(g["md"])
    v = int(g["mi"]) + Fraction(int(g["mn"]), den) if den else None
  elif g["fn"] is not None:
    den = _num(g["fd"])
    v = _num(g["fn"]) / den if den else None
  elif g["sn"] is not None:
    den = int(g["sd"])
    v = Fraction(int(g["sn"]), den) if den else None
  elif g["ai"] is not None:
    den = int(g["ad"])
    v = int(g["ai"]) + Fraction(int(g["an"]), den) if den else None
  elif g["p"] is not None:
    den = _num(g["q"])
    v = _num(g["p"]) / den if den else None
  else:
    v = _num(g["n"])
  if v is not None and g["neg"]:
    v = -v
  return v


def normalize(s: str) -> str:
  """Removes LaTeX and currency decoration that hides a number; keeps the numbers themselves."""
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = s.replace("{,}", ",").replace("\\left", "").replace("\\right", "")
  s = _DEGREE_RE.sub("", s)
  s = _TEXT_CMD_RE.sub(r" \1 ", s)
  s = _UNIT_POWER_RE.sub("", s)
  for token in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\u00a0"):
    s = s.replace(token, " ")
  return s


def values(s: str) -> list[Fraction]:
  """Every numeric value in ``s`` (after :func:`normalize`), in order; unusable ones are dropped."""
  out = []
  for m in _VALUE_RE.finditer(normalize(s)):
    v = _match_value(m)
    if v is not None:
      out.append(v)
  return out


def _boxed_contents(text: str):
  """Yields the contents of ``\\boxed{..}`` / ``\\fbox{..}`` from the last one backwards (bounded)."""
  end = len(text)
  for _ in range(MAX_BOXED_TRIES):
    i = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
    if i < 0:
      return
    end = i
    j = i + (6 if text.startswith("\\boxed", i) else 5)
    while j < len(text) and j - i < 16 and text[j] == " ":
      j += 1
    if j < len(text) and text[j] == "{":
      depth, k, stop = 0, j, min(len(text), j + MAX_BOXED_CHARS + 2)
      while k < stop:
        c = text[k]
        if c == "{":
          depth += 1
        elif c == "}":
          depth -= 1
          if depth == 0:
            break
        k += 1
      if k < stop:  # closed
        yield text[j + 1:k]
    else:  # "\boxed 42": the next token
      m = re.match(r"\S{1,64}", text[j:j + 64])
      if m:
        yield m.group(0).rstrip("$.")


def _first_value_after(segment: str) -> Fraction | None:
  segment = segment.lstrip(" \t:*\n")  # "The answer is:\n\n**42**"
  newline = segment.find("\n")
  if newline >= 0:
    segment = segment[:newline]
  eq = segment.rfind("=")
  if eq >= 0:
    segment = segment[eq + 1:]
  found = values(segment)
  return found[0] if found else None


def extract_answer(text: str) -> Fraction | None:
  """The final answer of a completion as an exact fraction, or None; see the module docstring."""
  if not isinstance(text, str) or not text:
    return None
  for content in _boxed_contents(text):
    if not content.strip():
      continue  # an echoed "put your answer in \boxed{}"
    eq = content.rfind("=")
    found = values(content[eq + 1:] if eq >= 0 else content)
    return found[0] if len(found) == 1 else None
  i = text.rfind("####")
  if i >= 0:
    v = _first_value_after(text[i + 4:i + 4 + SEGMENT_CHARS])
    if v is not None:
      return v
  tail = text[-(TAIL_CHARS * 4):].lower()
  at = max(((tail.rfind(p), p) for p in _ANSWER_PHRASES), key=lambda t: t[0])
  if at[0] >= 0:
    start = at[0] + len(at[1])
    v = _first_value_after(tail[start:start + SEGMENT_CHARS])
    if v is not None:
      return v
  tail = text[-TAIL_CHARS:]
  if len(text) > TAIL_CHARS:  # do not start inside a number that was cut
    cut = re.search(r"\s", tail)
    tail = tail[cut.end():] if cut else ""
  found = values(tail)
  return found[-1] if found else None


def reference_answer(answer: str) -> Fraction | None:
  """The number after the last ``####`` of a GSM8K-format reference answer, or None."""
  if not isinstance(answer, str):
    return None
  i = answer.rfind("####")
  if i < 0:
    return None
  return _first_value_after(answer[i + 4:i + 4 + SEGMENT_CHARS])


def same_number(a: Fraction | None, b: Fraction | None) -> bool:
  """Exact equality; a non-integer may also be within a relative 1e-6 (0.3333333 matches 1/3).

  Two integers must be equal (999999 is not 1000000).
  """
  if a is None or b is None:
    return False
  if a == b:
    return True
  if a.denominator == 1 and b.denominator == 1:
    return False
  return abs(a - b) <= REL_TOL * max(1, abs(b))


def score(completion: str, reference: str) -> float:
  """1.0 if the completion's final answer equals the number after ``####`` in ``reference``."""
  try:
    return 1.0 if same_number(extract_answer(completion), reference_answer(reference)) else 0.0
  except Exception:  # pylint: disable=broad-except  # a reward never crashes the run
    return 0.0


def reward(completion: str, example: dict) -> float:
  """The task reward: :func:`score` against ``example["answer"]``. Total: never raises."""
  try:
    return score(completion, example["answer"])
  except Exception:  # pylint: disable=broad-except
    return 0.0


def digit_share(completion: str, example: dict) -> float:
  """A dense toy reward: the share of the completion's non-blank characters that are ASCII digits.

  Not a task metric. It exists so that benchmarks on a randomly initialised model (which never
  answers a problem) still show a learning curve: such a model learns to emit digits within a few
  steps. Total: anything that is not a string, or has no non-blank character, scores 0.0.
  """
  del example
  if not isinstance(completion, str):
    return 0.0
  chars = [ch for ch in completion if not ch.isspace()]
  return sum("0" <= ch <= "9" for ch in chars) / len(chars) if chars else 0.0


REWARDS = {"answer": reward, "digit_share": digit_share}  # ``task.reward`` -> function
