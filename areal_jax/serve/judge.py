"""The judge loop: scores recorded turns from what came next, never blocking serving.

A turn's *next state* is the session's next main turn: its request carries the user's reply (or a
tool's result) to the answer (side turns are never judged and are not next states). A turn without
one is its session's last turn once the session is done (a request said ``X-Session-Done``) or
``serve.judge_timeout_s`` has passed; a last turn has no next state and is not trained, unless it
is the session's only turn: then a judge that needs no next state (model, votes) judges it
alone. Three judges:
  * ``RuleJudge`` (the arithmetic demo): the user's next message says whether the answer was right
    ("right", "correct", "yes" -> 1; "wrong", "incorrect", "not right" -> 0; anything else: no
    verdict, the turn is not trained);
  * ``ModelJudge``: a configurable prompt (``serve.judge_prompt``, with ``{question}``, ``{answer}``
    and ``{reply}``) sent to a served model; the score is parsed robustly from its reply
    (``parse_score``: "Score: 0.8", "7/10", "8 out of 10", "yes"/"no");
  * ``VotesJudge`` (binary RL from next states): ``serve.judge_vote_prompt`` with the turn and its
    next state (``next_state``: every message of the next request after this turn's answer, the
    user's reply or a tool's output) is sampled ``serve.judge_votes`` times in one request (n = m);
    each reply votes through its last line (``parse_vote``: exactly ``Score: +1``, ``Score: -1`` or
    ``Score: 0``, else it abstains) and the majority (``majority``) is the turn's score, +1 or -1,
    trained as the advantage itself (no baseline). No verdict (0 wins, two values tie, or every
    vote abstains) leaves the turn unjudgeable: untrained, as a zero advantage would train nothing.
Hints (``serve.signal`` opd or combined: hindsight-guided on-policy distillation): a judge's
``assess(turn, next_turn)`` gives ``(score, hint)``, the hint being what the next state says the
answer should have done. The votes judge then asks ``serve.judge_hint_prompt`` and each vote may
carry one between ``serve.hint_start`` and ``serve.hint_end``; the rule judge takes the user's
reply when it says more than a verdict, less its opening verdict (``Hints``). Of the hints found,
the longest useful one (at least ``serve.hint_min_chars`` characters) is kept; none: the turn gives
no OPD signal. A turn without a next state has no hint, nor, with ``serve.hint_cut_off = False``,
one cut off at its token limit. A hinted turn is stored ``hinted`` with its hint and score; the
teacher (``serve/teacher.py``) then scores its response under the hinted prompt, here right after
judging (``serve.teacher_at = "judge"``) or in the trainer loop ("trainer"), and the turn is
judged: with ``signal = "opd"`` when the teacher scored it, with ``"combined"`` when it has the
teacher's logprobs or a verdict.
With ``n > 1`` candidates only the one the user continued with (its text is the next request's last
assistant message) is judged from the reply (rule and votes judges); the model judge scores every
candidate.

``JudgeLoop`` runs in its own thread over the store: judged rows get ``judge_status = 'judged'``;
rows that cannot be judged (no reply within ``serve.judge_timeout_s``, no verdict in the reply, a
failed generation) get ``'unjudgeable'``. Stopping or killing it loses nothing: pending rows stay
pending in the database until a judge runs again.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from collections.abc import Callable

from areal_jax.serve.store import TurnStore
from areal_jax.serve.teacher import TeacherStage, judgement

log = logging.getLogger(__name__)

_NEGATIVE = re.compile(r"\b(wrong|incorrect|not (right|correct|quite)|nope|no)\b")
_POSITIVE = re.compile(r"\b(right|correct|yes|exactly|yep|well done|good job)\b")


def without_verdict(text: str) -> str:
  """``text`` with the words ``rule_score`` reads as right or wrong taken out."""
  for pattern in (_NEGATIVE, _POSITIVE):
    text = re.sub(pattern.pattern, "", text, flags=re.I)
  return " ".join(text.split())


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


# Words a reply's opening verdict is made of ("no, that's wrong.", "Incorrect!", "yes, you're
# right"): the verdict words rule_score reads and the few words that carry them.
_VERDICT_WORDS = frozenset(
    "no nope yes yep right correct incorrect wrong not quite exactly well done good job that's "
    "thats that it's its it is this you're youre you are your answer oh sorry".split())


def leading_verdict(reply: str) -> str:
  """The opening clauses of ``reply`` that say only right or wrong ("no, that's wrong. "), with the
  punctuation and blanks after them; "" when the reply does not open with one."""
  end = 0
  for m in re.finditer(r"[^.,;:!?]+[.,;:!?]*\s*", reply):
    if m.start() != end:
      break
    words = re.findall(r"[\w']+", m.group(0).lower())
    if not words or any(w not in _VERDICT_WORDS for w in words) or rule_score(m.group(0)) is None:
      break
    end = m.end()
  return reply[:end]


class Hints:
  """Finds hints in text: between ``start`` and ``end`` markers (a judge's reply), or a user's
  reply (``from_reply``); a hint is cut to ``max_chars`` and useful from ``min_chars`` on.
  ``keep_verdict`` (``serve.hint_keep_verdict``): a reply's opening verdict stays in its hint;
  without it the hint is what follows the verdict, so that the teacher, which never saw the answer
  the verdict was about, reads what to do rather than a reply to an answer."""

  def __init__(self, start: str = "[HINT]", end: str = "[/HINT]", min_chars: int = 12,
               max_chars: int = 1000, keep_verdict: bool = False):
    if not start or not end:
      raise ValueError("serve.hint_start and serve.hint_end must not be empty")
    self.min_chars, self.max_chars = int(min_chars), int(max_chars)
    self.keep_verdict = bool(keep_verdict)
    self._marked = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.S)

  def _useful(self, text: str | None) -> str | None:
    text = " ".join((text or "").split())[:self.max_chars]
    return text if len(text) >= self.min_chars else None

  def parse(self, text: str) -> str | None:
    """The longest useful hint marked in a judge's reply, None if none."""
    return self.longest(self._marked.findall(text or ""))

  def longest(self, hints: list[str | None]) -> str | None:
    """The longest useful hint of ``hints`` (the votes'), None if none is useful."""
    useful = [h for h in (self._useful(h) for h in hints) if h is not None]
    return max(useful, key=len, default=None)

  def from_reply(self, reply: str) -> str | None:
    """A user's reply as a hint when it says more than a verdict: at least ``min_chars``
    characters (words only) besides the words ``rule_score`` reads; its opening verdict left out
    unless ``keep_verdict``."""
    reply = reply or ""
    rest = _POSITIVE.sub(" ", _NEGATIVE.sub(" ", reply.lower()))
    rest = " ".join(re.sub(r"[\W_]+", " ", rest).split())
    if len(rest) < self.min_chars:
      return None
    return self._useful(reply if self.keep_verdict else reply[len(leading_verdict(reply)):])


class RuleJudge:
  """Scores a turn from the user's next message (and, with ``hints``, takes the message as the
  turn's hint when it says more than right or wrong)."""

  needs_next = True  # a turn without a next state is not judged
  reads_next = True  # only the candidate the next request continued from is judged

  def __init__(self, hints: Hints | None = None):
    self.hints = hints

  def __call__(self, turn: dict, next_turn: dict) -> float | None:
    return self.assess(turn, next_turn)[0]

  def assess(self, turn: dict, next_turn: dict) -> tuple[float | None, str | None]:
    del turn
    reply = last_message(next_turn["messages"], "user")
    if reply is None:
      return None, None
    return rule_score(reply), (self.hints.from_reply(reply) if self.hints is not None else None)


class ModelJudge:
  """Asks a model (``complete(messages) -> text``) to score a turn, with or without a next state."""

  needs_next = reads_next = False

  def __init__(self, complete: Callable[[list[dict]], str], prompt: str, scale: float = 10.0):
    self.complete, self.prompt, self.scale = complete, prompt, scale

  def __call__(self, turn: dict, next_turn: dict | None) -> float | None:
    reply = "" if next_turn is None else (last_message(next_turn["messages"], "user") or "")
    text = self.prompt.format(question=last_message(turn["messages"], "user") or "",
                              answer=turn["completion_text"], reply=reply)
    return parse_score(self.complete([{"role": "user", "content": text}]), self.scale)


_VOTE = re.compile(r"score:\s*(\+1|1|-1|0)\.?", re.I)


def parse_vote(text: str) -> int | None:
  """+1 / -1 / 0 from a judge's reply whose last non-empty line is exactly ``Score: +1``,
  ``Score: -1`` or ``Score: 0`` ("score" in any case, ``1`` for ``+1``, one final period allowed);
  None (an abstention) for anything else, so that a rambling or cut-off reply casts no vote."""
  lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
  m = _VOTE.fullmatch(lines[-1]) if lines else None
  return None if m is None else int(m.group(1))


def majority(votes: list[int | None]) -> int:
  """The verdict of votes +1 / -1 / 0 (None: abstained): the value cast most often; 0 when there is
  no verdict (two values tie for most, or every vote abstained)."""
  counts = collections.Counter(v for v in votes if v is not None)
  ranked = counts.most_common(2)
  if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
    return 0
  return ranked[0][0]


def next_state(turn: dict, next_turn: dict | None) -> str:
  """What came after the turn's answer, as ``role: content`` lines: the messages of the next
  request after its last assistant message (the user's reply, a tool's or environment's output);
  the next request's last message when it carries no assistant message."""
  if next_turn is None:
    return "(nothing: the conversation ended)"
  messages = next_turn["messages"]
  said = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
  after = messages[said[-1] + 1:] if said else messages[-1:]
  return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in after)


class VotesJudge:
  """A PRM-style judge: ``complete(messages, n) -> list of n texts`` samples ``votes`` judge replies
  to the turn and its next state; their majority is the score (+1 / -1), None without a verdict."""

  needs_next = False  # a session's only turn is judged alone
  reads_next = True

  def __init__(self, complete: Callable[[list[dict], int], list[str]], prompt: str, votes: int,
               hints: Hints | None = None):
    """``hints``: also find hints in the votes (``prompt`` should then ask for them)."""
    if votes < 1:
      raise ValueError(f"serve.judge_votes must be at least 1, got {votes!r}")
    self.complete, self.prompt, self.votes, self.hints = complete, prompt, int(votes), hints
    self.stats = collections.Counter()  # votes cast (+1 / -1 / 0), abstained, verdicts, hints

  def __call__(self, turn: dict, next_turn: dict | None) -> float | None:
    return self.assess(turn, next_turn)[0]

  def assess(self, turn: dict, next_turn: dict | None) -> tuple[float | None, str | None]:
    """The majority's score (None without a verdict) and the longest useful hint of the votes
    (None without ``hints``, without a next state, or when no vote has a useful one)."""
    text = self.prompt.format(question=last_message(turn["messages"], "user") or "",
                              answer=turn["completion_text"], reply=next_state(turn, next_turn))
    replies = self.complete([{"role": "user", "content": text}], self.votes)[:self.votes]
    votes = [parse_vote(r) for r in replies] + [None] * (self.votes - len(replies))
    for v in votes:
      self.stats["abstained" if v is None else f"vote{v:+d}"] += 1
    verdict = majority(votes)
    self.stats[f"verdict{verdict:+d}"] += 1
    hint = None
    if self.hints is not None and next_turn is not None:
      hint = self.hints.longest([self.hints.parse(r) for r in replies])
      self.stats["hints" if hint else "no_hint"] += 1
    return (None if verdict == 0 else float(verdict)), hint


def openai_sampler(base_url: str, model: str, temperature: float, max_tokens: int,
                   timeout_s: float = 120.0) -> Callable[[list[dict], int], list[str]]:
  """``sample(messages, n) -> n texts`` from an OpenAI-compatible server: one request with ``n``;
  a backend that returns fewer choices (it ignores ``n``) is asked again for the rest."""
  import openai  # pylint: disable=import-outside-toplevel

  client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"),
                         timeout=timeout_s, max_retries=0)

  def sample(messages: list[dict], n: int) -> list[str]:
    texts: list[str] = []
    while len(texts) < n:
      out = client.chat.completions.create(model=model, messages=messages, n=n - len(texts),
                                           temperature=temperature, max_tokens=max_tokens)
      if not out.choices:
        break
      texts += [c.message.content or "" for c in out.choices]
    return texts[:n]
  return sample


def _continued_with(turn: dict, next_turn: dict) -> bool:
  """Whether the next request continues from this candidate: always for a lone candidate; among
  ``n > 1``, the one whose text is the next request's last assistant message."""
  if not turn["_siblings"]:
    return True
  said = last_message(next_turn["messages"], "assistant")
  return said is not None and said.strip() == turn["completion_text"].strip()


class JudgeLoop:
  """Judges pending turns every ``interval_s`` in a thread; ``stop()`` / ``start()`` any time."""

  def __init__(self, store: TurnStore, judge, interval_s: float = 0.5, timeout_s: float = 300.0,
               signal: str = "binary", teacher=None, hint_cut_off: bool = True, ahead=None):
    """``signal``: "binary" (the score only), "opd" or "combined" (hints); ``teacher``: a
    ``serve/teacher.py`` scorer that scores the hinted turns after each pass, or None when another
    loop does (``serve.teacher_at``); ``hint_cut_off`` (``serve.hint_cut_off``): False drops the
    hint of a turn cut off at its token limit, which then trains on its score alone (combined) or
    not at all (opd): the teacher scores a prefix the user never saw finished, and can favour text
    that does not fit the limit; ``ahead``: which hinted turns the teacher scores
    (``TeacherStage``)."""
    if signal not in ("binary", "opd", "combined"):
      raise ValueError(f"serve.signal={signal!r} is not one of binary, opd, combined")
    if signal != "binary" and not hasattr(judge, "assess"):
      raise ValueError(f"serve.signal={signal!r} needs a judge that finds hints (rule, votes)")
    self.store, self.judge, self.interval_s, self.timeout_s = store, judge, interval_s, timeout_s
    self.signal, self.hint_cut_off = signal, bool(hint_cut_off)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.stats = dict(judged=0, unjudgeable=0, errors=0)
    if signal != "binary":  # turns stored with a hint, for the teacher
      self.stats["hinted"] = 0
    self.teaching = None if signal == "binary" or teacher is None else \
        TeacherStage(teacher, signal, self.stats, ahead=ahead)
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
        results.append(self._result(turn["id"], None))
        continue
      nxt = self.store.next_turn(turn["session_id"], turn["turn_index"], turn["key_id"])
      if nxt is None:  # the session's last turn so far
        session = self.store.session_state(turn["session_id"], turn["key_id"])
        if not session["done"] and now - turn["created_s"] <= self.timeout_s:
          continue  # its next state may still come
        if self.judge.needs_next or session["main_turns"] > 1:
          results.append(self._result(turn["id"], None))
          continue
      elif self.judge.reads_next and not _continued_with(turn, nxt):
        results.append(self._result(turn["id"], None))
        continue
      try:
        score, hint = self.judge.assess(turn, nxt) if self.signal != "binary" else \
            (self.judge(turn, nxt), None)
      except Exception as e:  # pylint: disable=broad-except  (a judge model's outage: retry later)
        self.stats["errors"] += 1
        log.warning("judging turn %s failed: %s", turn["id"], e)
        continue
      if not self.hint_cut_off and turn["finish_reason"] == "length":
        hint = None
      results.append((turn["id"], "hinted", score, hint, None) if hint is not None
                     else self._result(turn["id"], score))
    self.store.set_judgements(results)
    for r in results:
      self.stats[r[1]] += 1
    if self.teaching is not None and not self._stop.is_set():
      self.teaching.run_once(self.store)
    return len(results)

  def _result(self, turn_id: int, score) -> tuple:
    """The row's judgement: judged when it has the signal ``serve.signal`` trains with."""
    return judgement(self.signal, turn_id, score)
