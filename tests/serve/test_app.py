"""The server end to end on the tiny model, over loopback: the OpenAI client, streaming, the turn
store's write-before-acknowledge rule, HTTP errors, disconnects, and the loops' independence."""

import contextlib
import http.client
import json
import time

import openai
import pytest

from areal_jax import config as config_lib
from areal_jax.serve.runtime import ServeRuntime

MODEL = "areal-jax-policy"
Q = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.port = 0
  config.serve.judge_timeout_s = 0.5
  config.train.checkpoint_every = 1
  config.lock()
  runtime = ServeRuntime(config, str(tmp_path_factory.mktemp("serve")))
  runtime.start()
  yield runtime
  runtime.stop()


@pytest.fixture(scope="module")
def client(rt):
  return openai.OpenAI(base_url=rt.url, api_key="none", max_retries=0, timeout=120)


class _Resp:

  def __init__(self, raw: http.client.HTTPResponse):
    self.raw, self.status_code, self.headers = raw, raw.status, raw.headers

  def json(self):
    return json.loads(self.raw.read())

  def iter_lines(self):
    for line in self.raw:
      yield line.decode().rstrip("\n")


@contextlib.contextmanager
def _request(rt, method, path, body=None, headers=None):
  conn = http.client.HTTPConnection("127.0.0.1", rt.port, timeout=120)
  if body is not None and not isinstance(body, bytes):
    body = json.dumps(body).encode()
  try:
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
    yield _Resp(conn.getresponse())
  finally:
    conn.close()


def _post(rt, body):
  with _request(rt, "POST", "/v1/chat/completions", body) as resp:
    resp.body = resp.raw.read()
    resp.text = resp.body.decode()
    resp.json = lambda: json.loads(resp.body)
    return resp


def _health(rt):
  with _request(rt, "GET", "/health") as resp:
    return resp.json()


def test_models_and_a_recorded_completion(rt, client):
  assert [m.id for m in client.models.list().data] == [MODEL]
  r = client.chat.completions.create(model=MODEL, messages=Q, user="sess-a", max_tokens=8)
  row = rt.store.get(r.turn_ids[0])
  assert row["session_id"] == "sess-a" and row["turn_index"] == 0
  assert len(row["completion_tokens"]) == len(row["logprobs"]) == len(row["versions"]) \
      == r.usage.completion_tokens
  assert row["completion_text"] == r.choices[0].message.content
  assert len(row["prompt_tokens"]) == r.usage.prompt_tokens


def test_a_conversations_next_request_continues_its_kept_turn(rt, client):
  """serve.keep_turns: the engine keeps each turn's KV, and the conversation's next request (its
  history with the answer in it) runs only the new messages on top of it."""
  def second_turn(session, question):  # -> (the response, whether the engine continued it)
    first = client.chat.completions.create(model=MODEL, messages=question, user=session,
                                           max_tokens=2, temperature=0)  # (a short answer: the
    # tiny model's bytes may re-encode otherwise, and then share less of the next prompt)
    history = question + [{"role": "assistant", "content": first.choices[0].message.content},
                          {"role": "user", "content": "right"}]
    before = rt.engine.stats["continued"]
    second = client.chat.completions.create(model=MODEL, messages=history, user=session,
                                            max_tokens=4, temperature=0)
    return second, rt.engine.stats["continued"] - before

  assert rt.context.keep_turns  # (the config's default; no version trained yet: no swap drops)
  second, continued = second_turn("sess-keep", Q)
  assert continued == 1 and rt.store.get(second.turn_ids[0])["turn_index"] == 1
  rt.context.keep_turns = False
  try:  # nothing kept: the history is prefilled
    assert second_turn("sess-prefill", [{"role": "user", "content": "How much is 17 - 9?"}])[1] == 0
  finally:
    rt.context.keep_turns = True


def test_streamed_turn_is_in_the_store_before_the_stream_ends(rt):
  body = dict(model=MODEL, messages=Q, stream=True, max_tokens=12)
  text, checked = "", False
  with _request(rt, "POST", "/v1/chat/completions", body, {"X-Session-Id": "sess-stream"}) as resp:
    assert resp.status_code == 200 and resp.headers["x-session-id"] == "sess-stream"
    for line in resp.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      choice = chunk["choices"][0]
      text += choice["delta"].get("content") or ""
      if choice["finish_reason"] is not None:  # the response has not ended yet: [DONE] follows
        row = rt.store.get(chunk["turn_ids"][0])
        assert row is not None and row["completion_text"] == text
        checked = True
  assert checked


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (dict(model="gpt-9", messages=Q), 404, "model_not_found"),
    (dict(model=MODEL, messages=[{"role": "user", "content": "7 + 1? " * 200}]), 400,
     "context_length_exceeded"),
    (dict(model=MODEL, messages=Q, n=0), 400, None),
    (dict(model=MODEL, messages=Q, temperature="hot"), 400, None),
    (dict(model=MODEL, messages=Q, max_tokens=10**6), 400, None),
    (dict(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, None),
    (dict(model=MODEL), 400, None),
])
def test_bad_requests_get_openai_errors(rt, body, status, code):
  resp = _post(rt, body)
  assert resp.status_code == status, resp.text
  error = resp.json()["error"]
  assert error["message"] and error["code"] == code


@pytest.mark.parametrize("method,path,status", [("POST", "/v1/completions", 404),
                                                ("GET", "/v1/chat/completions", 405)])
def test_paths_and_methods_not_served_get_openai_errors_naming_what_is(rt, method, path, status):
  with _request(rt, method, path, {} if method == "POST" else None) as resp:
    assert resp.status_code == status
    error = resp.json()["error"]
  assert error["message"].startswith(f"{method} {path} is not ")
  assert "POST /v1/chat/completions" in error["message"] and "GET /v1/models" in error["message"]
  if status == 405:
    assert resp.headers["Allow"] == "POST"


def test_the_client_library_raises_typed_errors(client):
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="nope", messages=Q)
  with pytest.raises(openai.BadRequestError, match="context length"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 2000}])


def test_disconnect_mid_stream_aborts_in_the_engine(rt, client):
  aborted = rt.dispatcher.finished["abort"]
  rt.engine.pause()  # hold decoding so the client leaves mid-request
  try:
    with _request(rt, "POST", "/v1/chat/completions",
                  dict(model=MODEL, messages=Q, stream=True, max_tokens=16),
                  {"X-Session-Id": "sess-gone"}) as resp:
      first = next(resp.iter_lines())
      assert first.startswith("data: ")
  finally:
    rt.engine.resume()
  deadline = time.time() + 30
  while rt.dispatcher.finished["abort"] == aborted and time.time() < deadline:
    time.sleep(0.05)
  assert rt.dispatcher.finished["abort"] == aborted + 1
  assert rt.store.session("sess-gone") == []  # not acknowledged, not recorded
  assert client.chat.completions.create(model=MODEL, messages=Q, max_tokens=4).choices


def test_a_turn_that_cannot_be_recorded_is_not_acknowledged(rt, monkeypatch):
  def broken(*_):
    raise OSError("disk full")
  monkeypatch.setattr(rt.store, "add_turns", broken)
  resp = _post(rt, dict(model=MODEL, messages=Q, max_tokens=4))
  assert resp.status_code == 500 and resp.json()["error"]["code"] == "store_failed"


def test_in_process_model_judge_asks_the_served_policy_unrecorded(rt):
  from areal_jax.serve import judge as judge_lib

  before = rt.store.counts()["turns"]
  asked = []
  complete = rt._judge_completer()  # pylint: disable=protected-access  (serve.judge_url = "")
  judge = judge_lib.ModelJudge(lambda m: asked.append(complete(m)) or asked[-1], "{question} {answer}")
  judge(dict(messages=Q, completion_text="5"), None)  # the tiny model's score: whatever it says
  assert len(asked) == 1 and isinstance(asked[0], str)
  assert rt.store.counts()["turns"] == before


@pytest.mark.slow
def test_judge_and_trainer_learn_and_can_die_without_stopping_serving(rt, client, monkeypatch):
  """With the judge stopped, the trainer's crash comes from the turns judged before: the users
  talk for 1 s only to leave turns pending (each user finishes a conversation begun in it)."""
  from areal_jax.serve.simulated_user import SimulatedUsers

  users = SimulatedUsers(rt.config, rt.url)
  deadline = time.time() + 120
  while rt.engine.version < 1 and time.time() < deadline:  # trained, then published
    users.run(2.0)
  assert rt.engine.version >= 1 and users.errors == 0
  assert _health(rt)["turns"]["train_status.trained"] >= rt.config.actor.batch_size

  # A trainer crash mid-step (and a killed judge) leave serving up.
  def crash(*_):
    raise RuntimeError("learner exploded")
  monkeypatch.setattr(rt.trainer.learner, "train_step", crash)
  rt.judge.stop()
  users.run(1.0)  # each user's conversation at least once: turns left pending, unjudged
  deadline = time.time() + 30
  while rt.trainer.alive and time.time() < deadline:
    time.sleep(0.1)
  health = _health(rt)
  assert not health["trainer"]["alive"] and "learner exploded" in health["trainer"]["error"]
  assert not health["judge"]["alive"]
  assert client.chat.completions.create(model=MODEL, messages=Q, max_tokens=4).choices
  pending = rt.store.counts().get("judge_status.pending", 0)
  assert pending > 0  # recorded while the judge was down, waiting for it

  # Restarted, both resume from the store and the checkpoint.
  monkeypatch.undo()
  version = rt.trainer.learner.version
  rt.restart_judge()
  rt.restart_trainer(checkpoint=False)
  assert rt.trainer.alive and rt.judge.alive
  assert rt.trainer.learner.version == version  # checkpoint_every=1: nothing to redo
  deadline = time.time() + 30
  while rt.store.counts().get("judge_status.pending", 0) >= pending and time.time() < deadline:
    time.sleep(0.1)
  assert rt.store.counts().get("judge_status.pending", 0) < pending
