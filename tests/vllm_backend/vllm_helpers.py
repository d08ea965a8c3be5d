"""Helpers of the vLLM backend tests: the tiny vLLM-compatible model and reference logprobs."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax import models
from areal_jax.vllm_rollout import lifeline

STOP_WAIT_S = 60.0  # a server's SIGTERM-to-SIGKILL grace (30 s) and then some


def tiny_hd32_config(tokenizer):
  """The tiny preset resized to a head_dim vLLM's CPU attention supports (32)."""
  return dataclasses.replace(models.tiny_config(tokenizer), d_model=128, n_heads=4, n_kv_heads=2,
                             head_dim=32, d_ff=256)


def pure(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _logits(model, sample):
  prompt, tokens = list(sample.prompt_tokens), list(sample.tokens)
  return model(jnp.asarray([prompt + tokens]))[0, len(prompt) - 1:-1].astype(jnp.float32)


def teacher_forced(model, sample, temperature=1.0):
  """``log softmax(logits / T)`` of ``model`` at every generated token of ``sample``."""
  logp = jax.nn.log_softmax(_logits(model, sample) / temperature, axis=-1)
  return np.asarray(logp[jnp.arange(len(sample.tokens)), jnp.asarray(sample.tokens)])


def top_k_mass(model, sample, k, temperature=1.0):
  """Probability mass of the ``k`` most likely tokens at every generated position."""
  p = jax.nn.softmax(_logits(model, sample) / temperature, axis=-1)
  return np.asarray(jnp.sum(jax.lax.top_k(p, k)[0], axis=-1))


def collect(engine, count, timeout=300.0):
  """Polls until ``count`` samples arrived; returns them sorted by (group, index)."""
  got, deadline = [], time.time() + timeout
  while len(got) < count:
    if time.time() > deadline:
      raise TimeoutError(f"{len(got)} of {count} samples after {timeout} s")
    got += engine.poll(timeout=1.0)
  return sorted(got, key=lambda s: (s.group_id, s.index))


def wait_for_tokens(engine, group_ids, at_least, timeout=120.0):
  """Blocks until every running sequence of ``group_ids`` has ``at_least`` tokens (in-process)."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    seqs = [s for s in list(engine._running.values()) if s.group.request.group_id in group_ids]
    if seqs and min(len(s.tokens) for s in seqs) >= at_least:
      return
    time.sleep(0.01)
  raise TimeoutError(f"sequences of {group_ids} did not reach {at_least} tokens")


def group_gone(pgid: int, timeout: float = STOP_WAIT_S) -> bool:
  """Whether every process of group ``pgid`` (a server's) is gone within ``timeout`` seconds."""
  deadline = time.time() + timeout
  while lifeline.group_members(pgid) and time.time() < deadline:
    time.sleep(0.2)
  return not lifeline.group_members(pgid)
