"""Shared pieces of the learner tests: a tiny model, actor configs, random batches."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax import config as config_lib
from areal_jax import sharding
from areal_jax.models.transformer import ModelConfig, Transformer
from areal_jax.rollout_api import Sample

V = 32
CFG = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64)


def actor(**kw):
  a = copy.deepcopy(config_lib.base_config().actor)
  a.lr = 1e-3
  a.micro_batch_tokens = 4096
  for k, v in kw.items():
    a[k] = v
  return a


def mesh(n=1, **axes):
  return sharding.make_mesh(axes or dict(fsdp=n), jax.devices()[:n])


def model():
  return Transformer(CFG, nnx.Rngs(0))


def chat_bytes(messages):
  """A conversation as byte tokens of the tiny model's vocabulary, with a turn marker (an encoder
  for the OPD teacher's hinted prompts without a tokenizer)."""
  text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
  return [b % V for b in text.encode()]


def batch(seed, groups=4, n=4, max_prompt=6, max_new=9):
  rng = np.random.default_rng(seed)
  out, rewards = [], []
  for g in range(groups):
    prompt = rng.integers(0, V, rng.integers(1, max_prompt)).tolist()
    samples = []
    for i in range(n):
      toks = rng.integers(0, V, rng.integers(1, max_new)).tolist()
      samples.append(Sample(g, i, prompt, toks, rng.normal(-3.4, 0.3, len(toks)).tolist(),
                            [0] * len(toks), "eos"))
    out.append(samples)
    rewards.append(rng.integers(0, 2, n).astype(float).tolist())
  return out, rewards


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logsoftmax(graphdef, params, tokens_BxL, temperature):
  return jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens_BxL) / temperature, -1)


def token_logps(learner, samples):
  """Per-token log softmax(logits / T) of each completion, by a plain unpacked forward."""
  rows = [list(s.prompt_tokens) + list(s.tokens) for s in samples]
  width = max(map(len, rows))
  toks = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
  lp = np.asarray(_logsoftmax(learner.graphdef, learner.merged_params(), toks,
                              learner.temperature))
  return [[float(lp[i, t - 1, r[t]]) for t in range(len(s.prompt_tokens), len(r))]
          for i, (s, r) in enumerate(zip(samples, rows))]


def assert_trees_close(a, b, rtol=2e-4, atol=1e-6):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))
