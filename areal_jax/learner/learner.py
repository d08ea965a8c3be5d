"""The learner: a batch of finished groups in, a new policy version out.

``train_step(groups, rewards)``:
  1. advantages per sequence (group normalization, optional batch normalization);
  2. pack all sequences into rows (segment ids, restarting positions);
  3. recompute the proximal logprobs with one forward pass of the current parameters;
  4. ``ppo_n_minibatches`` optimizer updates, each accumulating gradients over micro-batches that
     fit the ``micro_batch_tokens`` budget (``lax.scan`` inside one jitted function).
Parameters and optimizer state live on the learner mesh with shardings from the logical axes; the
state is donated. A non-finite loss or gradient leaves the parameters untouched and raises.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import sharding
from areal_jax.learner import advantages as adv_lib
from areal_jax.learner import loss as loss_lib
from areal_jax.learner import packing
from areal_jax.models import Transformer
from areal_jax.rollout_api import Sample

_BATCH_FIELDS = ("tokens", "positions", "segment_ids", "seq", "mask", "behav_logp", "adv")


def make_optimizer(opts, total_steps: int = 0) -> optax.GradientTransformation:
  """AdamW with global-norm clipping; the schedule counts optimizer updates (steps x minibatches)."""
  total = max(total_steps, 1) * opts.ppo_n_minibatches
  warm = opts.warmup_steps * opts.ppo_n_minibatches
  if opts.lr_schedule == "constant":
    lr = optax.join_schedules([optax.linear_schedule(0.0, opts.lr, max(warm, 1)),
                               optax.constant_schedule(opts.lr)], [warm]) if warm else opts.lr
  elif opts.lr_schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, opts.lr, warm, max(total, warm + 1))
  else:
    lr = optax.join_schedules([optax.linear_schedule(0.0, opts.lr, max(warm, 1)),
                               optax.linear_schedule(opts.lr, 0.0, max(total - warm, 1))], [warm])
  parts = [optax.clip_by_global_norm(opts.grad_clip)] if opts.grad_clip else []
  parts.append(optax.adamw(lr, b1=opts.b1, b2=opts.b2, weight_decay=opts.weight_decay))
  return optax.chain(*parts)


class Learner:
  """Trains the policy on the learner mesh; ``params()`` is what gets published to the sampler."""

  def __init__(self, model: Transformer, opts, mesh, temperature: float = 1.0, rules=None,
               total_steps: int = 0, max_seq_len: int = 0):
    """``max_seq_len`` (prompt + completion) fixes the packed row length, so that the train step
    compiles for a few row counts only; sequences longer than it still work (a larger bucket)."""
    self.opts, self.mesh, self.rules, self.temperature = opts, mesh, rules, float(temperature)
    self.max_seq_len = max_seq_len
    cfg = dataclasses.replace(model.cfg, dtype=opts.dtype)
    self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    state = nnx.state(model, nnx.Param)
    self.param_shardings = nnx.to_pure_dict(sharding.state_shardings(state, mesh, rules))
    params = jax.device_put(nnx.to_pure_dict(state), self.param_shardings)
    self.dp = mesh.shape["data"] * mesh.shape["fsdp"]
    self.row_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    self.tx = make_optimizer(opts, total_steps)
    opt_state = jax.jit(self.tx.init)(params)
    replicated = NamedSharding(mesh, P())
    opt_shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, opt_state)
    opt_state = jax.device_put(opt_state, opt_shardings)
    self.state_shardings = dict(params=self.param_shardings, opt=opt_shardings, step=replicated)
    self._state = dict(params=params, opt=opt_state, step=jax.device_put(
        jnp.zeros((), jnp.int32), self.state_shardings["step"]))
    self.ref_params = jax.tree.map(jnp.copy, params) if opts.kl_coef else None
    self.version = 0
    self._logp_fn = jax.jit(self._logprobs, static_argnames=("micro",))
    micro_sharding = NamedSharding(mesh, P(None, ("data", "fsdp")))  # [M, R, L]: rows sharded
    self._update_fn = jax.jit(self._update, donate_argnums=(0,), static_argnums=(3,),
                              in_shardings=(self.state_shardings, micro_sharding,
                                            self.param_shardings if opts.kl_coef else None),
                              out_shardings=(self.state_shardings, None))

  # ---- state -----------------------------------------------------------------------------------
  @property
  def state(self) -> dict:
    """Parameters, optimizer state and step: the checkpointed pytree."""
    return self._state

  def load_state(self, state: dict) -> None:
    self._state = jax.device_put(state, self.state_shardings)
    self.version = int(self._state["step"])

  def params(self) -> dict:
    """The current parameters (NNX pure dict on the learner mesh)."""
    return self._state["params"]

  # ---- device functions ------------------------------------------------------------------------
  def _forward_logp(self, params, b):
    with sharding.use(self.mesh, self.rules):
      logits = nnx.merge(self.graphdef, params)(b["tokens"], b["positions"], b["segment_ids"])
      return loss_lib.token_logprobs(logits, b["tokens"], self.temperature)

  def _logprobs(self, params, batch, micro: int):
    """Logprobs of every row, ``micro`` rows at a time (bounded activation memory)."""
    split = jax.tree.map(lambda x: x.reshape(-1, micro, *x.shape[1:]), batch)
    logp = jax.lax.map(lambda b: self._forward_logp(params, b)[0], split)
    return logp.reshape(batch["tokens"].shape)

  def _update(self, state, batch_MxRxL, ref_params, num_seqs: int):
    """One optimizer update from micro-batches ``[M, R, L]`` (gradients accumulated by scan)."""
    params, opts = state["params"], self.opts
    n_tokens = jnp.sum(batch_MxRxL["mask"])

    def micro_loss(p, b):
      logp, entropy = self._forward_logp(p, b)
      ref = None
      if ref_params is not None:
        ref = jax.lax.stop_gradient(self._forward_logp(ref_params, b)[0])
      loss, m = loss_lib.ppo_loss(logp, b["old_logp"], b["behav_logp"], b["adv"], b["mask"],
                                  b["seq"], n_tokens, opts, num_seqs, ref_logp=ref)
      m["entropy"] = jnp.sum(b["mask"] * jax.lax.stop_gradient(entropy)) / jnp.maximum(n_tokens, 1)
      return loss, m

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def body(acc, b):
      (_, m), g = grad_fn(params, b)
      g_acc, m_acc = acc
      m_acc = {k: (jnp.maximum(m_acc[k], v) if k == "behav_weight_max" else m_acc[k] + v)
               for k, v in m.items()}
      return (jax.tree.map(jnp.add, g_acc, g), m_acc), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    m0 = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], batch_MxRxL))[0][1])
    m0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m0)
    (grads, metrics), _ = jax.lax.scan(body, (zeros, m0), batch_MxRxL)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    updates, new_opt = self.tx.update(grads, state["opt"], params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = dict(params=keep(new_params, params), opt=keep(new_opt, state["opt"]),
                     step=state["step"] + finite.astype(jnp.int32))
    metrics.update(grad_norm=grad_norm, finite=finite)
    return new_state, metrics

  # ---- host side -------------------------------------------------------------------------------
  def build_sequences(self, groups: Sequence[Sequence[Sample]], rewards) -> list[packing.Seq]:
    opts = self.opts
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
      raise ValueError(f"all groups must have the same number of samples, got sizes {sorted(sizes)}")
    adv = adv_lib.group_advantages(np.asarray(rewards, np.float64), opts)
    flat = [s for g in groups for s in g]
    adv = adv.reshape(-1)
    if opts.batch_adv_norm:
      adv = adv_lib.batch_normalize(adv, [max(len(s.tokens), 1) for s in flat], opts.adv_eps)
    return [packing.Seq(list(s.prompt_tokens) + list(s.tokens), len(s.prompt_tokens),
                        list(s.logprobs), float(a)) for s, a in zip(flat, adv) if s.tokens]

  def _layout(self, seqs: list[packing.Seq]):
    """Row length, rows per micro-batch, and micro-batches per minibatch (all bucketed)."""
    longest = max(len(s.tokens) for s in seqs)
    row_len = packing.bucket(max(longest, min(self.max_seq_len, self.opts.micro_batch_tokens)))
    rows = packing.assign_rows([len(s.tokens) for s in seqs], row_len) if self.opts.pack_sequences \
        else [[i] for i in range(len(seqs))]
    n_mb = self.opts.ppo_n_minibatches
    micro_rows = max(self.dp, self.opts.micro_batch_tokens // row_len // self.dp * self.dp)
    per_mb = math.ceil(len(rows) / n_mb)
    micro_rows = min(micro_rows, packing.bucket(math.ceil(per_mb / self.dp), 1) * self.dp)
    n_micro = packing.bucket(math.ceil(per_mb / micro_rows), 1)
    return row_len, rows, micro_rows, n_micro

  def train_step(self, groups: Sequence[Sequence[Sample]], rewards) -> dict:
    """Trains version ``v`` into ``v + 1`` on ``groups`` (lists of Samples) with their rewards."""
    t0 = time.time()
    seqs = self.build_sequences(groups, rewards)
    if not seqs:
      raise ValueError(f"step {self.version}: the batch has no generated tokens")
    row_len, rows, micro_rows, n_micro = self._layout(seqs)
    n_mb = self.opts.ppo_n_minibatches
    total_rows = n_mb * n_micro * micro_rows
    # Minibatches are contiguous runs of rows; rows are spread so each minibatch gets its share.
    order = [rows[i] for i in range(len(rows))]
    mb_rows = [order[k::n_mb] for k in range(n_mb)]
    padded = []
    for k in range(n_mb):
      padded += mb_rows[k] + [[] for _ in range(n_micro * micro_rows - len(mb_rows[k]))]
    packed = packing.pack(seqs, row_len, rows=padded, num_rows=total_rows)
    batch = {f: jax.device_put(getattr(packed, f), self.row_sharding) for f in _BATCH_FIELDS}
    prox = self._logp_fn(self._state["params"], batch, micro=micro_rows)
    batch["old_logp"] = prox if self.opts.recompute_logprobs else batch["behav_logp"]
    sums, maxes = {}, {}
    for k in range(n_mb):
      sl = slice(k * n_micro * micro_rows, (k + 1) * n_micro * micro_rows)
      mb = {f: v[sl].reshape(n_micro, micro_rows, row_len) for f, v in batch.items()}
      self._state, m = self._update_fn(self._state, mb, self.ref_params, len(seqs))
      m = jax.device_get(m)
      if not m.pop("finite"):
        raise FloatingPointError(
            f"step {self.version} (minibatch {k}): non-finite loss {m['loss']} or gradient norm "
            f"{m['grad_norm']}; the update was skipped and nothing is published")
      for key, v in m.items():
        if key == "behav_weight_max":
          maxes[key] = max(maxes.get(key, 0.0), float(v))
        else:
          sums[key] = sums.get(key, 0.0) + float(v) / n_mb
    self.version += 1
    return dict(sums, **maxes, tokens=packed.real_tokens, padding_efficiency=packed.efficiency,
                rows=total_rows, row_len=row_len, train_s=time.time() - t0)
