"""The floor ``bench/sampler.py`` states our decode step against: a plain-JAX dense decode loop.

Nothing but what a decode step must do: weights stacked ``[layers, ...]`` in the compute dtype and
read once per step, layers in a ``lax.scan``, a dense KV cache ``[layers, slots, T, kv_heads, D]``
written at the step's position and read densely (masked past it), rotary embedding, greedy argmax,
``steps`` decode steps per jitted call. Random weights; every slot at the same position.
``fused``: q/k/v as one weight and gate/up as one (the layout our GPU/TPU sampler holds), so the
floor does not leave XLA's GPU compiler sibling matmuls to merge by concatenating their weights in
every step (its DotMerger pass); the default keeps them separate, as a plain decode loop would.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from areal_jax.models import ModelConfig


def _rms(x, scale, eps):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def _rope(x_SxHxD, pos, theta):
  half = x_SxHxD.shape[-1] // 2
  angles = pos * (1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = x_SxHxD[..., :half].astype(jnp.float32), x_SxHxD[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_SxHxD.dtype)


def make(cfg: ModelConfig, slots: int, max_len: int, dtype, steps: int = 16, fused: bool = False,
         compiler_options: dict | None = None):
  """``(run, state)``: ``run(state) -> state`` advances every slot by ``steps`` tokens (the weights
  bound as the jitted loop's first argument), compiled with ``compiler_options`` (XLA's, e.g. the
  GEMM choice our engine's programs get)."""
  n, e, h, kv, d, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  shapes = {"q": (n, e, h * d), "k": (n, e, kv * d), "v": (n, e, kv * d), "o": (n, h * d, e),
            "gate": (n, e, f), "up": (n, e, f), "down": (n, f, e)}
  if fused:
    shapes = {"qkv": (n, e, (h + 2 * kv) * d), "o": (n, h * d, e), "gate_up": (n, e, 2 * f),
              "down": (n, f, e)}
  keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
  w = {name: (jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5).astype(dtype)
       for k, (name, s) in zip(keys, shapes.items())}
  w["n1"] = w["n2"] = jnp.ones((n, e), jnp.float32)
  embed = (jax.random.normal(keys[-1], (cfg.vocab_size, e), jnp.float32) * 0.02).astype(dtype)

  def project(y, lw):  # q, k, v and gate, up: three and two matmuls, or one and one
    if not fused:
      return (y @ lw["q"], y @ lw["k"], y @ lw["v"]), lambda z: (z @ lw["gate"], z @ lw["up"])
    qkv = y @ lw["qkv"]
    return ((qkv[:, :h * d], qkv[:, h * d:(h + kv) * d], qkv[:, (h + kv) * d:]),
            lambda z: tuple(jnp.split(z @ lw["gate_up"], 2, axis=-1)))

  def layer(carry, lw):
    x, pos, ck, cv, i = carry
    y = _rms(x, lw["n1"], cfg.norm_eps)
    (q, k, v), mlp_in = project(y, lw)
    q = _rope(q.reshape(slots, kv, h // kv, d), pos, cfg.rope_theta)
    k = _rope(k.reshape(slots, 1, kv, d), pos, cfg.rope_theta)
    ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (i, 0, pos, 0, 0))
    cv = jax.lax.dynamic_update_slice(cv, v.reshape(1, slots, 1, kv, d), (i, 0, pos, 0, 0))
    s = jnp.einsum("skgd,stkd->skgt", q, ck[i], preferred_element_type=jnp.float32) * d**-0.5
    s = jnp.where(jnp.arange(max_len) <= pos, s, -jnp.inf)
    a = jnp.einsum("skgt,stkd->skgd", jax.nn.softmax(s, -1).astype(dtype), cv[i])
    x = x + a.reshape(slots, h * d) @ lw["o"]
    gate, up = mlp_in(_rms(x, lw["n2"], cfg.norm_eps))
    x = x + (jax.nn.silu(gate) * up) @ lw["down"]
    return (x, pos, ck, cv, i + 1), None

  def step(_, state, weights):
    w, embed = weights
    tokens, pos, ck, cv = state
    (x, _, ck, cv, _), _ = jax.lax.scan(layer, (embed[tokens], pos, ck, cv, 0), w)
    logits = _rms(x, 1.0, cfg.norm_eps) @ embed.T
    return jnp.argmax(logits, -1).astype(jnp.int32), pos + 1, ck, cv

  # the weights are the program's arguments: closed over, they would be constants in its HLO
  # (3 GB of them at the Qwen2.5-1.5B shape, for XLA to compile into the program)
  loop = jax.jit(lambda weights, state: jax.lax.fori_loop(0, steps, lambda i, st: step(
      i, st, weights), state), donate_argnums=1, compiler_options=compiler_options)
  run = functools.partial(loop, (w, embed))
  cache = lambda: jnp.zeros((n, slots, max_len, kv, d), dtype)
  return run, (jnp.ones((slots,), jnp.int32), jnp.int32(0), cache(), cache())


def step_ms(cfg: ModelConfig, slots: int, context: int, dtype, steps: int = 16, reps: int = 3,
            fused: bool = False, compiler_options: dict | None = None):
  """Best milliseconds per decode step of the floor loop, ``slots`` slots from position ``context``."""
  run, state = make(cfg, slots, context + steps * (reps + 2), dtype, steps, fused, compiler_options)
  tokens, _, ck, cv = state
  state = jax.block_until_ready(run((tokens, jnp.int32(context), ck, cv)))
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    state = jax.block_until_ready(run(state))
    best = min(best, (time.perf_counter() - t0) / steps)
  return best * 1e3
