"""The session protocol (X-Session-Id, X-Turn-Type, X-Session-Done) and the train batch's per-key
cap: side turns and last turns never reach a train batch; no key takes more than its share.

The store, judge and trainer loop are driven directly (the learner is a stand-in that records which
turns each train step got); one test drives the server on the tiny model with the official
``openai`` client and its ``extra_headers``."""

import time

import openai
import pytest

from areal_jax import config as config_lib
from areal_jax.serve import judge as judge_lib
from areal_jax.serve import trainer_loop
from areal_jax.serve.runtime import ServeRuntime
from areal_jax.serve.store import TurnStore

Q = [{"role": "user", "content": "What is 2 + 3?"}]


def _turn(store, session, answer, messages, key_id=None, turn_type="main", done=False,
          created_s=1000.0, temperature=1.0):
  row = dict(request_id=f"{key_id}-{session}-{len(store.session(session))}", messages=messages,
             prompt_tokens=[1, 2], completion_tokens=[3, 4], logprobs=[-1.0, -1.0],
             versions=[0, 0], completion_text=answer, finish_reason="eos",
             temperature=temperature, created_s=created_s)
  return store.add_turns(session, [row], key_id, turn_type, done)[0][0]


def _reply(history, answer, user):
  return history + [{"role": "assistant", "content": answer}, {"role": "user", "content": user}]


class _Learner:

  def __init__(self):
    self.version, self.trained = 0, []  # turn ids per train step

  def train_step(self, groups, rewards):
    self.trained.append([g[0].group_id for g in groups])
    self.version += 1
    return {"loss": 0.0}

  def params(self):
    return {}


class _Ckpt:

  def save(self, *_):
    pass


class _Sink:

  def update_params(self, *_):
    pass

  def send(self, params, _):
    return params


def _trainer(tmp_path, store, batch, share=1.0):
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.actor.batch_size, c.serve.max_key_share, c.serve.max_staleness = batch, share, 100
  c.train.checkpoint_every = 1000
  c.rollout.temperature = 1.0
  return trainer_loop.TrainerLoop(c, str(tmp_path), store, _Learner(), _Sink(), _Sink(), _Ckpt())


def _trained(loop):
  while loop.step():
    pass
  return {i for batch in loop.learner.trained for i in batch}


def test_side_turns_are_recorded_but_never_judged_nor_next_states(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  first = _turn(store, "s", "5", Q)
  side = _turn(store, "s", "summary", [{"role": "user", "content": "summarise: right"}],
               turn_type="side")
  _turn(store, "s", "ok", _reply(Q, "5", "right"))
  judge_lib.JudgeLoop(store, judge_lib.RuleJudge(), timeout_s=60.0).run_once(now=1001.0)
  assert (store.get(first)["judge_status"], store.get(first)["score"]) == ("judged", 1.0)
  assert store.get(side)["judge_status"] == store.get(side)["train_status"] == "side"
  assert store.next_turn("s", 0)["turn_type"] == "main"
  assert side not in {r["id"] for r in store.trainable(100)}


def test_a_done_sessions_last_turn_is_judged_as_last_at_once(tmp_path):
  """X-Session-Done: the last turn has no next state and is not trained (no timeout to wait for);
  a session's only turn is judged alone by a judge that needs no next state."""
  store = TurnStore(str(tmp_path / "t.sqlite"))
  first = _turn(store, "long", "5", Q)
  last = _turn(store, "long", "ok", _reply(Q, "5", "right"), done=True)
  waiting = _turn(store, "open", "5", Q)  # not done, within the timeout: its reply may come
  only = _turn(store, "only", "5", Q, done=True)
  scored = []
  model = judge_lib.ModelJudge(lambda m: scored.append(m) or "Score: 8", "{question}|{answer}|{reply}")
  judge_lib.JudgeLoop(store, model, timeout_s=60.0).run_once(now=1001.0)
  assert store.get(first)["score"] == pytest.approx(0.8)  # from its next state
  assert store.get(last)["judge_status"] == "unjudgeable"
  assert store.get(waiting)["judge_status"] == "pending"
  assert (store.get(only)["judge_status"], store.get(only)["score"]) == ("judged", pytest.approx(0.8))
  assert [m[0]["content"] for m in scored].count("What is 2 + 3?|5|") == 1  # the only turn, alone

  rule_store = TurnStore(str(tmp_path / "r.sqlite"))
  only = _turn(rule_store, "only", "5", Q, done=True)  # the rule judge needs the user's reply
  judge_lib.JudgeLoop(rule_store, judge_lib.RuleJudge(), timeout_s=60.0).run_once(now=1001.0)
  assert rule_store.get(only)["judge_status"] == "unjudgeable"


def test_another_keys_request_cannot_join_a_session(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  mine = _turn(store, "s", "5", Q, key_id="key-a")
  _turn(store, "s", "ok", _reply(Q, "5", "that's wrong"), key_id="key-b")  # not a's next state
  assert store.next_turn("s", 0, "key-a") is None
  assert store.session_state("s", "key-b") == {"done": False, "main_turns": 1}
  judge_lib.JudgeLoop(store, judge_lib.RuleJudge(), timeout_s=60.0).run_once(now=1001.0)
  assert store.get(mine)["judge_status"] == "pending"


def test_side_and_last_turns_never_reach_a_train_batch(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  mains, others = [], []
  for s in range(4):
    session = f"s{s}"
    mains.append(_turn(store, session, "5", Q, created_s=1.0))
    others.append(_turn(store, session, "note", Q, turn_type="side", created_s=1.0))
    history = _reply(Q, "5", "right" if s % 2 else "that's wrong")
    mains.append(_turn(store, session, "7", history, created_s=1.0))
    others.append(_turn(store, session, "bye", _reply(history, "7", "right"), done=s < 2,
                        created_s=1.0))  # the last turn: done, or timed out
  judge_lib.JudgeLoop(store, judge_lib.RuleJudge(), timeout_s=60.0).run_once(now=2000.0)
  loop = _trainer(tmp_path, store, batch=2)
  trained = _trained(loop)
  assert trained == set(mains) and not trained & set(others)
  assert {store.get(i)["train_status"] for i in others} <= {"side", "new"}


def test_no_key_takes_more_than_its_share_of_a_batch(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  loud = [_turn(store, f"a{i}", "5", Q, key_id="key-loud") for i in range(12)]
  quiet = [_turn(store, f"b{i}", "5", Q, key_id=f"key-q{i % 2}") for i in range(4)]
  store.set_judgements([(i, "judged", 1.0) for i in loud + quiet])
  loop = _trainer(tmp_path, store, batch=4, share=0.5)
  trained = _trained(loop)
  for batch in loop.learner.trained:  # the loud key's 12 oldest turns are first in line
    assert sum(i in loud for i in batch) <= 2
  assert set(quiet) <= trained and len(loop.learner.trained) == 2
  assert len(trained & set(loud)) == 4  # the rest wait for other keys' turns to fill batches
  assert not loop.step()

  unkeyed = TurnStore(str(tmp_path / "u.sqlite"))  # turns recorded without keys are not capped
  ids = [_turn(unkeyed, f"u{i}", "5", Q) for i in range(4)]
  unkeyed.set_judgements([(i, "judged", 1.0) for i in ids])
  assert _trained(_trainer(tmp_path, unkeyed, batch=4, share=0.25)) == set(ids)


def test_max_key_share_is_checked(tmp_path):
  with pytest.raises(ValueError, match="max_key_share"):
    _trainer(tmp_path, TurnStore(str(tmp_path / "t.sqlite")), batch=2, share=0.0)


def test_a_store_from_before_the_session_columns_opens(tmp_path):
  import sqlite3  # pylint: disable=import-outside-toplevel

  path = str(tmp_path / "old.sqlite")
  conn = sqlite3.connect(path)
  conn.execute("CREATE TABLE turns (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, "
               "turn_index INTEGER NOT NULL, request_id TEXT NOT NULL, candidate INTEGER NOT NULL "
               "DEFAULT 0, messages TEXT NOT NULL, prompt_tokens TEXT NOT NULL, completion_tokens "
               "TEXT NOT NULL, logprobs TEXT NOT NULL, versions TEXT NOT NULL, completion_text TEXT "
               "NOT NULL, finish_reason TEXT NOT NULL, temperature REAL NOT NULL, created_s REAL NOT "
               "NULL, judge_status TEXT NOT NULL DEFAULT 'pending', score REAL, judged_s REAL, "
               "train_status TEXT NOT NULL DEFAULT 'new', trained_version INTEGER)")
  conn.execute("INSERT INTO turns (session_id, turn_index, request_id, messages, prompt_tokens, "
               "completion_tokens, logprobs, versions, completion_text, finish_reason, temperature, "
               "created_s) VALUES ('s', 0, 'r', '[]', '[1]', '[2]', '[-1.0]', '[0]', 'x', 'eos', "
               "1.0, 1.0)")
  conn.commit()
  conn.close()
  store = TurnStore(path)
  old = store.get(1)
  assert (old["turn_type"], old["session_done"], old["key_id"]) == ("main", 0, None)
  assert store.add_turns("s", [dict(old, request_id="r2")])[1] == 1


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.port = 0
  config.serve.train = False  # the trainer's choice of turns is tested above
  config.serve.warmup = False
  config.serve.judge_interval_s = 0.1
  config.lock()
  runtime = ServeRuntime(config, str(tmp_path_factory.mktemp("serve")))
  runtime.start()
  yield runtime
  runtime.stop()


def test_the_openai_client_speaks_the_session_protocol(rt):
  client = openai.OpenAI(base_url=rt.url, api_key="none", max_retries=0, timeout=120)

  def ask(messages, **headers):
    return client.chat.completions.create(model="areal-jax-policy", messages=messages,
                                          max_tokens=4, extra_headers=headers)

  first = ask(Q, **{"X-Session-Id": "agent-1"})
  side = ask([{"role": "user", "content": "Summarise our chat."}],
             **{"X-Session-Id": "agent-1", "X-Turn-Type": "side"})
  last = ask(_reply(Q, first.choices[0].message.content, "right"),
             **{"X-Session-Id": "agent-1", "X-Session-Done": "true"})
  assert [r.turn_index for r in (first, side, last)] == [0, 1, 2]
  rows = {r["id"]: r for r in rt.store.session("agent-1")}
  assert rows[side.turn_ids[0]]["turn_type"] == "side"
  assert rows[last.turn_ids[0]]["session_done"] == 1
  deadline = time.time() + 60
  while time.time() < deadline and any(
      rt.store.get(r.turn_ids[0])["judge_status"] == "pending" for r in (first, last)):
    time.sleep(0.1)
  status = {name: rt.store.get(r.turn_ids[0]) for name, r in
            (("first", first), ("side", side), ("last", last))}
  assert (status["first"]["judge_status"], status["first"]["score"]) == ("judged", 1.0)
  assert status["side"]["judge_status"] == "side"
  assert status["last"]["judge_status"] == "unjudgeable"  # done: judged as last, not timed out
  assert [r["id"] for r in rt.store.trainable(100)] == first.turn_ids
  alone = ask(Q)  # no session id: a session of one turn, done at once
  assert rt.store.get(alone.turn_ids[0])["session_done"] == 1
  with pytest.raises(openai.BadRequestError, match="X-Turn-Type"):
    ask(Q, **{"X-Turn-Type": "aside"})
