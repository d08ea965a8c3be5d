"""The judge loop: scores recorded turns from what came next, never blocking serving.

A turn's *next state* is the session's next main turn: its request carries the user's reply (or a
tool's result) to the answer (side turns are never judged and are not next states). A turn without
one is its session's last turn once the session is done (a request said ``X-Session-Done``) or
``serve.judge_timeout_s`` has passed; a last turn has no next state and is not trained, unless it
is the session's only turn: then a judge that needs no next state (the model judge) judges it
alone. Two judges:
  * ``RuleJudge`` (the arithmetic demo): the user's next message says whether the answer was right
    ("right", "correct", "yes" -> 1; "wrong", "incorrect", "not right" -> 0; anything else: no
    verdict, the turn is not trained);
  * ``ModelJudge``: a configurable prompt (``serve.judge_prompt``, with ``{question}``, ``{answer}``
    and ``{reply}``) sent to a served model; the score is parsed robustly from its reply
    (``parse_score``: "Score: 0.8", "7/10", "8 out of 10", "yes"/"no").
With ``n > 1`` candidates only the one the user continued with (its text is the next request's last
assistant message) is judged from the reply; the model judge scores every candidate.

``JudgeLoop`` runs in its own thread over the store: judged rows get ``judge_status = 'judged'``;
rows that cannot be judged (no reply within ``serve.judge_timeout_s``, no verdict in the reply, a
failed generation) get ``'unjudgeable'``. Stopping or killing it loses nothing: pending rows stay
pending in the database until a judge runs again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from areal_jax.serve.store import TurnStore

log = logging.getLogger(__name__)

_NEGATIVE = re.compile(r"\b(wrong|incorrect|not (right|correct|quite)|nope|no)\b")
_POSITIVE = re.compile(r"\b(right|correct|yes|exactly|yep|well done|good job)\b")


def rule_score(reply: str) -> float | None:
  """1.0 / 0.0 from a user's reply to an answer; None when it says neither."""
  text = reply.lower()
  if _NEGATIVE.search(text):
    return 0.0
  if _POSITIVE.search(text):
    return 1.0
  return None


_SCORE_PATTERNS = (
    re.compile(r"(-?\d+(?:\.\d+)?)\s*(?:/|out of)\s*(\d+(?:\.\d+)?)"),  # 7/10, 8 out of 10
    re.compile(r"score\s*(?:is|[:=])?\s*\**\s*(-?\d+(?:\.\d+)?)", re.I),   # Score: 0.8
    re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)(?![\w.])"),                  # a bare number
)


def parse_score(text: str, scale: float = 1.0) -> float | None:
  """A score in [0, 1] from a judge model's reply (numbers on ``[0, scale]``), None if none."""
  for i, pattern in enumerate(_SCORE_PATTERNS):
    m = pattern.search(text)
    if m is None:
      continue
    value = float(m.group(1))
    top = float(m.group(2)) if i == 0 else scale
    if top > 0 and 0 <= value <= top:
      return value / top
  words = text.lower()
  if re.search(r"\b(yes|correct|right)\b", words) and not re.search(r"\b(no|not|incorrect|wrong)\b", words):
    return 1.0
  if re.search(r"\b(no|incorrect|wrong)\b", words):
    return 0.0
  return None


def last_message(messages: list[dict], role: str) -> str | None:
  for m in reversed(messages):
    if m.get("role") == role:
      return m.get("content") or ""
  return None


class RuleJudge:
  """Scores a turn from the user's next message."""

  needs_next = True

  def __call__(self, turn: dict, next_turn: dict) -> float | None:
    reply = last_message(next_turn["messages"], "user")
    return None if reply is None else rule_score(reply)


class ModelJudge:
  """Asks a model (``complete(messages) -> text``) to score a turn, with or without a next state."""

  needs_next = False

  def __init__(self, complete: Callable[[list[dict]], str], prompt: str, scale: float = 10.0):
    self.complete, self.prompt, self.scale = complete, prompt, scale

  def __call__(self, turn: dict, next_turn: dict | None) -> float | None:
    reply = "" if next_turn is None else (last_message(next_turn["messages"], "user") or "")
    text = self.prompt.format(question=last_message(turn["messages"], "user") or "",
                              answer=turn["completion_text"], reply=reply)
    return parse_score(self.complete([{"role": "user", "content": text}]), self.scale)


def _continued_with(turn: dict, next_turn: dict) -> bool:
  """Whether the next request continues from this candidate: always for a lone candidate; among
  ``n > 1``, the one whose text is the next request's last assistant message."""
  if not turn["_siblings"]:
    return True
  said = last_message(next_turn["messages"], "assistant")
  return said is not None and said.strip() == turn["completion_text"].strip()


class JudgeLoop:
  """Judges pending turns every ``interval_s`` in a thread; ``stop()`` / ``start()`` any time."""

  def __init__(self, store: TurnStore, judge, interval_s: float = 0.5, timeout_s: float = 300.0):
    self.store, self.judge, self.interval_s, self.timeout_s = store, judge, interval_s, timeout_s
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.stats = dict(judged=0, unjudgeable=0, errors=0)
    self.error: str | None = None

  @property
  def alive(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def start(self) -> None:
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, name="serve-judge", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        if not self.run_once():
          self._stop.wait(self.interval_s)
    except Exception as e:  # pylint: disable=broad-except  (the loop dies; serving does not)
      log.exception("judge loop failed")
      self.error = f"{type(e).__name__}: {e}"
    finally:
      self.store.close()

  def run_once(self, now: float | None = None) -> int:
    """Judges what it can among the pending rows; returns how many got a status."""
    now = time.time() if now is None else now
    pending = self.store.pending_judgement()
    siblings = {}
    for t in pending:
      siblings[t["request_id"]] = siblings.get(t["request_id"], 0) + 1
    results = []
    for turn in pending:
      if self._stop.is_set():
        break
      turn["_siblings"] = siblings[turn["request_id"]] > 1 or turn["candidate"] > 0
      if not turn["completion_tokens"] or turn["finish_reason"] in ("error", "abort"):
        results.append((turn["id"], "unjudgeable", None))
        continue
      nxt = self.store.next_turn(turn["session_id"], turn["turn_index"], turn["key_id"])
      if nxt is None:  # the session's last turn so far
        session = self.store.session_state(turn["session_id"], turn["key_id"])
        if not session["done"] and now - turn["created_s"] <= self.timeout_s:
          continue  # its next state may still come
        if self.judge.needs_next or session["main_turns"] > 1:
          results.append((turn["id"], "unjudgeable", None))
          continue
      elif self.judge.needs_next and not _continued_with(turn, nxt):
        results.append((turn["id"], "unjudgeable", None))
        continue
      try:
        score = self.judge(turn, nxt)
      except Exception as e:  # pylint: disable=broad-except  (a judge model's outage: retry later)
        self.stats["errors"] += 1
        log.warning("judging turn %s failed: %s", turn["id"], e)
        continue
      results.append((turn["id"], "unjudgeable" if score is None else "judged", score))
    self.store.set_judgements(results)
    for _, status, _ in results:
      self.stats[status] += 1
    return len(results)
