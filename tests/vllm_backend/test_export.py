"""vLLM serves what ``areal_jax.export`` writes: on CPU, from the exported directory alone (its own
config, weights and tokenizer), it generates the same greedy tokens as our sampler."""

import os
import pathlib
import sys

import pytest
from flax import nnx

pytest.importorskip("vllm")

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import export, models  # noqa: E402
from areal_jax.learner import Learner  # noqa: E402
from areal_jax.rollout_api import GroupRequest, SamplingParams  # noqa: E402
from areal_jax.runtime.checkpoint import Checkpointer  # noqa: E402
from areal_jax.sampler.service import JaxRolloutEngine  # noqa: E402
from areal_jax.vllm_rollout import settings  # noqa: E402

from vllm_helpers import collect, tiny_hd32_config  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "learner"))
from learner_helpers import actor, batch, mesh  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = pathlib.Path(__file__).resolve().parents[2]
NEW_TOKENS = 24


def test_vllm_generates_our_greedy_tokens_from_an_exported_run(tokenizer, tmp_path):
  # the run: a full-weight learner on 4 devices (fsdp) from a head_dim-32 model vLLM's CPU
  # attention takes, one train step, checkpointed as a run does
  source = models.save_hf(models.Transformer(tiny_hd32_config(tokenizer), nnx.Rngs(0)), tokenizer,
                          tmp_path / "source")
  learner = Learner(models.load(source)[0], actor(lr=1e-2), mesh(4), temperature=1.0)
  learner.train_step(*batch(0))
  Checkpointer(str(tmp_path / "run"), keep=1).save(1, learner.state, {"version": 1})
  config = config_lib.load(f"{ROOT}/configs/gsm8k.py:tiny")
  config_lib.override(config, "model.source", source)
  out = export.export(config, str(tmp_path / "run"), str(tmp_path / "hf"))["model"]

  prompts = [tokenizer.encode(text) for text in ("The answer is", "2 + 2 =", "Hello, world")]
  model, _ = models.load(out)
  engine = JaxRolloutEngine(model, num_slots=4, max_len=64, eos_token_ids=())
  engine.start()
  try:
    for i, p in enumerate(prompts):
      engine.submit(GroupRequest(i, p, 1, SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS,
                                                         ignore_eos=True)))
    ours = [s.tokens for s in collect(engine, len(prompts))]
  finally:
    engine.stop()

  os.environ.update(settings.environment("cpu", str(tmp_path / "cache")))
  import vllm  # pylint: disable=import-outside-toplevel
  from vllm.inputs import TokensPrompt  # pylint: disable=import-outside-toplevel
  llm = vllm.LLM(model=out, max_model_len=64, max_num_seqs=4, seed=0,
                 **settings.engine_fields("cpu", dtype="float32"))
  try:
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                               ignore_eos=True))
    theirs = [list(o.outputs[0].token_ids) for o in outputs]
  finally:
    llm.llm_engine.engine_core.shutdown()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    cleanup_dist_env_and_memory()
  assert len({t for seq in ours for t in seq}) > 3  # (not one token repeated)
  assert theirs == ours
