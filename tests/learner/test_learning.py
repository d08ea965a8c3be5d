"""Learning: a tiny model trained from scratch with GRPO learns to add two digits, with all weights
trained or with LoRA adapters on the frozen random initialization (same bar).

Prompt ``a + b =`` (token ids: numbers 0..18 are their own ids, then ``+`` and ``=``); the model
answers with one token; reward 1 if it is ``a + b``. Chance is about 1/32. A simple jitted sampler
(one full forward over the prompts, temperature sampling) stands in for the sampler engine; its
per-token behaviour logprobs go to the learner exactly as the engine's would.
"""

import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.learner import Learner
from areal_jax.models.transformer import ModelConfig, Transformer
from areal_jax.rollout_api import Sample

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from learner_helpers import actor, mesh  # noqa: E402

PLUS, EQ = 19, 20
LORA_LR = 4e-3  # adapters only (every projection, rank 16) on the frozen random base
CFG = ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=128)


@functools.partial(jax.jit, static_argnums=(0,))
def sample_answers(graphdef, params, prompts_BxL, key, temperature):
  """One token per prompt from softmax(logits / T) at the last position, and its logprob."""
  logits = nnx.merge(graphdef, params)(prompts_BxL)[:, -1] / temperature
  tokens = jax.random.categorical(key, logits)
  logp = jax.nn.log_softmax(logits)[jnp.arange(tokens.shape[0]), tokens]
  return tokens, logp


def rollout(learner, rng, key, groups, n):
  a = rng.integers(0, 10, groups)
  b = rng.integers(0, 10, groups)
  prompts = np.stack([a, np.full(groups, PLUS), b, np.full(groups, EQ)], 1)
  rep = np.repeat(prompts, n, axis=0)
  tokens, logp = jax.device_get(sample_answers(learner.graphdef, learner.merged_params(),
                                               jnp.asarray(rep, jnp.int32), key,
                                               learner.temperature))
  batch, rewards = [], []
  version = learner.version  # (read once: each read waits for the device's step counter)
  for g in range(groups):
    samples = [Sample(g, i, rep[g * n + i].tolist(), [int(tokens[g * n + i])],
                      [float(logp[g * n + i])], [version], "length") for i in range(n)]
    batch.append(samples)
    rewards.append([float(s.tokens[0] == a[g] + b[g]) for s in samples])
  return batch, rewards


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 16], ids=["full", "lora"])
def test_grpo_learns_two_digit_sums(lora_rank):
  opts = actor(lr=3e-3 if not lora_rank else LORA_LR, ppo_n_minibatches=1, micro_batch_tokens=4096)
  opts.lora.rank, opts.lora.alpha = lora_rank, 2.0 * lora_rank
  # The frozen head of a LoRA run must be able to express a confident answer: an untied head
  # (initialized at 1/sqrt(d)), not the tied embedding's 0.02 scale.
  cfg = dataclasses.replace(CFG, tie_embeddings=False) if lora_rank else CFG
  learner = Learner(Transformer(cfg, nnx.Rngs(0)), opts, mesh(), temperature=1.0, max_seq_len=16)
  rng, key = np.random.default_rng(0), jax.random.key(0)
  history, t0 = [], time.time()
  for step in range(400):
    key, sub = jax.random.split(key)
    groups, rewards = rollout(learner, rng, sub, groups=32, n=16)
    history.append(float(np.mean(rewards)))
    m = learner.train_step(groups, rewards)
    # On-policy batches: the sampler's and the learner's logprobs agree (same alignment, same T).
    assert abs(m["behav_weight_max"] - 1.0) < 1e-3, m
    if step % 10 == 0:
      print(step, round(time.time() - t0, 1), history[-1], round(m["entropy"], 3), flush=True)
    if len(history) >= 5 and np.mean(history[-5:]) >= 0.95:
      break
  print(f"{step + 1} steps, {time.time() - t0:.1f} s, reward {history[0]:.3f} -> {history[-1]:.3f}")
  assert history[0] < 0.15  # chance
  assert np.mean(history[-5:]) >= 0.9, history[-20:]
