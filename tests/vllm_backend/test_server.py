"""The HTTP server engine: a real vLLM OpenAI-compatible server on 127.0.0.1 (started by the engine),
driven with token ids. Same checks as the in-process engine: logprob parity, weight sync through
/pause, /collective_rpc, /reset_prefix_cache, /resume, and partial rollouts across it. (A server
whose owner is SIGKILLed stops with it: test_e2e_ray.py, where the owner is a Ray worker.)"""

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from areal_jax.rollout_api import GroupRequest, SamplingParams  # noqa: E402
from areal_jax.vllm_rollout import VllmServerEngine, lifeline  # noqa: E402

from vllm_helpers import collect, pure, teacher_forced  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOL = 1e-3


@pytest.fixture(scope="module")
def server(policies, tokenizer, tmp_path_factory):
  engine = VllmServerEngine(policies[0], tokenizer, workdir=str(tmp_path_factory.mktemp("srv")),
                            num_slots=8, max_model_len=2048)
  engine.start()
  yield engine
  pid = engine.server_pid
  engine.close()
  assert engine._proc is None
  assert pid is not None and not lifeline.group_alive(pid)  # close returns once all is gone


# new tokens of the groups paused mid-flight (EOS ignored: only this budget ends them); well above
# the hundred or so that vLLM may still draw after /pause, and each one is decoded after the resume
LONG = 400


def _live(engine, group_id):
  with engine._lock:
    return [a.seq for a in engine._active.values()
            if a.seq.group.request.group_id == group_id and len(a.seq.tokens) < LONG]


def pause_mid_group(engine, group_id, prompt, seed, at_least, tries=5, timeout=120.0):
  """Submits a group of two ``LONG`` sequences and pauses the server while both run, each with at
  least ``at_least`` tokens. Returns the group's id.

  Watching a stream from outside races with it: on a loaded machine the test thread can miss most
  of a tiny model's sequence (about 1 ms a token), a worker thread can start its sequence after
  the other one ended, and vLLM can run on for a hundred tokens after /pause is posted. CI saw both
  tests below fail so when the groups could end at EOS within 200 tokens. So EOS is ignored, the
  budget is long, and a try whose sequences do not run together is drained and made again under
  the next group id."""
  params = SamplingParams(temperature=1.0, max_new_tokens=LONG, ignore_eos=True, seed=seed)
  for k in range(tries):
    gid, ended = group_id + 100 * k, []
    engine.submit(GroupRequest(gid, prompt, 2, params))
    deadline = time.time() + timeout
    while len(ended) < 2:
      seqs = _live(engine, gid)
      if len(seqs) == 2 and min(len(s.tokens) for s in seqs) >= at_least:
        engine.pause()
        time.sleep(0.2)  # tokens already on the wire land; frozen sequences stay below the budget
        if len(_live(engine, gid)) == 2:
          return gid
        engine.resume()
      if time.time() > deadline:
        raise TimeoutError(f"group {gid} neither reached {at_least} tokens nor ended "
                           f"in {timeout} s")
      ended += engine.poll(timeout=0.01)
    assert all(x.group_id == gid and x.finish_reason == "length" for x in ended)
  raise AssertionError(f"{tries} groups all ended before the server could be paused mid-group")


def test_server_logprobs_and_stop_tokens(server, policies, tokenizer):
  m0 = policies[0]
  p = tokenizer.encode("Hello over HTTP")
  server.submit(GroupRequest(1, p, 3, SamplingParams(temperature=0.7, max_new_tokens=20, seed=1)))
  server.submit(GroupRequest(2, p, 1, SamplingParams(greedy=True, max_new_tokens=16)))
  out = collect(server, 4)
  for s in out:
    t = 0.7 if s.group_id == 1 else 1.0
    np.testing.assert_allclose(s.logprobs, teacher_forced(m0, s, t), atol=TOL, rtol=0)
    assert s.versions == [0] * len(s.tokens)
  free = out[-1]
  stop = free.tokens[4]
  server.submit(GroupRequest(3, p, 1, SamplingParams(greedy=True, max_new_tokens=16,
                                                     stop_token_ids=(stop,))))
  (stopped,) = collect(server, 1)
  assert stopped.finish_reason == "stop"
  assert stopped.tokens == free.tokens[:free.tokens.index(stop) + 1]


def test_server_weight_sync_and_partial_rollout(server, policies, tokenizer):
  m0, m1 = policies
  p = tokenizer.encode("Long story over HTTP:")
  # Freeze the group mid-sequence (a tiny model on an idle CPU could otherwise finish its tokens
  # before the swap's pause reaches the server), swap while paused, then let it continue.
  gid = pause_mid_group(server, 10, p, seed=2, at_least=4)
  server.update_params(pure(m1), 1)  # synchronous for the server engine
  assert server.version == 1
  server.resume()
  server.submit(GroupRequest(11, p, 1, SamplingParams(greedy=True, max_new_tokens=8)))
  out = collect(server, 3)
  for s in out:
    v, lp = np.array(s.versions), np.array(s.logprobs)
    assert np.all(np.diff(v) >= 0)
    np.testing.assert_allclose(lp[v == 0], teacher_forced(m0, s)[v == 0], atol=TOL, rtol=0)
    np.testing.assert_allclose(lp[v == 1], teacher_forced(m1, s)[v == 1], atol=TOL, rtol=0)
  long = [s for s in out if s.group_id == gid]
  assert all(s.versions[0] == 0 for s in long)
  assert len(long) == 2 and all(len(s.tokens) == LONG and s.versions[-1] == 1 for s in long)
  assert server.stats["resubmitted"] == 2 and server.stats["swaps"] == 1


def test_server_abort(server, tokenizer):
  # Frozen mid-sequence first (as the weight-sync test does): on a loaded machine the tiny model
  # could otherwise finish its tokens before the abort reaches the server (CI saw it once).
  gid = pause_mid_group(server, 20, tokenizer.encode("abort"), seed=3, at_least=3)
  try:
    server.abort(gid)
  finally:
    server.resume()
  out = collect(server, 2)
  assert all(s.finish_reason == "abort" and 3 <= len(s.tokens) < LONG for s in out)
