r"""Simulated users: ask arithmetic questions through the official ``openai`` client, say whether
the answer was right or how to work it out, as a person would.

  python -m areal_jax.serve.simulated_user --config=configs/serve_arithmetic.py \
      --base_url=http://127.0.0.1:8000/v1 --duration_s=600

Each conversation is one session (its id in the ``X-Session-Id`` header and the ``user`` field):
the user asks a question drawn from the task's *train* split (the held-out test split is never
sent) in the task's prompt format, checks the answer with the task's reward (an answer cut off at
its token limit is wrong, whatever number it stops on: ``serve.sim_cut_off_wrong``), and replies in
the same session (a short turn, ``serve.sim_feedback_tokens``); that reply is the next state the
judge scores the answer from, and it ends the session (``X-Session-Done``: the reply turn is the
last, never trained). ``serve.sim_users`` conversations run at once. What the user replies
(``serve.sim_feedback``):
  * ``verdict``: "right" or "that's wrong";
  * ``words``: how to work the problem out, from the example's worked answer ("Ava has 7 apples.
    3 times as many: 7 * 3 = 21. So the answer is 21."), whether the answer was right or not, and
    never a word a verdict judge reads as right or wrong: only hindsight OPD can use it (the reply
    is the hint);
  * ``both``: "right" when right; when wrong, "that's wrong" and then the way to work it out.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import uuid

from absl import app, flags
from ml_collections import config_flags

from areal_jax import tasks
from areal_jax.serve import judge as judge_lib

POSITIVE = ("right", "correct, thanks", "yes, that's right")
NEGATIVE = ("that's wrong", "no, that's wrong", "incorrect")


def teaching_reply(example: dict) -> str:
  """How to work ``example`` out, in words from its worked answer (one line per step, ending in
  ``#### N``), with no word a verdict judge reads as right or wrong."""
  lines = [line.strip() for line in example["answer"].splitlines() if line.strip()]
  steps = [line for line in lines if not line.startswith("####")]
  final = [line[4:].strip() for line in lines if line.startswith("####")]
  text = " ".join(steps) + (f" So the answer is {final[-1]}." if final else "")
  return judge_lib.without_verdict(text)


def answered_right(task, example: dict, text: str, cut_off: bool, cut_off_wrong: bool) -> bool:
  """Whether the user calls the answer right: the task's reward, except that a reply ``cut_off`` at
  its token limit (finish reason "length") is wrong with ``cut_off_wrong``. A person reads such a
  reply as unfinished; the task's reward takes its last number, which may be an intermediate step
  that equals the answer by chance, and rewarding that can teach the policy to ramble into the
  limit."""
  if cut_off_wrong and cut_off:
    return False
  return task.reward(text, example) > 0.5


def reply_for(example: dict, right: bool, feedback: str, rng: random.Random) -> str:
  """The user's reply to an answer (``serve.sim_feedback``: verdict, words or both)."""
  if feedback == "words":
    return teaching_reply(example)
  verdict = rng.choice(POSITIVE if right else NEGATIVE)
  if feedback == "both" and not right:
    return f"{verdict}. {teaching_reply(example)}"
  return verdict


class SimulatedUsers:
  """``run(duration_s)``: ``config.serve.sim_users`` threads holding conversations until then."""

  def __init__(self, config, base_url: str, log_path: str = "", seed: int = 1):
    import openai  # pylint: disable=import-outside-toplevel

    self.config, self.base_url = config, base_url
    self.task = tasks.get_task(config.task)
    self.examples = self.task.examples("train")
    self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=2, timeout=600)
    self.rng = random.Random(seed)
    self._lock = threading.Lock()
    self._log = open(log_path, "a", encoding="utf-8") if log_path else None
    self.results: list[dict] = []
    self.errors = 0

  def converse(self) -> dict:
    with self._lock:
      example = self.rng.choice(self.examples)
    session = f"sim-{uuid.uuid4().hex[:12]}"
    messages = self.task.prompt_messages(example)
    model = self.config.serve.model_name
    t0 = time.time()
    answer = self.client.chat.completions.create(
        model=model, messages=messages, user=session, extra_headers={"X-Session-Id": session})
    answer_s = time.time() - t0  # the question's request, sent -> response parsed
    text = answer.choices[0].message.content or ""
    cut_off = answer.choices[0].finish_reason == "length"
    right = answered_right(self.task, example, text, cut_off, self.config.serve.sim_cut_off_wrong)
    with self._lock:
      reply = reply_for(example, right, self.config.serve.sim_feedback, self.rng)
    self.client.chat.completions.create(
        model=model, user=session, extra_headers={"X-Session-Id": session, "X-Session-Done": "true"},
        messages=messages + [{"role": "assistant", "content": text}, {"role": "user", "content": reply}],
        max_tokens=self.config.serve.sim_feedback_tokens)
    out = dict(time_s=time.time(), session=session, example_id=example.get("id"), right=right,
               cut_off=cut_off, latency_s=time.time() - t0, answer_s=answer_s,
               version=getattr(answer, "policy_versions", None))
    with self._lock:
      self.results.append(out)
      if self._log is not None:
        self._log.write(json.dumps(out) + "\n")
        self._log.flush()
    return out

  def finished(self) -> list[dict]:
    """The conversations so far (a copy, in the order they ended)."""
    with self._lock:
      return list(self.results)

  def _worker(self, deadline: float) -> None:
    while time.time() < deadline:
      try:
        self.converse()
      except Exception as e:  # pylint: disable=broad-except  (a failed request: count, go on)
        with self._lock:
          self.errors += 1
        print(f"simulated user: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        time.sleep(1.0)

  def run(self, duration_s: float) -> list[dict]:
    deadline = time.time() + duration_s
    threads = [threading.Thread(target=self._worker, args=(deadline,), daemon=True)
               for _ in range(self.config.serve.sim_users)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    if self._log is not None:
      self._log.close()
    return self.results


def _define_flags():  # only when run as a program (the demo imports this module beside its own flags)
  config_flags.DEFINE_config_file("config", None, "Serving config file.")
  flags.DEFINE_string("base_url", "http://127.0.0.1:8000/v1", "The server's /v1 URL.")
  flags.DEFINE_float("duration_s", None, "Seconds to run (default serve.sim_duration_s).")
  flags.DEFINE_string("log", "", "Append one JSON line per conversation here.")
  flags.mark_flags_as_required(["config"])


def main(argv) -> None:
  del argv
  from areal_jax import cli  # pylint: disable=import-outside-toplevel

  cli.set_up_logging()  # no line per HTTP request
  f = flags.FLAGS
  config = f.config
  users = SimulatedUsers(config, f.base_url, f.log)
  results = users.run(f.duration_s or config.serve.sim_duration_s)
  right = sum(r["right"] for r in results)
  print(f"{len(results)} conversations, {right} answered right, {users.errors} failed requests",
        flush=True)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
