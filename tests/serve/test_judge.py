"""Judges: user replies and model replies parsed to scores; the judge loop's statuses."""

import pytest

from areal_jax.serve import judge as judge_lib
from areal_jax.serve.store import TurnStore


@pytest.mark.parametrize("reply,score", [
    ("right", 1.0), ("Correct, thanks!", 1.0), ("yes, that's right", 1.0),
    ("that's wrong", 0.0), ("No, that's not right.", 0.0), ("incorrect", 0.0),
    ("what about 7 + 3?", None), ("", None)])
def test_rule_score(reply, score):
  assert judge_lib.rule_score(reply) == score


@pytest.mark.parametrize("text,score", [
    ("8", 0.8), ("Score: 7", 0.7), ("**Score**: 10/10", 1.0), ("I'd give it 3 out of 10.", 0.3),
    ("score=0", 0.0), ("Yes, correct.", 1.0), ("No.", 0.0), ("it depends", None), ("42", None)])
def test_parse_score(text, score):
  got = judge_lib.parse_score(text, scale=10.0)
  assert got == pytest.approx(score) if score is not None else got is None


def _turn(store, session, text, messages, candidate_texts=None, created_s=None):
  rows = []
  for i, t in enumerate(candidate_texts or [text]):
    rows.append(dict(request_id=f"{session}-{len(store.session(session))}", candidate=i,
                     messages=messages, prompt_tokens=[1], completion_tokens=[2, 3],
                     logprobs=[-1.0, -1.0], versions=[0, 0], completion_text=t,
                     finish_reason="eos", temperature=1.0, created_s=created_s or 1000.0))
  return store.add_turns(session, rows)[0]


def test_judge_loop_scores_from_the_next_turn(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  q = [{"role": "user", "content": "2+2?"}]
  (a,) = _turn(store, "s1", "4", q)
  (b,) = _turn(store, "s1", "ok", q + [{"role": "assistant", "content": "4"},
                                       {"role": "user", "content": "right"}])
  (c,) = _turn(store, "s2", "5", q)
  (d,) = _turn(store, "s2", "sorry", q + [{"role": "assistant", "content": "5"},
                                          {"role": "user", "content": "that's wrong"}])
  (e,) = _turn(store, "s3", "4", q, created_s=1100.0)  # no reply yet, still waiting
  loop = judge_lib.JudgeLoop(store, judge_lib.RuleJudge(), timeout_s=60.0)
  loop.run_once(now=1120.0)
  assert (store.get(a)["score"], store.get(c)["score"]) == (1.0, 0.0)
  # the last turns of s1/s2 got no reply within the timeout; s3's answer still may
  assert store.get(b)["judge_status"] == store.get(d)["judge_status"] == "unjudgeable"
  assert store.get(e)["judge_status"] == "pending"
  loop.run_once(now=1200.0)
  assert store.get(e)["judge_status"] == "unjudgeable"


def test_only_the_continued_candidate_is_judged_by_the_user(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  q = [{"role": "user", "content": "2+2?"}]
  first, second = _turn(store, "s", None, q, candidate_texts=["4", "5"])
  _turn(store, "s", "thanks", q + [{"role": "assistant", "content": "5"},
                                   {"role": "user", "content": "that's wrong"}])
  judge_lib.JudgeLoop(store, judge_lib.RuleJudge(), timeout_s=1e9).run_once(now=1001.0)
  assert store.get(first)["judge_status"] == "unjudgeable"
  assert (store.get(second)["judge_status"], store.get(second)["score"]) == ("judged", 0.0)


def test_model_judge_fills_its_prompt_and_retries_after_failures(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  (a,) = _turn(store, "s", "4", [{"role": "user", "content": "2+2?"}])
  prompts, replies = [], iter([RuntimeError("judge model down"), "Score: 9/10"])

  def complete(messages):
    prompts.append(messages[0]["content"])
    r = next(replies)
    if isinstance(r, Exception):
      raise r
    return r

  judge = judge_lib.ModelJudge(complete, "Q: {question} A: {answer} R: {reply}")
  loop = judge_lib.JudgeLoop(store, judge)
  loop.run_once()
  assert store.get(a)["judge_status"] == "pending" and loop.stats["errors"] == 1
  loop.run_once()
  assert store.get(a)["score"] == pytest.approx(0.9)
  assert prompts[-1] == "Q: 2+2? A: 4 R: "
