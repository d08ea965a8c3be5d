"""Hindsight-guided on-policy distillation (serve.signal = opd | combined): hints from the judge,
the teacher's logprobs of the original response under the hinted prompt, the learner's per-token
advantage teacher - student (and the top-k reverse KL), the combined weights, users who teach in
words, and the session rules (side and last turns never trained) with OPD too.

The model is the learner tests' tiny one; servers are loopback only."""

import json
import pathlib
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax.learner import Learner, distill
from areal_jax.rollout_api import Sample
from areal_jax.serve import judge as judge_lib, simulated_user, teacher as teacher_lib, trainer_loop
from areal_jax.serve.store import TurnStore

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "learner"))
from learner_helpers import V, _logsoftmax, actor, chat_bytes, mesh, model  # noqa: E402

HINTS = judge_lib.Hints("[HINT]", "[/HINT]", min_chars=12, max_chars=100)


# ---- hints -----------------------------------------------------------------------------------

def test_the_longest_useful_hint_of_the_votes_is_kept():
  votes = ["Bad. [HINT]add first[/HINT]\nScore: -1",  # too short to be useful
           "[HINT] multiply 7 by 8 first,\n then add 3 [/HINT] Score: -1",
           "[HINT]multiply 7 by 8 first[/HINT]\nScore: -1", "no hint here\nScore: -1", None]
  assert HINTS.longest([HINTS.parse(v) for v in votes]) == "multiply 7 by 8 first, then add 3"
  assert HINTS.parse("[HINT]" + "x" * 300 + "[/HINT]") == "x" * 100  # cut to max_chars
  assert HINTS.longest([HINTS.parse(v) for v in votes[0::3]]) is None  # none useful: no signal


def test_the_rule_judge_takes_a_reply_that_says_more_than_a_verdict_as_the_hint():
  judge = judge_lib.RuleJudge(HINTS)
  nxt = lambda text: {"messages": [{"role": "user", "content": text}]}  # noqa: E731
  assert judge.assess({}, nxt("right")) == (1.0, None)
  assert judge.assess({}, nxt("no, that's wrong")) == (0.0, None)
  teach = "Multiply 7 by 8 first, then add 3."
  assert judge.assess({}, nxt(teach)) == (None, teach)
  # the reply's opening verdict is the score's, not the hint's (the teacher never saw the answer)
  assert judge.assess({}, nxt("that's wrong. " + teach)) == (0.0, teach)
  assert judge.assess({}, nxt("No, multiply 7 by 8 first.")) == (0.0, "multiply 7 by 8 first.")
  keep = judge_lib.RuleJudge(judge_lib.Hints(min_chars=12, keep_verdict=True))
  assert keep.assess({}, nxt("that's wrong. " + teach)) == (0.0, "that's wrong. " + teach)
  assert judge_lib.RuleJudge().assess({}, nxt(teach)) == (None, None)  # no hints asked for


def test_a_leading_verdict_is_only_clauses_that_say_right_or_wrong():
  cases = {"no, that's wrong. Hiro starts with 2.": "no, that's wrong. ",
           "Not quite: add first.": "Not quite: ", "Wrong!! Add first": "Wrong!! ",
           "yes, that's right. Now try 9.": "yes, that's right. ",
           "That's 56, not 54.": "", "It is 5, no?": "", "Multiply first.": "", "": ""}
  for reply, verdict in cases.items():
    assert judge_lib.leading_verdict(reply) == verdict, reply
  # a reply that is only a verdict is one whole, and gives no hint
  assert judge_lib.leading_verdict("no, that's wrong") == "no, that's wrong"
  assert HINTS.from_reply("no, that's wrong") is None


def test_users_who_teach_in_words_say_no_verdict_but_the_way():
  example = {"answer": "Ava starts with 7 apples.\n3 times as many: 7 * 3 = 21.\n#### 21"}
  words = simulated_user.teaching_reply(example)
  assert words == "Ava starts with 7 apples. 3 times as many: 7 * 3 = 21. So the answer is 21."
  assert judge_lib.rule_score(words) is None
  assert judge_lib.RuleJudge(HINTS).assess({}, {"messages": [
      {"role": "user", "content": words}]}) == (None, words)
  # a worked answer with verdict words loses them
  assert judge_lib.rule_score(simulated_user.teaching_reply(
      {"answer": "No sharing is right here.\n#### 3"})) is None
  rng = __import__("random").Random(0)
  assert simulated_user.reply_for(example, True, "words", rng) == words
  assert judge_lib.rule_score(simulated_user.reply_for(example, False, "both", rng)) == 0.0
  assert words in simulated_user.reply_for(example, False, "both", rng)
  assert simulated_user.reply_for(example, True, "both", rng) in simulated_user.POSITIVE
  assert simulated_user.reply_for(example, False, "verdict", rng) in simulated_user.NEGATIVE


def test_votes_carry_hints_and_a_turn_without_next_state_has_none():
  replies = ["[HINT]the file is in src/, not lib/[/HINT]\nScore: -1", "Score: -1",
             "[HINT]look in src/ instead[/HINT]\nScore: +1"]
  judge = judge_lib.VotesJudge(lambda messages, n: replies[:n], "{question}{answer}{reply}", 3,
                               HINTS)
  turn = {"messages": [{"role": "user", "content": "where?"}], "completion_text": "lib/"}
  nxt = {"messages": turn["messages"] + [{"role": "assistant", "content": "lib/"},
                                         {"role": "user", "content": "not there"}]}
  assert judge.assess(turn, nxt) == (-1.0, "the file is in src/, not lib/")
  assert judge.assess(turn, None)[1] is None
  assert judge.stats["hints"] == 1


# ---- the teacher -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
  return model()


def test_teacher_logprobs_are_a_teacher_forced_forward_of_the_hinted_prompt(tiny):
  temperature, k = 0.7, 3
  teacher = teacher_lib.BaseTeacher(tiny, mesh(1), chat_bytes, "{message} Hint: {hint}",
                                    temperature, topk=k, batch=2, max_len=512)
  # the longest first: the teacher batches similar lengths, and each result is its turn's
  turns = [{"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "2 + 2?"},
                         {"role": "assistant", "content": "5"},
                         {"role": "user", "content": "And 3 + 3?"}],
            "completion_tokens": [7] * 20},
           {"messages": [{"role": "user", "content": "What is 7 * 8 + 3?"}],
            "completion_tokens": [5, 9, 2, 30, 1]},
           {"messages": [{"role": "user", "content": "x"}], "completion_tokens": [3, 4, 5]},
           {"messages": [{"role": "user", "content": "9 - 4?"}], "completion_tokens": [8, 6]}]
  hints = ["count on your fingers", "multiply 7 by 8 first, then add 3", "z" * 600, "take 4 away"]
  got = teacher.score(list(zip(turns, hints)))
  assert got[2] is None  # longer than the teacher takes: no OPD signal
  del turns[2], hints[2], got[2]
  rows = []
  for turn, hint in zip(turns, hints):
    hinted = teacher_lib.hinted_messages(turn["messages"], hint, "{message} Hint: {hint}")
    assert hinted[-1]["content"].endswith(f" Hint: {hint}") and turn["messages"][-1]["content"] \
        in hinted[-1]["content"]
    rows.append((chat_bytes(hinted), turn["completion_tokens"]))
  # the plain forward of each row, padded at the end (causal: the padding changes nothing before)
  width = max(len(p) + len(r) for p, r in rows)
  tokens = jnp.asarray([p + r + [0] * (width - len(p) - len(r)) for p, r in rows], jnp.int32)
  full = np.asarray(_logsoftmax(nnx.graphdef(tiny), nnx.to_pure_dict(nnx.state(tiny, nnx.Param)),
                                tokens, temperature))
  for (prompt, response), res, lp in zip(rows, got, full):
    ref = lp[len(prompt) - 1:len(prompt) + len(response) - 1]  # the positions scoring the response
    np.testing.assert_allclose(res["logprobs"], ref[np.arange(len(response)), response],
                               atol=1e-4)
    top = np.sort(ref, axis=-1)[:, ::-1][:, :k]
    np.testing.assert_allclose(res["topk_logprobs"], top, atol=1e-4)
    np.testing.assert_allclose(np.take_along_axis(ref, np.asarray(res["topk_ids"]), -1), top,
                               atol=1e-4)


def test_the_teacher_pads_lengths_finely_on_cpu_only(tiny):
  assert teacher_lib.BaseTeacher(tiny, mesh(1), chat_bytes, "{message} {hint}", 1.0).fine_buckets
  # accelerators: power-of-two lengths (fewer compiles); CPU: under a fifth of a row is padding
  coarse = [teacher_lib._length_bucket(n, 64, False) for n in (10, 65, 153, 257)]
  assert coarse == [64, 128, 256, 512]
  fine = {n: teacher_lib._length_bucket(n, 64, True) for n in range(1, 2049)}
  assert fine[10] == 64 and fine[153] == 160 and fine[1024] == 1024
  assert all(n <= b and (n <= 64 or b - n < b / 5) for n, b in fine.items())
  assert len({b for n, b in fine.items() if 512 < n <= 1024}) == 4  # shapes per doubling


def test_prompt_logprobs_of_a_remote_teacher_are_read_by_token_id():
  entries = [None, {"3": {"logprob": -0.5, "rank": 1}},
             {"4": {"logprob": -2.0, "rank": 3}, "9": {"logprob": -0.1, "rank": 1},
              "8": {"logprob": -1.0, "rank": 2}},
             {"6": {"logprob": -0.2, "rank": 1}, "7": {"logprob": -1.9, "rank": 2}}]
  reply = {"choices": [{"prompt_logprobs": entries}]}
  got = teacher_lib.parse_prompt_logprobs(reply, 2, [4, 6], topk=2)
  assert got == {"logprobs": [-2.0, -0.2], "topk_ids": [[9, 8], [6, 7]],
                 "topk_logprobs": [[-0.1, -1.0], [-0.2, -1.9]]}
  with pytest.raises(ValueError, match="prompt_logprobs"):
    teacher_lib.parse_prompt_logprobs({"choices": [{"text": ""}]}, 2, [4, 6], 0)
  with pytest.raises(ValueError, match="lack response token 1"):
    teacher_lib.parse_prompt_logprobs(reply, 2, [4, 5], 0)


def test_a_remote_teacher_is_asked_for_the_hinted_prompt_and_the_response():
  seen = []

  class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
      body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
      seen.append((self.path, body))
      entries = [None] + [{str(t): {"logprob": -float(i), "rank": 1}}
                          for i, t in enumerate(body["prompt"][1:], start=1)]
      out = json.dumps({"choices": [{"text": "", "prompt_logprobs": entries}]}).encode()
      self.send_response(200)
      self.send_header("Content-Length", str(len(out)))
      self.end_headers()
      self.wfile.write(out)

    def log_message(self, *_):
      pass

  server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    teacher = teacher_lib.RemoteTeacher(url, "base", chat_bytes, "{message} ({hint})")
    turn = {"messages": [{"role": "user", "content": "hi"}], "completion_tokens": [1, 2]}
    got = teacher.score([(turn, "say hello back")])
  finally:
    server.shutdown()
    server.server_close()
  prompt = chat_bytes([{"role": "user", "content": "hi (say hello back)"}])
  assert seen[0][0] == "/v1/completions"
  assert seen[0][1]["prompt"] == prompt + [1, 2] and seen[0][1]["model"] == "base"
  assert got == [{"logprobs": [-float(len(prompt)), -float(len(prompt) + 1)]}]


# ---- the learner's per-token advantage -------------------------------------------------------

def test_the_opd_advantage_is_teacher_minus_student_on_trained_tokens_only():
  adv = jnp.asarray([[0.5, 0.5, 0.5, 0.0]])
  teacher, student = jnp.asarray([[-1.0, -2.0, -0.5, 9.0]]), jnp.asarray([[-1.5, -1.0, -0.5, 3.0]])
  w, mask = jnp.asarray([[2.0, 2.0, 2.0, 2.0]]), jnp.asarray([[1.0, 1.0, 0.0, 0.0]])
  got = distill.token_advantage(adv, teacher, student, w, mask)
  np.testing.assert_array_equal(got, [[0.5 + 2 * 0.5, 0.5 + 2 * -1.0, 0.0, 0.0]])


def test_the_topk_reverse_kl_is_over_k_plus_one_bins():
  t = np.log(np.asarray([[[0.5, 0.2]]], np.float32))  # the rest: 0.3
  s = np.log(np.asarray([[[0.3, 0.3]]], np.float32))  # the rest: 0.4
  ps, pt = np.asarray([0.3, 0.3, 0.4]), np.asarray([0.5, 0.2, 0.3])
  np.testing.assert_allclose(distill.topk_reverse_kl(s, t), [[np.sum(ps * np.log(ps / pt))]],
                             rtol=1e-5)
  np.testing.assert_allclose(distill.topk_reverse_kl(t, t), [[0.0]], atol=1e-6)


def _samples(rng, n=3):
  out = []
  for g in range(n):
    toks = rng.integers(0, V, 6).tolist()
    out.append([Sample(g, 0, rng.integers(0, V, 4).tolist(), toks, [-3.0] * 6, [0] * 6, "eos",
                       loss_mask=[1, 1, 0, 1, 1, 0] if g == 1 else None)])
  return out


def _student_logps(learner, groups):
  from learner_helpers import token_logps  # noqa: PLC0415

  return token_logps(learner, [g[0] for g in groups])


OPTS = actor(adv_norm="none", kl_coef=0.0, ppo_n_minibatches=1)


def test_a_current_weights_teacher_scores_with_the_weights_it_last_followed(tiny):
  """``serve.teacher_weights = "current"``: no copy of the start weights; each ``follow`` hands it
  the weights to score with (the trainer's, before each scoring), the forward is the same."""
  fmt, turn = "{message} Hint: {hint}", {"messages": [{"role": "user", "content": "7 * 8 + 3?"}],
                                        "completion_tokens": [5, 9, 2, 30, 1]}
  current = teacher_lib.BaseTeacher(tiny, mesh(1), chat_bytes, fmt, 1.0, max_len=512, current=True)
  assert current.params is None
  with pytest.raises(RuntimeError, match="call follow first"):
    current.score([(turn, "multiply first")])
  start = nnx.to_pure_dict(nnx.state(tiny, nnx.Param))
  moved = jax.tree.map(lambda x: x * 1.5, start)  # the policy after some training, say
  current.follow(moved)
  got = current.score([(turn, "multiply first")])[0]["logprobs"]
  prompt = chat_bytes(teacher_lib.hinted_messages(turn["messages"], "multiply first", fmt))
  response = turn["completion_tokens"]
  tokens = jnp.asarray([prompt + response], jnp.int32)
  for params, same in ((moved, True), (start, False)):
    lp = np.asarray(_logsoftmax(nnx.graphdef(tiny), params, tokens, 1.0))[0]
    ref = lp[len(prompt) - 1:len(prompt) + len(response) - 1][np.arange(len(response)), response]
    assert np.allclose(got, ref, atol=1e-4) == same
  frozen = teacher_lib.BaseTeacher(tiny, mesh(1), chat_bytes, fmt, 1.0, max_len=512)
  with pytest.raises(ValueError, match="start weights"):
    frozen.follow(moved)


@pytest.fixture(scope="module")
def opd_learner():
  return Learner(model(), OPTS, mesh(1), temperature=0.9, distill_topk=0)


def test_the_learner_trains_teacher_minus_its_own_logprobs(opd_learner):
  """Teacher = student + 1 on every trained token is an advantage of exactly 1 there: the same
  gradient as a reward of 1 and no teacher; teacher = student is no signal at all; whatever the
  teacher says on masked tokens changes nothing."""
  learner, groups = opd_learner, _samples(np.random.default_rng(0))
  student = _student_logps(learner, groups)
  zeros = [[0.0]] * len(groups)
  plus_one = [[distill.TokenTeacher([x + 1.0 if g[0].loss_mask is None or m else 100.0
                                     for x, m in zip(s, g[0].loss_mask or [1] * 6)], 1.0)]
              for g, s in zip(groups, student)]
  got, _ = learner.gradients(groups, zeros, teachers=plus_one)
  want, _ = learner.gradients(groups, [[1.0]] * len(groups), teachers=[[None]] * len(groups))
  leaves = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  np.testing.assert_allclose(leaves(got), leaves(want), rtol=2e-3, atol=1e-6)
  same = [[distill.TokenTeacher(s, 1.0)] for s in student]
  none, _ = learner.gradients(groups, zeros, teachers=same)
  assert np.max(np.abs(leaves(none))) < 1e-3 * np.max(np.abs(leaves(want)))


def test_the_topk_term_trains_towards_the_teacher():
  """Top-k: the student's own top k as the teacher is a KL of 0 (no gradient); another teacher
  gives a gradient."""
  learner = Learner(model(), OPTS, mesh(1), temperature=0.9, distill_topk=2)
  groups = _samples(np.random.default_rng(1), n=2)
  rows = [list(g[0].prompt_tokens) + list(g[0].tokens) for g in groups]  # all of one length
  lp = np.asarray(_logsoftmax(learner.graphdef, learner.merged_params(),
                              jnp.asarray(rows, jnp.int32), 0.9))
  full = [x[len(g[0].prompt_tokens) - 1:-1] for x, g in zip(lp, groups)]
  own = [[distill.TokenTeacher([0.0] * 6, 1.0, np.argsort(-lp, -1)[:, :2].tolist(),
                               np.sort(lp, -1)[:, ::-1][:, :2].tolist())] for lp in full]
  zeros = [[0.0]] * len(groups)
  leaves = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])  # noqa: E731
  g0, _ = learner.gradients(groups, zeros, teachers=own)
  other = [[distill.TokenTeacher([0.0] * 6, 1.0, [[1, 2]] * 6, [[-0.1, -3.0]] * 6)]
           for _ in groups]
  g1, m1 = learner.gradients(groups, zeros, teachers=other)
  assert np.max(np.abs(leaves(g0))) < 1e-4 < np.max(np.abs(leaves(g1)))
  assert m1["loss"] > 0


# ---- the trainer loop: combined weights, and what reaches a batch ------------------------------

class _Learner:

  def __init__(self):
    self.version, self.steps = 0, []

  def train_step(self, groups, rewards, teachers=None):
    self.steps.append(([g[0].group_id for g in groups], [r[0] for r in rewards], teachers))
    self.version += 1
    return {"loss": 0.0}

  def params(self):
    return {}

  def merged_params(self):
    return {"version": self.version}  # what a teacher following the current weights is handed


class _Sink:

  def update_params(self, *_):
    pass

  def send(self, params, _):
    return params

  def save(self, *_):
    pass


class _Teacher:
  """The teacher's logprob of each response token: -1, -2, ... (no forward)."""

  current = False  # (the frozen start weights' kind: nothing to follow)

  def __init__(self):
    self.asked, self.fail, self.cannot = [], False, set()

  def score(self, items):
    """``cannot``: turn ids it returns None for (as for a hinted prompt past its length)."""
    if self.fail:
      raise ConnectionError("the teacher is down")
    self.asked += [(turn["id"], hint) for turn, hint in items]
    return [None if turn["id"] in self.cannot else
            {"logprobs": [-float(i + 1) for i in range(len(turn["completion_tokens"]))]}
            for turn, _ in items]


def _loops(tmp_path, signal, w_rl=1.0, w_opd=1.0, batch=2, teacher_at="judge", center=False,
           hint_cut_off=True):
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.serve.opd_center = center
  c.actor.batch_size, c.serve.max_staleness, c.train.checkpoint_every = batch, 100, 1000
  c.rollout.temperature = 1.0
  c.serve.signal, c.serve.signal_w_rl, c.serve.signal_w_opd = signal, w_rl, w_opd
  store = TurnStore(str(tmp_path / "t.sqlite"))
  teacher = _Teacher()
  here = lambda at: teacher if teacher_at == at else None  # noqa: E731
  judge = judge_lib.JudgeLoop(store, judge_lib.RuleJudge(HINTS), signal=signal,
                              teacher=here("judge"), hint_cut_off=hint_cut_off)
  sink = _Sink()
  trainer = trainer_loop.TrainerLoop(c, str(tmp_path), store, _Learner(), sink, sink, sink,
                                     teacher=here("trainer"))
  return store, judge, trainer, teacher


Q = [{"role": "user", "content": "What is 7 * 8 + 3?"}]
TEACH = "Multiply 7 by 8 first, then add 3."


def _turn(store, session, answer, messages, turn_type="main", done=False, version=0,
          finish_reason="eos"):
  row = dict(request_id=f"{session}-{len(store.session(session))}", messages=messages,
             prompt_tokens=[1, 2], completion_tokens=[3, 4, 5], logprobs=[-1.0] * 3,
             versions=[version] * 3, completion_text=answer, finish_reason=finish_reason,
             temperature=1.0, created_s=1000.0)
  return store.add_turns(session, [row], None, turn_type, done)[0][0]


def _conversation(store, session, reply, side=False, finish_reason="eos"):
  """The answer turn, maybe a side turn, then the user's reply as the session's last turn."""
  first = _turn(store, session, "62", Q, finish_reason=finish_reason)
  if side:
    _turn(store, session, "a summary", [{"role": "user", "content": "summarise: " + TEACH}],
          "side")
  last = _turn(store, session, "ok", Q + [{"role": "assistant", "content": "62"},
                                          {"role": "user", "content": reply}], done=True)
  return first, last


@pytest.mark.parametrize("teacher_at", ["judge", "trainer"])
def test_opd_trains_only_hinted_main_turns_never_side_or_last_ones(tmp_path, teacher_at):
  """The same turns and teachers reach the batch whichever loop runs the teacher."""
  store, judge, trainer, teacher = _loops(tmp_path, "opd", w_opd=0.5, teacher_at=teacher_at)
  a, a_last = _conversation(store, "a", TEACH, side=True)
  b, b_last = _conversation(store, "b", "that's wrong")  # a verdict, no hint: no OPD signal
  c, c_last = _conversation(store, "c", "that's wrong. " + TEACH, side=True)
  only = _turn(store, "d", "62", Q, done=True)  # a session's only turn: no next state, no hint
  judge.run_once(now=2000.0)
  while trainer.step():
    pass
  assert sorted(t for t, _ in teacher.asked) == [a, c]
  trained = {i for ids, _, _ in trainer.learner.steps for i in ids}
  assert trained == {a, c}
  assert not trained & {a_last, b_last, c_last, only, b}
  (ids, rewards, teachers), = trainer.learner.steps
  assert rewards == [0.0, 0.0]  # opd: no scalar term
  assert [t[0].logprobs for t in teachers] == [[-1.0, -2.0, -3.0]] * 2
  assert {t[0].weight for t in teachers} == {0.5}
  assert json.loads(json.dumps(store.get(a)["teacher"])) == {"logprobs": [-1.0, -2.0, -3.0]}
  assert store.get(a)["hint"] == TEACH and store.get(b)["judge_status"] == "unjudgeable"
  assert {r["train_status"] for r in store.session("a") if r["turn_type"] == "side"} == {"side"}


def test_combined_weights_the_score_and_the_teacher(tmp_path):
  store, judge, trainer, _ = _loops(tmp_path, "combined", w_rl=0.5, w_opd=2.0, batch=3)
  hinted, _ = _conversation(store, "a", TEACH)  # no verdict: the teacher's term only
  scored, _ = _conversation(store, "b", "right")  # no hint: the score's term only
  both, _ = _conversation(store, "c", "that's wrong. " + TEACH)
  judge.run_once(now=2000.0)
  assert trainer.step()
  (ids, rewards, teachers), = trainer.learner.steps
  by_id = dict(zip(ids, zip(rewards, [t[0] for t in teachers])))
  assert sorted(by_id) == sorted([hinted, scored, both])
  # the running baseline starts at the mean score of the scored turns, (1 + 0) / 2
  assert by_id[hinted][0] == 0.0 and by_id[hinted][1].weight == 2.0
  assert by_id[scored][0] == pytest.approx(0.5 * (1.0 - 0.5)) and by_id[scored][1] is None
  assert by_id[both][0] == pytest.approx(0.5 * (0.0 - 0.5)) and by_id[both][1].weight == 2.0


@pytest.mark.parametrize("signal", ["combined", "opd"])
def test_without_hint_cut_off_a_cut_off_turn_gets_no_teacher(tmp_path, signal):
  """``serve.hint_cut_off = False``: a turn cut off at its token limit loses its hint, so the
  teacher never scores it; it trains on its score alone (combined) or not at all (opd). A finished
  turn with the same reply keeps its hint."""
  batch = 2 if signal == "combined" else 1  # (opd: the finished turn is the only one to train)
  store, judge, trainer, teacher = _loops(tmp_path, signal, batch=batch, hint_cut_off=False)
  cut, _ = _conversation(store, "a", "that's wrong. " + TEACH, finish_reason="length")
  done, _ = _conversation(store, "b", "that's wrong. " + TEACH)
  judge.run_once(now=2000.0)
  assert [t for t, _ in teacher.asked] == [done]
  assert store.get(cut)["hint"] is None and store.get(done)["hint"] == TEACH
  assert store.get(cut)["judge_status"] == ("judged" if signal == "combined" else "unjudgeable")
  while trainer.step():
    pass
  (ids, rewards, teachers), = trainer.learner.steps
  by_id = dict(zip(ids, zip(rewards, [t[0] for t in teachers])))
  assert by_id[done][1] is not None
  if signal == "combined":
    assert sorted(by_id) == sorted([cut, done]) and by_id[cut][1] is None
  else:
    assert cut not in by_id


def test_a_centred_teacher_term_has_no_mean_over_the_response(tmp_path):
  """``serve.opd_center``: each turn's teacher logprobs are shifted by its mean of teacher -
  behaviour logprob, so ``teacher - behaviour`` sums to 0 over the response (the score's term
  unchanged); the token-to-token differences stay the teacher's."""
  store, judge, trainer, _ = _loops(tmp_path, "combined", batch=2, center=True)
  both, _ = _conversation(store, "a", "that's wrong. " + TEACH)
  scored, _ = _conversation(store, "b", "right")
  judge.run_once(now=2000.0)
  assert trainer.step()
  (ids, rewards, teachers), = trainer.learner.steps
  by_id = dict(zip(ids, zip(rewards, [t[0] for t in teachers])))
  # the teacher says -1, -2, -3 where the policy sampled at -1 each: mean(teacher - behaviour) = -1
  assert by_id[both][1].logprobs == [0.0, -1.0, -2.0]
  assert by_id[both][0] == pytest.approx(0.0 - 0.5) and by_id[scored][1] is None
  c = config_lib.load("configs/serve_arithmetic.py:tiny")
  c.unlock()
  c.serve.signal, c.serve.opd_center, c.serve.teacher_topk = "combined", True, 4
  with pytest.raises(ValueError, match="serve.opd_center=True"):
    config_lib.validate(c)


def test_binary_ignores_hints_and_calls_the_learner_as_before(tmp_path):
  store, judge, trainer, teacher = _loops(tmp_path, "binary", w_rl=2.0, batch=1)
  judge = judge_lib.JudgeLoop(store, judge_lib.RuleJudge())
  _conversation(store, "a", TEACH)  # no verdict: not trained
  first, _ = _conversation(store, "b", "right")
  judge.run_once(now=2000.0)
  assert trainer.step() and not teacher.asked
  (ids, rewards, teachers), = trainer.learner.steps
  assert ids == [first] and teachers is None and rewards == [0.0]  # 2 * (1 - baseline 1)


def test_with_the_teacher_at_the_trainer_hinted_turns_wait_for_it_and_survive_its_failure(tmp_path):
  """``serve.teacher_at = "trainer"``: the judge stores hint and score and leaves the turn hinted
  (it calls no teacher); the trainer's teacher judges it before the step. When the teacher fails,
  a hinted turn with a score trains on it alone (combined) and the batch goes on; one with only
  a hint stays hinted, and the next step's teacher scores it."""
  store, judge, trainer, teacher = _loops(tmp_path, "combined", batch=2, teacher_at="trainer")
  words, _ = _conversation(store, "a", TEACH)  # a hint, no verdict
  wrong, _ = _conversation(store, "b", "that's wrong. " + TEACH)
  right, _ = _conversation(store, "c", "right")
  later, _ = _conversation(store, "d", "that's wrong. " + TEACH)
  judge.run_once(now=2000.0)
  assert judge.stats["hinted"] == 3 and not teacher.asked
  rows = [store.get(words), store.get(wrong)]
  assert [r["judge_status"] for r in rows] == ["hinted"] * 2
  assert rows[0]["hint"] == TEACH and rows[1]["hint"].endswith(TEACH)
  assert [r["score"] for r in rows] == [None, 0.0]
  teacher.fail = True
  assert trainer.step() and trainer.stats["teacher_errors"] == 1  # asked once, for [words, wrong]
  (ids, _, teachers), = trainer.learner.steps
  assert sorted(ids) == [wrong, right] and [t[0] for t in teachers] == [None, None]
  assert store.get(words)["judge_status"] == "hinted"
  teacher.fail = False
  assert trainer.step()
  assert [t for t, _ in teacher.asked] == [words, later]  # the batch's hinted turns, in its order
  assert trainer.stats["teacher_turns"] == trainer.stats["teacher_scored"] == 2
  ids, _, teachers = trainer.learner.steps[1]
  assert ids == [words, later] and all(t[0].logprobs == [-1.0, -2.0, -3.0] for t in teachers)
  assert store.get(words)["judge_status"] == "judged"
  assert store.get(words)["train_status"] == "trained"


def test_a_current_weights_teacher_follows_the_learner_before_each_scoring(tmp_path):
  """``serve.teacher_weights = "current"``: before the trainer's teacher scores a batch's hinted
  turns it is handed the learner's weights of that moment (a later step: the later weights)."""
  store, judge, trainer, teacher = _loops(tmp_path, "opd", batch=1, teacher_at="trainer")
  teacher.current = True
  teacher.follow = lambda params: teacher.asked.append(("follow", params["version"]))
  first, _ = _conversation(store, "a", TEACH)
  judge.run_once(now=2000.0)
  assert trainer.step()
  second, _ = _conversation(store, "b", TEACH)
  judge.run_once(now=2000.0)
  assert trainer.step()
  assert teacher.asked == [("follow", 0), (first, TEACH), ("follow", 1), (second, TEACH)]


def test_the_trainer_s_teacher_spends_no_forward_on_a_turn_it_would_not_train(tmp_path):
  """Hinted turns already more than ``serve.max_staleness`` versions old are judged without the
  teacher (combined: by their score alone) and counted stale, never trained: all of them, however
  many (more than twice the batch here), so that none stays hinted for ever."""
  store, judge, trainer, teacher = _loops(tmp_path, "combined", batch=1, teacher_at="trainer")
  old = [_conversation(store, s, "that's wrong. " + TEACH)[0] for s in "abc"]
  judge.run_once(now=2000.0)
  trainer.learner.version = trainer.config.serve.max_staleness + 1  # the turns' tokens: version 0
  assert not trainer.step() and not teacher.asked
  for row in map(store.get, old):
    assert (row["judge_status"], row["teacher"], row["train_status"]) == ("judged", None, "stale")
  assert trainer.stats["stale"] == 3 and trainer.stats["teacher_turns"] == 0


def test_hinted_turns_the_judge_s_teacher_never_reached_are_counted_stale(tmp_path):
  """``serve.teacher_at = "judge"``: that teacher scores the newest hinted turns, so older ones
  can wait behind it for ever; once they are more than ``serve.max_staleness`` versions old the
  trainer judges them without a forward and counts them stale, and the fresh ones stay hinted."""
  store, judge, trainer, teacher = _loops(tmp_path, "combined", batch=1, teacher_at="judge")
  teacher.fail = True  # the judge's teacher reaches none of these turns (down, or behind)
  old = [_conversation(store, s, "that's wrong. " + TEACH)[0] for s in "abc"]
  judge.run_once(now=2000.0)
  assert [store.get(t)["judge_status"] for t in old] == ["hinted"] * 3
  fresh = _turn(store, "d", "62", Q, version=1)  # one version newer: not stale
  store.set_judgements([(fresh, "hinted", 0.0, TEACH)])
  trainer.learner.version = trainer.config.serve.max_staleness + 1
  assert not trainer.step() and not teacher.asked
  for row in map(store.get, old):
    assert (row["judge_status"], row["teacher"], row["train_status"]) == ("judged", None, "stale")
  assert trainer.stats["stale"] == 3
  assert (store.get(fresh)["judge_status"], store.get(fresh)["train_status"]) == ("hinted", "new")


def test_hinted_turns_train_in_arrival_order_and_the_teacher_scores_only_the_batch_s(tmp_path):
  """A hinted turn (here a wrong answer with the user's correction) keeps its place among the
  judged ones: each batch is the oldest turns, and the teacher scores the hinted turns of that
  batch, so every forward it runs is trained; the turns after the batch wait unscored."""
  store, judge, trainer, teacher = _loops(tmp_path, "combined", batch=2, teacher_at="trainer")
  wrong = _conversation(store, "a", "that's wrong. " + TEACH)[0]
  right = _conversation(store, "b", "right")[0]  # judged at once: no hint, no teacher
  later = [_conversation(store, s, "that's wrong. " + TEACH)[0] for s in "cde"]
  judge.run_once(now=2000.0)
  assert trainer.step()
  assert [t for t, _ in teacher.asked] == [wrong]
  assert sorted(trainer.learner.steps[0][0]) == sorted([wrong, right])
  assert trainer.step()
  assert [t for t, _ in teacher.asked] == [wrong] + later[:2]
  assert sorted(trainer.learner.steps[1][0]) == later[:2]
  assert not trainer.step()  # one turn left: no batch, and no forward for it
  assert trainer.stats["teacher_turns"] == 3 and store.get(later[2])["judge_status"] == "hinted"
  (_, rewards, teachers), _ = trainer.learner.steps
  by_id = dict(zip(trainer.learner.steps[0][0], zip(rewards, teachers)))
  assert by_id[wrong][0] < 0.0 < by_id[right][0]  # the wrong answer's score trains too
  assert by_id[wrong][1][0].logprobs == [-1.0, -2.0, -3.0] and by_id[right][1][0] is None


def test_a_turn_the_teacher_cannot_score_leaves_the_batch_to_the_next_one(tmp_path):
  """opd: a hinted turn the teacher returns nothing for has no signal (unjudgeable); the batch
  is read again and the next turn, scored in its turn, takes its place. A teacher that fails
  leaves every turn hinted (none has a signal without it)."""
  store, judge, trainer, teacher = _loops(tmp_path, "opd", batch=2, teacher_at="trainer")
  turns = [_conversation(store, s, TEACH)[0] for s in "abc"]
  teacher.cannot = {turns[0]}
  judge.run_once(now=2000.0)
  teacher.fail = True  # nothing trains without the teacher here: every turn waits for it
  assert not trainer.step() and trainer.stats["teacher_errors"] == 1
  assert {store.get(t)["judge_status"] for t in turns} == {"hinted"}
  teacher.fail = False
  assert trainer.step()
  assert [t for t, _ in teacher.asked] == turns
  assert sorted(trainer.learner.steps[0][0]) == turns[1:]
  assert store.get(turns[0])["judge_status"] == "unjudgeable"
  assert store.get(turns[0])["train_status"] == "new"  # never trained, never counted stale
