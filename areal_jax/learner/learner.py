"""The learner: a batch of finished groups in, a new policy version out.

``train_step(groups, rewards)``:
  1. advantages per sequence (group normalization, optional batch normalization);
  2. split the sequences into ``ppo_n_minibatches`` minibatches, pack each into rows (segment ids,
     restarting positions) and cut the rows into micro-batches of ``micro_batch_tokens``;
  3. recompute the proximal logprobs (and the reference model's, with a KL penalty) with one
     forward pass of the current parameters over every micro-batch; for the first minibatch the
     proximal policy *is* the current parameters, so its logprobs come for free from the update's
     own forward (without gradient) unless a reference forward runs anyway;
  4. per minibatch, accumulate gradients over its micro-batches, then one AdamW update.

Three jitted functions do the device work, each with explicit shardings on the learner mesh: the
logprob forward, ``accumulate`` (grads and metric sums, donated) and ``apply`` (the optimizer
update, with the training state donated). Their shapes depend only on the bucketed row length and
rows per micro-batch, never on the number of sequences or micro-batches, and a shape already
compiled is reused when it costs little more (``packing.plan``'s ``known``), so steady state does
not recompile (``compiles`` in the step's metrics counts it). The forward is
``models.train_forward.hidden`` (``actor.remat``, ``actor.scan_layers``, ``actor.attention``: on
GPU and TPU a flash kernel, which holds no ``L x L`` scores of a row) followed by the LM head in
chunks (``head.py``, ``actor.logits_chunk``); ``memory.py`` plans the step's device memory.
An update whose loss or gradient is not finite is not applied: the parameters stay
those of the last good update and ``train_step`` raises ``FloatingPointError`` naming the step.

With ``actor.lora`` (rank > 0) the trained parameters are LoRA adapters (``models.lora``): the base
weights are frozen, stored once in the compute dtype and passed to the device functions beside the
adapters; ``params()``, the optimizer state and the checkpointed state hold only the adapters, so
publishing a version moves only them. ``merged_params()`` gives the full merged weights.
"""

from __future__ import annotations

import dataclasses
import functools
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
from areal_jax.learner import compiles, distill, head
from areal_jax.learner import loss as loss_lib
from areal_jax.learner import packing
from areal_jax.models import Transformer, train_forward
from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import Sample


def make_schedule(opts, total_steps: int = 0) -> optax.Schedule:
  """Learning rate per optimizer update (train steps x ``ppo_n_minibatches``), with linear warmup."""
  n_mb = opts.ppo_n_minibatches
  total, warm = max(total_steps, 1) * n_mb, opts.warmup_steps * n_mb
  if opts.lr_schedule == "constant":
    if not warm:
      return optax.constant_schedule(opts.lr)
    return optax.join_schedules([optax.linear_schedule(0.0, opts.lr, warm),
                                 optax.constant_schedule(opts.lr)], [warm])
  if opts.lr_schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, opts.lr, warm, max(total, warm + 1))
  if opts.lr_schedule == "linear":
    return optax.join_schedules([optax.linear_schedule(0.0, opts.lr, max(warm, 1)),
                                 optax.linear_schedule(opts.lr, 0.0, max(total - warm, 1))], [warm])
  raise ValueError(f"actor.lr_schedule={opts.lr_schedule!r} is not one of constant, cosine, linear")


def make_optimizer(opts, total_steps: int = 0) -> optax.GradientTransformation:
  """AdamW with global-norm gradient clipping (``grad_clip`` 0 disables it)."""
  parts = [optax.clip_by_global_norm(opts.grad_clip)] if opts.grad_clip else []
  parts.append(optax.adamw(make_schedule(opts, total_steps), b1=opts.b1, b2=opts.b2,
                           weight_decay=opts.weight_decay))
  return optax.chain(*parts)


class Learner:
  """Trains the policy on the learner mesh; ``params()`` is what gets published to the sampler.

  Args:
    model: the initial policy (its parameters are copied onto the learner mesh; with
      ``kl_coef > 0`` they are also kept, frozen, as the reference model).
    opts: the ``actor`` config.
    mesh: the learner mesh (axes data, fsdp, context, tensor); rows are split over data x fsdp,
      each row's positions over context (context parallelism: attention across the devices,
      ``kernels.context_attention``), parameters by their logical axes (``rules``, default
      ``sharding.DEFAULT_RULES``).
    temperature: the sampling temperature (logprobs are those of ``softmax(logits / T)``).
    total_steps: train steps of the run (for decaying learning-rate schedules).
    max_seq_len: prompt + completion budget; fixes the packed row length (capped by
      ``micro_batch_tokens``) so the train step compiles for few shapes. Longer sequences still
      work (in a larger row bucket).
  """

  def __init__(self, model: Transformer, opts, mesh, temperature: float = 1.0, rules=None,
               total_steps: int = 0, max_seq_len: int = 0, distill_topk: int | None = None):
    state = nnx.state(model, nnx.Param)
    # None: no teacher; 0: per-token teacher logprobs; k: the teacher's top k (distill.py)
    self.distill_topk = distill_topk
    self._setup(model.cfg, state, opts, mesh, temperature, rules, total_steps, max_seq_len)
    if self.lora is None:
      params = sharding.put(nnx.to_pure_dict(state), self.param_shardings)
    else:  # eager casts: a base already in the compute dtype and placed is used as is, not copied
      base = sharding.put(nnx.to_pure_dict(state), self.frozen_shardings)
      self.frozen = sharding.put(lora_lib.frozen_base(base, self.cfg.compute_dtype),
                                 self.frozen_shardings)
      params = sharding.put(lora_lib.init_adapters(self.frozen, self.lora, jax.random.key(0)),
                            self.param_shardings)
    opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt"])(params)
    put = lambda x: sharding.put(np.int32(x), self.replicated)
    self._state = dict(params=params, opt=opt_state, step=put(0), version=put(0))
    self.ref_params = jax.tree.map(jnp.copy, params) if opts.kl_coef else None

  @classmethod
  def abstract(cls, cfg, opts, mesh, temperature: float = 1.0, rules=None, max_seq_len: int = 0):
    """A learner without parameters, for planning (``memory.py``): its device functions can be
    lowered and compiled on ``abstract_state()`` shapes, no weights allocated."""
    self = cls.__new__(cls)
    self.distill_topk = None
    state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
    self._setup(cfg, state, opts, mesh, temperature, rules, 0, max_seq_len)
    self._state = self.ref_params = None
    return self

  def _setup(self, cfg, state, opts, mesh, temperature, rules, total_steps, max_seq_len):
    """Everything but the parameter values: shapes, shardings, optimizer, device functions."""
    if opts.use_decoupled_loss and not opts.recompute_logprobs:
      raise ValueError("actor.use_decoupled_loss=True requires actor.recompute_logprobs=True")
    if temperature <= 0:
      raise ValueError(f"temperature={temperature} must be > 0")
    self.opts, self.mesh, self.rules, self.temperature = opts, mesh, rules, float(temperature)
    self.max_seq_len = int(max_seq_len)
    self.cfg = dataclasses.replace(cfg, dtype=opts.dtype)
    self._attn_cost = packing.attention_cost(self.cfg)  # of a row's length, in the layout plan
    self.graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(self.cfg, nnx.Rngs(0))))
    self.param_shardings = sharding.param_shardings(state, mesh, rules)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          nnx.to_pure_dict(state))
    self.lora = lora_lib.LoraConfig.from_config(opts.get("lora"))
    self.frozen, self.frozen_shardings = None, None
    if self.lora is not None:  # train adapters (replicated: they are small) on a frozen base
      self.frozen_shardings = self.param_shardings
      frozen = jax.eval_shape(lambda p: lora_lib.frozen_base(p, self.cfg.compute_dtype), shapes)
      # abstract until __init__ places the real base (``abstract()`` plans with these)
      self.frozen = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                 frozen, self.frozen_shardings)
      shapes = jax.eval_shape(lambda: lora_lib.init_adapters(frozen, self.lora, jax.random.key(0)))
      self.param_shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), shapes)
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    self.dp = mesh.shape["data"] * mesh.shape["fsdp"]
    self.context = mesh.shape.get("context", 1)  # devices each row's positions are split over
    self.replicated = NamedSharding(mesh, P())
    self.row_sharding = NamedSharding(mesh, P(("data", "fsdp"),
                                              "context" if self.context > 1 else None))
    self.schedule = make_schedule(opts, total_steps)
    self.tx = make_optimizer(opts, total_steps)
    opt_shapes = jax.eval_shape(self.tx.init, shapes)
    opt_shardings = optax.tree_utils.tree_map_params(
        self.tx, lambda _, s: s, opt_shapes, self.param_shardings,
        transform_non_params=lambda _: self.replicated)
    self.state_shardings = dict(params=self.param_shardings, opt=opt_shardings,
                                step=self.replicated, version=self.replicated)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    self._abstract = jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
        dict(params=shapes, opt=opt_shapes, step=scalar, version=scalar), self.state_shardings)
    self._shapes: set[tuple[int, int]] = set()  # (row_len, micro_rows) compiled so far
    self._build_fns()

  def abstract_state(self) -> dict:
    """The training state as ``ShapeDtypeStruct``s carrying their shardings."""
    return self._abstract

  # ---- state -----------------------------------------------------------------------------------
  @property
  def state(self) -> dict:
    """Parameters, optimizer state, optimizer step and policy version: the checkpointed pytree."""
    return self._state

  def load_state(self, state: dict) -> None:
    """Restores a ``state`` pytree (e.g. from Orbax) onto the learner mesh.

    A state without ``version`` (written before it was added) takes ``step // ppo_n_minibatches``.
    """
    state = dict(state)
    if "version" not in state:
      state["version"] = np.int32(int(state["step"]) // self.opts.ppo_n_minibatches)
    self._state = sharding.put(state, self.state_shardings)
    self._check_finite_params()

  @property
  def version(self) -> int:
    """The policy version of the current parameters (train steps done)."""
    return int(self._state["version"])

  def merged_params(self) -> dict:
    """The full model parameters (with LoRA: the base with the adapters merged, in the compute
    dtype; otherwise ``params()``)."""
    if self.lora is None:
      return self.params()
    return self._merge_fn(self.frozen, self.params())

  def params(self) -> dict:
    """The current trained parameters (with LoRA: the adapters), an NNX pure dict on the learner
    mesh.

    The buffers are donated to the next ``train_step``: copy them (``device_put`` onto the sampler
    mesh, ``device_get``, or an Orbax save that completes) before training again.
    """
    return self._state["params"]

  @property
  def _frozen_args(self) -> tuple:
    """The frozen base as the last argument of every device function (with LoRA), else ()."""
    return () if self.frozen is None else (self.frozen,)

  # ---- device functions ------------------------------------------------------------------------
  def _build_fns(self):
    ps, rs, rep = self.param_shardings, self.row_sharding, self.replicated
    batch_sh = {f: rs for f in packing.FIELDS}
    metric_sh = {k: rep for k in loss_lib.METRIC_SUMS + loss_lib.METRIC_MAXES}
    self._acc_shardings = dict(grads=ps, metrics=metric_sh)
    kl = bool(self.opts.kl_coef)
    # with LoRA every device function takes the frozen base as one more, last, argument
    fs = () if self.frozen is None else (self.frozen_shardings,)
    if self.lora is not None:
      self._merge_fn = jax.jit(functools.partial(lora_lib.merge, lcfg=self.lora),
                               out_shardings=self.frozen_shardings)
    if kl:
      self._logp_fn = jax.jit(self._logprobs, in_shardings=(ps, batch_sh, ps, *fs),
                              out_shardings=(rs, rs))
    else:
      self._logp_fn = jax.jit(lambda p, b, *frozen: self._logprobs(p, b, None, *frozen),
                              in_shardings=(ps, batch_sh, *fs), out_shardings=(rs, rs))
    train_sh = dict(batch_sh, old_logp=rs, **({"ref_logp": rs} if kl else {}),
                    **{f: rs for f in distill.fields(self.distill_topk)})
    self._zeros_fn = jax.jit(self._zeros, out_shardings=self._acc_shardings)
    acc_jit = lambda self_prox, sh: jax.jit(
        functools.partial(self._accumulate, self_prox=self_prox), donate_argnums=(1,),
        in_shardings=(ps, self._acc_shardings, sh, rep, *fs), out_shardings=self._acc_shardings)
    self._acc_fn = acc_jit(False, train_sh)
    self._acc_self_fn = acc_jit(True, {k: v for k, v in train_sh.items() if k != "old_logp"})
    self._apply_fn = jax.jit(self._apply, donate_argnums=(0,),
                             in_shardings=(self.state_shardings, ps, rep),
                             out_shardings=(self.state_shardings, dict(grad_norm=rep, finite=rep)))

  def _forward(self, params, b, frozen=None, dropout_key=None, topk=False):
    """``(logp_RxL, entropy_RxL)`` of the tokens of packed rows ``b`` under ``params`` (with LoRA:
    the adapters on the ``frozen`` base; ``dropout_key`` draws the adapters' dropout masks);
    ``topk``: also the logprobs of ``b["topk_ids"]`` when the batch has them (distill.py)."""
    opts = self.opts
    with sharding.use(self.mesh, self.rules):
      if frozen is not None:
        params = lora_lib.wrap(frozen, params, self.lora, dropout_key)
      model = nnx.merge(self.graphdef, params)
      h_RxLxE = train_forward.hidden(model, b["tokens"], b["positions"], b["segment_ids"],
                                     remat=opts.remat, scan=opts.scan_layers,
                                     attention=opts.get("attention", "auto"),
                                     context_attention=opts.get("context_attention", "auto"))
      w, transpose_w = train_forward.head_weight(model)
      return head.token_logprobs(h_RxLxE, w, transpose_w, b["tokens"], self.temperature,
                                 opts.logits_chunk, b.get("topk_ids") if topk else None)

  def _logprobs(self, params, batch, ref_params=None, frozen=None):
    """Proximal logprobs and entropy of one micro-batch, or proximal and reference logprobs."""
    prox, entropy = self._forward(params, batch, frozen)
    if ref_params is None:
      return prox, entropy
    return prox, self._forward(ref_params, batch, frozen)[0]

  def _zeros(self):
    shapes = self._abstract["params"]
    grads = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
    return dict(grads=grads, metrics={k: jnp.zeros((), jnp.float32) for k in
                                      loss_lib.METRIC_SUMS + loss_lib.METRIC_MAXES})

  def _accumulate(self, params, acc, b, n_tokens, frozen=None, *, self_prox: bool):
    """Adds the gradient and metric sums of micro-batch ``b`` to ``acc``.

    ``self_prox``: the proximal policy is ``params`` itself (the first update of a step), so its
    logprobs are this forward's, without gradient, instead of a separate recomputation.
    """

    key = None
    if self.lora is not None and self.lora.dropout:  # a fresh mask per micro-batch and position
      key = jax.random.fold_in(jax.random.key(1),
                               jnp.sum(b["tokens"] * (b["positions"] + 1)).astype(jnp.uint32))

    def loss_fn(p):
      logp, entropy, *topk = self._forward(p, b, frozen, key, topk=True)
      old = jax.lax.stop_gradient(logp) if self_prox else b["old_logp"]
      adv, distill_loss = distill.terms(b, old, *topk, n_tokens=n_tokens)  # (teacher: distill.py)
      loss, m = loss_lib.ppo_loss(logp, old, b["behav_logp"], adv, b["mask"],
                                  b["segment_ids"], n_tokens, self.opts, ref_logp=b.get("ref_logp"))
      loss = m["loss"] = loss + distill_loss
      m["entropy"] = jnp.sum(b["mask"] * entropy) / jnp.maximum(n_tokens, 1.0)
      return loss, m

    (_, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc["grads"], g)
    metrics = {k: (jnp.maximum(v, m[k]) if k in loss_lib.METRIC_MAXES else v + m[k])
               for k, v in acc["metrics"].items()}
    return dict(grads=grads, metrics=metrics)

  def _apply(self, state, grads, loss):
    """One AdamW update; skipped entirely (state unchanged) if the loss or gradient is not finite."""
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = self.tx.update(grads, state["opt"], state["params"])
    new_params = optax.apply_updates(state["params"], updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = dict(params=keep(new_params, state["params"]), opt=keep(new_opt, state["opt"]),
                     step=state["step"] + finite.astype(jnp.int32), version=state["version"])
    return new_state, dict(grad_norm=grad_norm, finite=finite)

  # ---- host side -------------------------------------------------------------------------------
  def build_sequences(self, groups: Sequence[Sequence[Sample]], rewards) -> tuple[list, dict]:
    """Training sequences (with advantages) of the non-empty samples, and batch statistics.

    A multi-turn sample (``Sample.loss_mask``) is one sequence, its advantage that of the whole
    episode; the tokens its environment inserted are context (mask 0). Batch advantage
    normalization weights a sequence by its trained (mask 1) tokens.
    """
    if len(groups) != len(rewards):
      raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
    if not groups:
      raise ValueError(f"step {self.version}: empty batch")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
      raise ValueError(f"all groups must have the same number of samples, got sizes {sorted(sizes)}")
    for i, (g, r) in enumerate(zip(groups, rewards)):
      if len(g) != len(r):
        raise ValueError(f"group {i}: {len(g)} samples but {len(r)} rewards")
    r_GxN = np.asarray(rewards, np.float64)
    if not np.all(np.isfinite(r_GxN)):
      raise ValueError(f"step {self.version}: non-finite rewards {r_GxN[~np.isfinite(r_GxN)]}")
    flat = [s for g in groups for s in g]
    masks = [_loss_mask(s, self.version) for s in flat]
    n_tok = np.asarray([len(s.tokens) if m is None else sum(m) for s, m in zip(flat, masks)])
    adv = adv_lib.sequence_advantages(r_GxN, n_tok.reshape(r_GxN.shape), self.opts)
    seqs = [packing.Seq(list(s.prompt_tokens) + list(s.tokens), len(s.prompt_tokens),
                        list(s.logprobs), float(a), m)
            for s, a, m in zip(flat, adv, masks) if s.tokens]
    stats = dict(reward_mean=float(r_GxN.mean()), adv_abs_mean=float(np.mean(np.abs(adv))),
                 uniform_groups=adv_lib.uniform_groups(r_GxN), sequences=len(seqs))
    return seqs, stats

  def _prepare(self, groups, rewards, teachers=None):
    """Sequences -> packed micro-batches per minibatch, with proximal/reference logprobs attached
    (and the teachers' arrays, ``distill.pack``, when the learner takes them)."""
    seqs, stats = self.build_sequences(groups, rewards)
    if teachers is not None and self.distill_topk is None:
      raise ValueError("teachers given to a learner built without distill_topk")
    if self.distill_topk is not None:  # aligned with seqs: the samples with tokens
      teachers = teachers or [[None] * len(g) for g in groups]
      taught = [t for g, ts in zip(groups, teachers) for s, t in zip(g, ts) if s.tokens]
    if not seqs:
      raise ValueError(f"step {self.version}: the batch has no generated tokens")
    opts = self.opts
    layout = packing.plan([len(s.tokens) for s in seqs], min(opts.ppo_n_minibatches, len(seqs)),
                          opts.micro_batch_tokens, self.dp,
                          min_row_len=min(self.max_seq_len, opts.micro_batch_tokens),
                          packed=opts.pack_sequences, known=self._shapes,
                          attn=self._attn_cost, multiple=self.context)
    self._shapes.add((layout.row_len, layout.micro_rows))
    minibatches, real = [], 0
    for k, mbs in enumerate(layout.minibatches):
      micro = []
      # The first update's proximal policy is the current parameters: its own forward gives the
      # proximal logprobs (see _accumulate), unless the reference model needs a forward anyway.
      self_prox = k == 0 and opts.recompute_logprobs and not opts.kl_coef
      need_forward = (opts.recompute_logprobs and not self_prox) or bool(opts.kl_coef)
      for rows in mbs:
        p = packing.pack(seqs, layout.row_len, rows=rows, num_rows=layout.micro_rows)
        real += p.real_tokens
        arrays = p.arrays()
        if self.distill_topk is not None:
          arrays.update(distill.pack(p.seq, taught, self.distill_topk))
        b = sharding.global_rows(arrays, self.row_sharding)
        plain = {f: b[f] for f in packing.FIELDS}
        old, ref = (self._logp_fn(self.params(), plain,
                                  *([self.ref_params] if opts.kl_coef else []), *self._frozen_args)
                    if need_forward else (None, None))
        if opts.recompute_logprobs and not self_prox:
          b["old_logp"] = old
        elif not opts.recompute_logprobs:
          b["old_logp"] = b["behav_logp"]
        if opts.kl_coef:
          b["ref_logp"] = ref
        micro.append(b)
      minibatches.append(micro)
    stats.update(tokens=real, row_len=layout.row_len, micro_rows=layout.micro_rows,
                 micro_batches=sum(len(m) for m in minibatches),
                 padding_efficiency=real / layout.computed_tokens,
                 packing_efficiency=real / (layout.used_rows * layout.row_len))
    return minibatches, stats

  def _minibatch_grads(self, micro):
    """Accumulated gradients and metric sums of one minibatch (a list of micro-batches)."""
    n_tokens = np.float32(sum(float(b["mask"].sum()) for b in micro))
    acc = self._zeros_fn()
    for b in micro:
      fn = self._acc_fn if "old_logp" in b else self._acc_self_fn
      acc = fn(self.params(), acc, b, n_tokens, *self._frozen_args)
    return acc, int(n_tokens)

  def gradients(self, groups: Sequence[Sequence[Sample]], rewards,
                teachers=None) -> tuple[dict, dict]:
    """The gradient and metrics of the first minibatch at the current parameters (no update)."""
    minibatches, _ = self._prepare(groups, rewards, teachers)
    acc, _ = self._minibatch_grads(minibatches[0])
    return acc["grads"], {k: float(v) for k, v in jax.device_get(acc["metrics"]).items()}

  def train_step(self, groups: Sequence[Sequence[Sample]], rewards, teachers=None) -> dict:
    """Trains version ``v`` into ``v + 1`` on ``groups`` (lists of Samples) with their rewards
    (and, for a learner built with ``distill_topk``, ``teachers``: a ``distill.TokenTeacher`` or
    None per sample, shaped like ``groups``).

    Returns metrics: minibatch means of the loss metrics (``loss``, ``clip_frac``,
    ``behav_weight_mean``, ``cap_masked_frac``, ``approx_kl``, ``entropy``, ``grad_norm``, ...),
    the max of ``behav_weight_max``, and batch figures (``tokens`` = real tokens trained,
    ``gen_tokens``, ``padding_efficiency``, ``train_s``, ``compiles`` = XLA compilations during
    the step, ...).
    """
    t0 = time.perf_counter()
    compiled = compiles.count()
    version = self.version
    minibatches, stats = self._prepare(groups, rewards, teachers)
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    gen_tokens = 0
    for k, micro in enumerate(minibatches):
      acc, n_tokens = self._minibatch_grads(micro)
      gen_tokens += n_tokens
      lr = float(self.schedule(int(self._state["step"])))
      self._state, upd = self._apply_fn(self._state, acc["grads"], acc["metrics"]["loss"])
      m = jax.device_get(dict(acc["metrics"], **upd))
      if not m.pop("finite"):
        done = f"minibatches 0..{k - 1} of this step were applied" if k else "nothing was applied"
        raise FloatingPointError(
            f"learner step {version} (training version {version} -> {version + 1}), minibatch "
            f"{k + 1}/{len(minibatches)}: non-finite loss {float(m['loss'])} or gradient norm "
            f"{float(m['grad_norm'])}; this update was skipped ({done}) and the version was not "
            f"advanced, so no bad parameters can be published or checkpointed")
      m["lr"] = lr
      for key, v in m.items():
        if key in loss_lib.METRIC_MAXES:
          maxes[key] = max(maxes.get(key, -np.inf), float(v))
        else:
          sums[key] = sums.get(key, 0.0) + float(v) / len(minibatches)
    self._state["version"] = sharding.put(np.int32(version + 1), self.replicated)
    return dict(sums, **maxes, **stats, gen_tokens=gen_tokens, updates=len(minibatches),
                compiles=compiles.count() - compiled, train_s=time.perf_counter() - t0)

  def _check_finite_params(self):
    bad = [jax.tree_util.keystr(path) for path, x in
           jax.tree_util.tree_leaves_with_path(self._state["params"])
           if not bool(jnp.all(jnp.isfinite(x)))]
    if bad:
      raise FloatingPointError(f"restored learner state has non-finite parameters: {bad[:5]}")


def _loss_mask(sample: Sample, version: int) -> list[int] | None:
  """``sample.loss_mask`` checked (one 0/1 entry per generated token), or None when absent."""
  mask = sample.loss_mask
  if mask is None:
    return None
  if len(mask) != len(sample.tokens) or len(sample.logprobs) != len(sample.tokens):
    raise ValueError(f"step {version}: sample {sample.group_id}/{sample.index} has "
                     f"{len(sample.tokens)} tokens, {len(sample.logprobs)} logprobs and a loss "
                     f"mask of {len(mask)}")
  if any(m not in (0, 1) for m in mask):
    raise ValueError(f"step {version}: sample {sample.group_id}/{sample.index} has a loss mask "
                     f"with values other than 0 and 1")
  return [int(m) for m in mask]
