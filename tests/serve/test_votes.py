"""The votes judge (serve.judge = "votes"): vote parsing, the majority rule, next states, and the
judge loop asking a loopback OpenAI-compatible judge for m votes per turn, whose +1 / -1 the
trainer loop trains as the advantage itself."""

import collections
import json
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_jax import config as config_lib
from areal_jax.rollout_api import Sample, SamplingParams
from areal_jax.serve import judge as judge_lib, runtime, trainer_loop
from areal_jax.serve.dispatch import Dispatcher
from areal_jax.serve.store import TurnStore


@pytest.mark.parametrize("votes,verdict", [
    ([1, 1, -1], 1), ([-1, -1, 1], -1), ([1, -1], 0), ([1, -1, 0], 0),  # ties: no verdict
    ([0, 0, 1], 0), ([None, None, None], 0), ([], 0),                  # 0 wins / all abstain
    ([None, None, -1], -1), ([1, None, 1, -1, None], 1), ([0, 1, 1], 1)])
def test_majority(votes, verdict):
  assert judge_lib.majority(votes) == verdict


@pytest.mark.parametrize("reply,vote", [
    ("Score: +1", 1), ("score: 1", 1), ("SCORE:-1", -1), ("Score: 0.", 0),
    ("The user said it was wrong.\n\nScore: -1\n", -1), ("  Score: +1  ", 1),
    ("Score: +1\nActually no.", None),     # the verdict must be the last line
    ("Score: 2", None), ("Score: +0.5", None), ("Score: -1 (bad)", None), ("+1", None),
    ("I think Score: +1", None), ("**Score: +1**", None), ("", None), (None, None)])
def test_parse_vote(reply, vote):
  assert judge_lib.parse_vote(reply) == vote


def test_next_state_is_what_followed_the_answer():
  turn = {"messages": [{"role": "user", "content": "2+2?"}], "completion_text": "4"}
  reply = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                        {"role": "user", "content": "right"}]}
  assert judge_lib.next_state(turn, reply) == "user: right"
  tool = {"messages": reply["messages"][:2] + [{"role": "tool", "content": "exit 1: 3 failed"},
                                               {"role": "user", "content": "fix it"}]}
  assert judge_lib.next_state(turn, tool) == "tool: exit 1: 3 failed\nuser: fix it"
  bare = {"messages": [{"role": "user", "content": "wrong"}]}  # the client sent no history
  assert judge_lib.next_state(turn, bare) == "user: wrong"
  assert "ended" in judge_lib.next_state(turn, None)


class _FakeJudge(ThreadingHTTPServer):
  """/v1/chat/completions on loopback: the choices for a prompt are the replies of
  ``script(prompt)`` in turn, ``n`` per request (one with ``ignore_n``); requests are kept."""

  def __init__(self, script, ignore_n=False):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.script, self.ignore_n, self.requests = script, ignore_n, []
    self.served = collections.Counter()  # choices sent so far, per prompt

  def __enter__(self):
    threading.Thread(target=self.serve_forever, daemon=True).start()
    return self

  def __exit__(self, *exc):
    self.shutdown()
    self.server_close()

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
  def do_POST(self):  # noqa: N802 (http.server's name)
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.requests.append(body)
    prompt = body["messages"][-1]["content"]
    replies, done = self.server.script(prompt), self.server.served[prompt]
    n = 1 if self.server.ignore_n else body.get("n", 1)
    self.server.served[prompt] += n
    choices = [{"index": i, "finish_reason": "stop",
                "message": {"role": "assistant", "content": replies[(done + i) % len(replies)]}}
               for i in range(n)]
    out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                      "choices": choices}).encode()
    self.send_response(200)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(out)))
    self.end_headers()
    self.wfile.write(out)

  def log_message(self, *args):
    pass


def _session(store, session, answer, reply):
  """A two-turn session: the question and ``answer``, then the user's ``reply`` (the last turn)."""
  q = [{"role": "user", "content": f"question {session}"}]
  ids = []
  for messages, text in ((q, answer), (q + [{"role": "assistant", "content": answer},
                                            {"role": "user", "content": reply}], "ok")):
    row = dict(request_id=f"{session}-{len(ids)}", messages=messages, prompt_tokens=[1, 2],
               completion_tokens=[3, 4, 5], logprobs=[-1.0] * 3, versions=[0] * 3,
               completion_text=text, finish_reason="eos", temperature=1.0, created_s=1000.0)
    ids += store.add_turns(session, [row], done=len(ids) == 1)[0]
  return ids


# The judge's replies per next state, three votes each: +1 by majority, -1 by majority, a tie
# with an abstention (no verdict), and every vote unparseable (no verdict).
_SCRIPT = {"user: right": ["Looks right.\nScore: +1", "Score: +1", "Score: -1"],
           "user: wrong": ["Score: -1", "score: -1", "Score: +1"],
           "user: hmm": ["Score: +1", "Score: -1", "I cannot say"],
           "user: ?": ["+1", "Score: maybe", ""]}


def _script(prompt):
  return next(v for k, v in _SCRIPT.items() if k in prompt)


class _Learner:
  version = 0

  def __init__(self):
    self.rewards = []

  def train_step(self, groups, rewards):
    self.rewards.append([r[0] for r in rewards])
    self.version += 1
    return {"loss": 0.0}

  def params(self):
    return {}


class _Transfer:
  def send(self, params, version):
    return params


class _Engine:
  def update_params(self, params, version):
    pass


class _Ckpt:
  def latest_step(self):
    return None


@pytest.mark.parametrize("ignore_n", [False, True])
def test_votes_from_a_judge_server_train_as_plus_or_minus_one(tmp_path, ignore_n):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  first = {reply: _session(store, f"s{i}", "an answer", reply)[0]
           for i, reply in enumerate(("right", "wrong", "hmm", "?"))}
  with _FakeJudge(_script, ignore_n=ignore_n) as server:
    sample = judge_lib.openai_sampler(server.url, "judge", temperature=1.0, max_tokens=64)
    judge = judge_lib.VotesJudge(sample, config_lib.base_config().serve.judge_vote_prompt, votes=3)
    loop = judge_lib.JudgeLoop(store, judge, timeout_s=60.0)
    loop.run_once(now=1001.0)
  # one request of n=3 per judged turn (a backend that ignores n is asked for the rest until it
  # gave three); the last turns of these two-turn sessions have no next state, never asked about
  assert [r["n"] for r in server.requests] == ([3, 2, 1] * 4 if ignore_n else [3] * 4)
  assert all(r["temperature"] == 1.0 and r["max_tokens"] == 64 for r in server.requests)
  prompt = server.requests[0]["messages"][0]["content"]
  assert "question s0" in prompt and "an answer" in prompt and "user: right" in prompt
  got = {reply: (store.get(i)["judge_status"], store.get(i)["score"]) for reply, i in first.items()}
  assert got == {"right": ("judged", 1.0), "wrong": ("judged", -1.0),
                 "hmm": ("unjudgeable", None), "?": ("unjudgeable", None)}
  assert store.counts()["judge_status.unjudgeable"] == 6  # + the four sessions' last turns
  assert judge.stats["abstained"] == 4 and judge.stats["verdict+0"] == 2

  # the trainer loop trains the two verdicts with their +1 / -1 as the reward, no baseline
  config = config_lib.base_config()
  config.actor.adv_norm, config.actor.batch_size = "none", 2
  config.serve.judge, config.rollout.temperature = "votes", 1.0
  config.train.checkpoint_every = 100
  trainer = trainer_loop.TrainerLoop(config, str(tmp_path), store, _Learner(), _Transfer(),
                                     _Engine(), _Ckpt())
  assert trainer.step()
  assert trainer.learner.rewards == [[1.0, -1.0]]
  assert not trainer.step()  # the turns without a verdict never reach a batch
  assert store.counts()["train_status.trained"] == 2


def test_an_only_turn_is_judged_alone_and_a_dead_judge_is_retried(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  row = dict(request_id="r", messages=[{"role": "user", "content": "q"}], prompt_tokens=[1],
             completion_tokens=[2], logprobs=[-1.0], versions=[0], completion_text="a",
             finish_reason="eos", temperature=1.0, created_s=1000.0)
  (only,) = store.add_turns("s", [row], done=True)[0]
  calls = []

  def sample(messages, n):
    calls.append(messages[0]["content"])
    if len(calls) == 1:
      raise ConnectionError("judge down")
    return ["Score: -1"] * n

  loop = judge_lib.JudgeLoop(store, judge_lib.VotesJudge(sample, "{question}|{answer}|{reply}", 2))
  loop.run_once(now=1001.0)
  assert store.get(only)["judge_status"] == "pending" and loop.stats["errors"] == 1
  loop.run_once(now=1002.0)
  assert (store.get(only)["judge_status"], store.get(only)["score"]) == ("judged", -1.0)
  assert calls[-1] == "q|a|(nothing: the conversation ended)"


@pytest.mark.parametrize("judge,rewards", [("votes", [1.0, 1.0, -1.0, 1.0]),
                                           ("rule", [0.0, 0.0, -2.0, 0.0])])
def test_votes_are_the_advantage_without_a_baseline(tmp_path, judge, rewards):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  ids = [_session(store, f"s{i}", "a", "right")[0] for i in range(4)]
  store.set_judgements([(i, "judged", s) for i, s in zip(ids, (1.0, 1.0, -1.0, 1.0))])
  config = config_lib.base_config()
  config.actor.adv_norm, config.actor.batch_size = "none", 2
  config.serve.judge, config.rollout.temperature = judge, 1.0
  config.train.checkpoint_every = 100
  trainer = trainer_loop.TrainerLoop(config, str(tmp_path), store, _Learner(), _Transfer(),
                                     _Engine(), _Ckpt())
  assert trainer.step() and trainer.step()
  # votes: +1 / -1 as they stand; other judges' scores less the running baseline (the first
  # batch's mean, 1.0, then its moving average over those two scores, still 1.0)
  assert sum(trainer.learner.rewards, []) == pytest.approx(rewards)


class _GroupEngine:
  """Finishes each submitted group's n samples (tokens: the prompt plus the sample's index)."""

  def __init__(self):
    self.requests, self._out, self._lock = [], [], threading.Lock()

  def start(self):
    pass

  def stop(self):
    pass

  def abort(self, group_id):
    pass

  def submit(self, req):
    self.requests.append(req)
    with self._lock:
      self._out += [Sample(req.group_id, i, req.prompt_tokens, req.prompt_tokens + [i], [0.0],
                           [0], "eos") for i in range(req.n)]

  def poll(self, timeout):
    with self._lock:
      out, self._out = self._out, []
    if not out:
      time.sleep(timeout)
    return out


def test_in_process_votes_are_one_group_of_m_samples():
  engine = _GroupEngine()
  dispatcher = Dispatcher(engine)
  dispatcher.start()
  try:
    samples = dispatcher.generate_many([7, 8], 3, SamplingParams(temperature=1.0), timeout=30.0)
  finally:
    dispatcher.stop()
  assert [(r.n, r.prompt_tokens) for r in engine.requests] == [(3, [7, 8])]
  assert sorted(s.tokens[-1] for s in samples) == [0, 1, 2]


def test_health_counts_the_votes(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  (first, _) = _session(store, "s", "a", "right")
  judge = judge_lib.VotesJudge(lambda messages, n: ["Score: +1", "Score: 0", "no idea"],
                               "{reply}", 3)
  loop = judge_lib.JudgeLoop(store, judge)
  loop.run_once(now=1001.0)
  rt = types.SimpleNamespace(store=store, status_line=types.SimpleNamespace(numbers=dict),
                             judge=loop, trainer=None, trainer_in_process=False)
  health = runtime.ServeRuntime.status(rt)
  assert health["judge"]["votes"] == {"vote+1": 1, "vote+0": 1, "abstained": 1, "verdict+0": 1}
  assert store.get(first)["judge_status"] == "unjudgeable"
