"""The in-process vLLM engine against our own model, for real (vLLM on CPU, no mocks).

Parity: on the same tiny weights, vLLM's per-token behaviour logprobs equal our model's
teacher-forced ``log softmax(logits / T)`` within 1e-3. Weight sync: after ``update_params`` the
outputs and logprobs are those of the new weights, including for a prompt vLLM had cached.
Partial rollouts: a weight update mid-sequence keeps the tokens so far (old version, old logprobs)
and continues under the new weights (new version, logprobs of the new weights over the whole
sequence, since vLLM re-prefills prompt + partial output).
"""

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from areal_jax.rollout_api import GroupRequest, SamplingParams  # noqa: E402
from areal_jax.vllm_rollout import VllmInProcessEngine  # noqa: E402

from vllm_helpers import collect, pure, teacher_forced, top_k_mass, wait_for_tokens  # noqa: E402

pytestmark = pytest.mark.vllm
TOL = 1e-3


class Served:
  """The shared engine and which of the two policies it serves."""

  def __init__(self, engine, policies):
    self.engine, self.policies = engine, policies
    self.current = 0

  @property
  def model(self):
    return self.policies[self.current]

  def swap(self):
    """Loads the other policy as the next version and waits until the engine applied it (between
    two steps: ``update_params`` only queues the swap); returns (old model, new model)."""
    old, version = self.model, self.engine.version + 1
    self.current = 1 - self.current
    self.engine.update_params(pure(self.model), version)
    deadline = time.time() + 120
    while self.engine.version != version:
      assert time.time() < deadline, "the weight update was not applied"
      time.sleep(0.01)
    return old, self.model


@pytest.fixture(scope="module")
def served(policies, tokenizer, tmp_path_factory):
  engine = VllmInProcessEngine(policies[0], tokenizer, workdir=str(tmp_path_factory.mktemp("e")),
                               num_slots=8, max_model_len=256,
                               engine_kwargs={"max_num_batched_tokens": 256})  # chunked prefills
  engine.start()
  yield Served(engine, policies)
  engine.close()


def prompt(tokenizer, text):
  return tokenizer.encode(text)


def test_logprobs_match_teacher_forcing(served, tokenizer):
  e = served.engine
  reqs = [GroupRequest(1, prompt(tokenizer, "The answer is"), 3,
                       SamplingParams(temperature=0.7, max_new_tokens=24, seed=1)),
          GroupRequest(2, prompt(tokenizer, "2 + 2 ="), 2,
                       SamplingParams(temperature=1.0, max_new_tokens=16, seed=2)),
          GroupRequest(3, prompt(tokenizer, "Hello"), 1,
                       SamplingParams(greedy=True, max_new_tokens=12))]
  for r in reqs:
    e.submit(r)
  out = collect(e, 6)
  temps = {1: 0.7, 2: 1.0, 3: 1.0}  # greedy: vLLM reports temperature-1 logprobs
  for s in out:
    r = reqs[s.group_id - 1]
    assert s.prompt_tokens == r.prompt_tokens and s.metadata == r.metadata
    assert len(s.tokens) == len(s.logprobs) == len(s.versions) >= 1
    assert s.versions == [e.version] * len(s.tokens)
    if s.finish_reason == "length":
      assert len(s.tokens) == r.params.max_new_tokens
    else:
      assert s.finish_reason in ("eos", "stop") and s.tokens[-1] in tokenizer.eos_token_ids
    ref = teacher_forced(served.model, s, temps[s.group_id])
    np.testing.assert_allclose(s.logprobs, ref, atol=TOL, rtol=0)
    assert s.submitted_s <= s.started_s <= s.finished_s
  group1 = [tuple(s.tokens) for s in out if s.group_id == 1]
  assert len(set(group1)) == 3  # n samples of one prompt are distinct draws
  greedy = next(s for s in out if s.group_id == 3)
  ref = served.model(np.asarray([greedy.prompt_tokens + greedy.tokens]))[0]
  assert greedy.tokens == list(np.asarray(ref[len(greedy.prompt_tokens) - 1:-1].argmax(-1)))


def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(served, tokenizer):
  """The documented difference: under top-k vLLM reports log p - log(kept mass)."""
  e, k = served.engine, 5
  e.submit(GroupRequest(10, prompt(tokenizer, "top k"), 2,
                        SamplingParams(temperature=1.0, top_k=k, max_new_tokens=12, seed=3)))
  for s in collect(e, 2):
    ours = teacher_forced(served.model, s, 1.0)
    mass = top_k_mass(served.model, s, k, 1.0)
    np.testing.assert_allclose(s.logprobs, ours - np.log(mass), atol=TOL, rtol=0)


def test_stop_token_ends_the_sequence_and_is_included(served, tokenizer):
  e = served.engine
  p = prompt(tokenizer, "stop here")
  e.submit(GroupRequest(20, p, 1, SamplingParams(greedy=True, max_new_tokens=16)))
  (free,) = collect(e, 1)
  stop = free.tokens[5]
  first = free.tokens.index(stop)
  e.submit(GroupRequest(21, p, 1, SamplingParams(greedy=True, max_new_tokens=16,
                                                  stop_token_ids=(stop,))))
  (stopped,) = collect(e, 1)
  assert stopped.finish_reason == "stop"
  assert stopped.tokens == free.tokens[:first + 1]


def test_after_a_weight_sync_outputs_match_the_new_weights(served, tokenizer):
  e = served.engine
  p = prompt(tokenizer, "A prompt vLLM has cached before the update")
  e.submit(GroupRequest(30, p, 1, SamplingParams(greedy=True, max_new_tokens=8)))
  (before,) = collect(e, 1)
  old, new = served.swap()
  version = e.version
  e.submit(GroupRequest(31, p, 2, SamplingParams(temperature=1.0, max_new_tokens=16, seed=4)))
  e.submit(GroupRequest(32, p, 1, SamplingParams(greedy=True, max_new_tokens=8)))
  out = collect(e, 3)
  for s in out:
    assert s.versions == [version] * len(s.tokens)
    np.testing.assert_allclose(s.logprobs, teacher_forced(new, s), atol=TOL, rtol=0)
    assert np.max(np.abs(np.array(s.logprobs) - teacher_forced(old, s))) > 0.05
  assert before.versions[0] == version - 1
  assert e.stats["swaps"] >= 1


def test_partial_rollout_continues_under_new_weights(served, tokenizer):
  """The weights are swapped once every sequence has 10 of its 120 tokens. EOS is ignored, so
  no sequence can end before the swap lands (the random model draws EOS early and then the whole
  group could finish under the old weights, leaving no sequence that continues)."""
  e = served.engine
  n, budget = 3, 120
  e.submit(GroupRequest(40, prompt(tokenizer, "Long story:"), n,
                        SamplingParams(temperature=1.0, max_new_tokens=budget, seed=5,
                                       ignore_eos=True)))
  wait_for_tokens(e, {40}, 10)
  resubmitted = e.stats["resubmitted"]
  v_old = e.version
  old, new = served.swap()
  out = collect(e, n)
  assert e.stats["resubmitted"] - resubmitted == sum(
      1 for s in out if s.versions and s.versions[-1] == e.version)
  mixed = 0
  for s in out:
    v = np.array(s.versions)
    assert np.all(np.diff(v) >= 0), "versions never go back within a sequence"
    assert set(v) <= {v_old, e.version}
    assert s.finish_reason in ("length", "eos")
    if s.finish_reason == "length":
      assert len(s.tokens) == budget
    lp = np.array(s.logprobs)
    old_part, new_part = v == v_old, v == e.version
    np.testing.assert_allclose(lp[old_part], teacher_forced(old, s)[old_part], atol=TOL, rtol=0)
    np.testing.assert_allclose(lp[new_part], teacher_forced(new, s)[new_part], atol=TOL, rtol=0)
    mixed += bool(old_part.any() and new_part.any())
  assert mixed >= 1


def test_abort_returns_the_partial_output(served, tokenizer):
  e = served.engine
  e.submit(GroupRequest(50, prompt(tokenizer, "abort me"), 2,
                        SamplingParams(temperature=1.0, max_new_tokens=200, seed=6)))
  wait_for_tokens(e, {50}, 4)
  e.abort(50)
  out = collect(e, 2)
  for s in out:
    assert s.finish_reason == "abort" and 4 <= len(s.tokens) < 200
    assert len(s.logprobs) == len(s.versions) == len(s.tokens)
    np.testing.assert_allclose(s.logprobs, teacher_forced(served.model, s), atol=TOL, rtol=0)


def test_long_prompts_with_chunked_prefill(served, tokenizer):
  """Prompts longer than one step's token budget are prefilled in chunks (the path where vLLM 0.32
  on CPU breaks seeded requests)."""
  e = served.engine
  long_prompt = tokenizer.encode("a fairly long prompt " * 10)[:200]
  e.submit(GroupRequest(70, long_prompt, 4, SamplingParams(temperature=1.0, max_new_tokens=12)))
  out = collect(e, 4)
  assert all(s.finish_reason in ("length", "eos") and s.error is None for s in out)
  for s in out:
    np.testing.assert_allclose(s.logprobs, teacher_forced(served.model, s), atol=TOL, rtol=0)


def test_bad_requests_are_answered_with_errors(served, tokenizer):
  e = served.engine
  e.submit(GroupRequest(60, [], 2))
  e.submit(GroupRequest(61, [10**6], 1))
  out = collect(e, 3)
  assert [s.finish_reason for s in out] == ["error"] * 3
  assert all(s.error for s in out)
