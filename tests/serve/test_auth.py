"""Access control of the server (serve/access.py), over loopback on the tiny model: API keys (401),
per-key rate limits (429), body limits (413), malformed bodies (4xx), and keys that never reach
the logs or the turn store; and the refusal to listen beyond loopback without keys."""

import http.client
import json
import logging
import os

import openai
import pytest

from areal_jax import config as config_lib
from areal_jax.serve import access
from areal_jax.serve.runtime import ServeRuntime

MODEL = "areal-jax-policy"
Q = [{"role": "user", "content": "What is 2 + 3?"}]
KEYS = ("sk-test-alpha-5c1f0e9a7d", "sk-test-beta-9b2e44c0aa")


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("serve")
  with open(workdir / "keys.txt", "w", encoding="utf-8") as f:
    f.write("# the test's keys\n\n" + "\n".join(KEYS) + "\n")
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.port = 0
  config.serve.api_keys = f"file:{workdir / 'keys.txt'}"
  config.serve.train = False
  config.serve.warmup = False
  config.lock()
  runtime = ServeRuntime(config, str(workdir))
  runtime.start()
  yield runtime
  runtime.stop()


def _post(rt, body, key=KEYS[0], headers=None, path="/v1/chat/completions"):
  conn = http.client.HTTPConnection("127.0.0.1", rt.port, timeout=120)
  if body is not None and not isinstance(body, (bytes, list)):
    body = json.dumps(body).encode()
  auth = {"Authorization": f"Bearer {key}"} if key else {}
  try:
    conn.request("POST", path, body=body, encode_chunked=isinstance(body, list),
                 headers={"Content-Type": "application/json", **auth, **(headers or {})})
    resp = conn.getresponse()
    return resp.status, dict(resp.headers), json.loads(resp.read())
  finally:
    conn.close()


def _is_error_object(body):
  error = body["error"]
  return set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize("header", [None, "Bearer sk-test-wrong", "Basic " + KEYS[0], "Bearer "])
def test_requests_without_a_valid_key_get_401(rt, header):
  status, headers, body = _post(rt, dict(model=MODEL, messages=Q), key=None,
                                headers={"Authorization": header} if header else None)
  assert status == 401 and _is_error_object(body) and body["error"]["code"] == "invalid_api_key"
  assert headers["www-authenticate"] == "Bearer"


def test_the_openai_client_with_and_without_a_key(rt):
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=rt.url, api_key="sk-nope", max_retries=0).models.list()
  client = openai.OpenAI(base_url=rt.url, api_key=KEYS[1], max_retries=0, timeout=120)
  r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=4,
                                     extra_headers={"X-Session-Id": "keyed"})
  assert rt.store.get(r.turn_ids[0])["key_id"] == access.key_id(KEYS[1])
  conn = http.client.HTTPConnection("127.0.0.1", rt.port, timeout=60)
  conn.request("GET", "/health")  # open to probes
  assert conn.getresponse().status == 200
  conn.close()


def test_a_keys_rate_limit_gives_429_with_retry_after(rt, monkeypatch):
  now = [0.0]
  monkeypatch.setattr(rt.context, "limiter", access.RateLimiter(2, clock=lambda: now[0]))
  body = dict(model=MODEL, messages=Q, max_tokens=2)
  assert _post(rt, body)[0] == _post(rt, body)[0] == 200
  status, headers, error = _post(rt, body)
  assert status == 429 and _is_error_object(error) and error["error"]["code"] == "rate_limit_exceeded"
  assert int(headers["retry-after"]) == 30  # 2 a minute: one more after 30 s
  assert _post(rt, body, key=KEYS[1])[0] == 200  # another key has its own allowance
  now[0] = 30.0
  assert _post(rt, body)[0] == 200


def test_rate_limiter_refills_evenly():
  now = [0.0]
  limiter = access.RateLimiter(60, clock=lambda: now[0])
  for _ in range(60):
    limiter.check("k")
  with pytest.raises(Exception) as e:
    limiter.check("k")
  assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
  now[0] = 1.0
  limiter.check("k")


def test_a_20mb_body_is_refused_with_413_unread(rt, monkeypatch):
  def never(*_):
    raise AssertionError("a body over the limit was tokenized")
  monkeypatch.setattr(rt.context, "encode", never)
  big = dict(model=MODEL, messages=[{"role": "user", "content": "7 + 1? " * (20_000_000 // 7)}])
  status, _, body = _post(rt, big)
  assert status == 413 and _is_error_object(body) and body["error"]["code"] == "request_too_large"
  # without a Content-Length (chunked) it is refused once the limit passes
  chunks = [b'{"model": "areal-jax-policy", "messages": [{"role": "user", "content": "']
  chunks += [b"x" * 65536] * 32 + [b'"}]}']
  status, _, body = _post(rt, chunks)
  assert status == 413 and _is_error_object(body)


def test_a_prompt_far_over_the_context_length_is_refused_untokenized(rt, monkeypatch):
  def never(*_, **__):
    raise AssertionError("tokenized")
  monkeypatch.setattr(rt.context.tokenizer, "encode", never)
  long = dict(model=MODEL, messages=[{"role": "user", "content": "7 + 1? " * 100_000}])
  status, _, body = _post(rt, long)
  assert status == 400 and body["error"]["code"] == "context_length_exceeded"
  assert "at least" in body["error"]["message"]


def test_the_token_bound_never_exceeds_the_token_count():
  import random  # pylint: disable=import-outside-toplevel

  from areal_jax.models.tokenizer import byte_tokenizer  # pylint: disable=import-outside-toplevel

  tokenizer = byte_tokenizer()
  bound = access.TokenBound(tokenizer)
  rng = random.Random(0)
  pieces = ["a", " ", "\n", "\u00e9", "7 + 1", "\U0001F600", "<|im_start|>", "<|endoftext|>"]
  for _ in range(200):
    text = "".join(rng.choice(pieces) * rng.randint(1, 30) for _ in range(rng.randint(1, 40)))
    assert 0 < bound.at_least(text) <= len(tokenizer.encode(text))


@pytest.mark.parametrize("body,headers", [
    (b"{not json", None),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"model": "areal-jax-policy", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b"\xff\xfe{}", None),
    (b'{"model": "areal-jax-policy", "n": ' + b"9" * 5000 + b"}", None),
    (dict(model=MODEL, messages="2+2?"), None),
    (dict(model=[MODEL], messages=Q), None),
    (dict(model=MODEL, messages=[{"role": "user", "content": 4}]), None),
    (dict(model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}]), None),
    (dict(model=MODEL, messages=Q, n="2"), None),
    (dict(model=MODEL, messages=Q, stream="yes"), None),
    (dict(model=MODEL, messages=Q, temperature=None, top_p=[1]), None),
    (dict(model=MODEL, messages=[{"role": "user", "content": "\ud800"}]), None),
    (dict(model=MODEL, messages=Q), {"X-Session-Done": "maybe"}),
])
def test_malformed_bodies_get_4xx_openai_errors(rt, body, headers):
  status, _, error = _post(rt, body, headers=headers)
  assert 400 <= status < 500 and _is_error_object(error)


def test_keys_never_reach_the_logs_or_the_store(rt, caplog, capfd):
  caplog.set_level(logging.DEBUG)
  for key in (*KEYS, "sk-test-not-a-key-3e7d"):
    _post(rt, dict(model=MODEL, messages=Q, max_tokens=2), key=key)
    _post(rt, b"{broken", key=key)
  out, err = capfd.readouterr()
  logged = caplog.text + out + err
  assert "Bearer" not in logged and not any(k in logged for k in (*KEYS, "sk-test-not-a-key"))
  ids = {r["key_id"] for r in rt.store.first(10_000)}
  assert {access.key_id(k) for k in KEYS} <= ids
  stored = b""
  for suffix in ("", "-wal"):  # the database and its write-ahead log, as bytes
    if os.path.exists(rt.store.path + suffix):
      with open(rt.store.path + suffix, "rb") as f:
        stored += f.read()
  assert access.key_id(KEYS[0]).encode() in stored
  assert not any(k.encode() in stored for k in KEYS)


def test_no_keys_means_loopback_only(tmp_path):
  config = config_lib.load("configs/serve_arithmetic.py:tiny")
  config.unlock()
  config.serve.host, config.serve.port = "0.0.0.0", 0
  with pytest.raises(config_lib.ConfigError, match="not a loopback address and serve.api_keys"):
    ServeRuntime(config, str(tmp_path))  # refused before the model loads
  access.check_bind("127.0.0.1", None)
  access.check_bind("localhost", None)
  access.check_bind("0.0.0.0", {b"k": "key-x"})  # with keys: anywhere


def test_key_specs(tmp_path, monkeypatch):
  monkeypatch.setenv("AREAL_TEST_SERVE_KEYS", "sk-a, sk-b\nsk-c")
  assert sorted(access.load_keys("env:AREAL_TEST_SERVE_KEYS")) == [b"sk-a", b"sk-b", b"sk-c"]
  assert access.load_keys("") is None
  (tmp_path / "empty").write_text("# none yet\n")
  with pytest.raises(config_lib.ConfigError, match="must be 'file:PATH'") as e:
    access.load_keys("sk-pasted-key-itself")
  assert "sk-pasted" not in str(e.value)
  for spec, problem in [("env:AREAL_TEST_UNSET_KEYS", "not set"),
                        (f"file:{tmp_path / 'missing'}", "cannot read"),
                        (f"file:{tmp_path / 'empty'}", "holds no keys")]:
    with pytest.raises(config_lib.ConfigError, match=problem):
      access.load_keys(spec)
