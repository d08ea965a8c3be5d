"""Validation of a configuration tree: the checks ``validate`` runs before any model loads.

Each check names the keys involved and the values that would work, and all failures are reported
at once (one ``ConfigError``). ``areal_jax.config`` re-exports everything here, so
``config.validate(...)`` and ``config.ConfigError`` are the names callers use.
"""

from __future__ import annotations

import ml_collections

ConfigDict = ml_collections.ConfigDict


def mesh_sizes(axes: ConfigDict, n_devices: int, where: str) -> dict[str, int]:
  """Resolves one ``-1`` axis to the devices left over; checks that the product is ``n_devices``."""
  sizes = dict(axes)
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ValueError(f"{where}: at most one axis may be -1, got {free}")
  fixed = 1
  for k, v in sizes.items():
    if v != -1:
      if v < 1:
        raise ValueError(f"{where}.{k}={v}: mesh axis sizes must be >= 1 (or -1)")
      fixed *= v
  if free:
    if n_devices % fixed:
      raise ValueError(f"{where}: {n_devices} devices are not divisible by {fixed} ({sizes})")
    sizes[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise ValueError(f"{where}: axes {sizes} need {fixed} devices but {n_devices} are assigned")
  return sizes


class ConfigError(ValueError):
  """A config that cannot run as set; the message names the keys involved."""


def validate(config: ConfigDict, n_devices: int | None = None) -> None:
  """Rejects inconsistent settings with a message that names the keys involved
  (``ConfigError``)."""
  a, r, m = config.actor, config.rollout, config.mesh
  errors = []
  if a.use_decoupled_loss and not a.recompute_logprobs:
    errors.append("actor.use_decoupled_loss=True requires actor.recompute_logprobs=True "
                  "(the proximal policy's logprobs must be recomputed by the learner)")
  choices = {
      "model.dtype": (config.model.dtype, ("float32", "bfloat16")),
      "actor.dtype": (a.dtype, ("float32", "bfloat16")),
      "rollout.backend": (r.backend, ("jax", "vllm")),
      "rollout.continuation": (r.continuation, ("keep_cache", "reprefill")),
      "rollout.workflow": (r.workflow, ("single_turn", "multi_turn", "tool", "python_tool",
                                        "env")),
      "runtime.mode": (config.runtime.mode, ("local", "ray")),
      "serve.judge": (config.serve.judge, ("rule", "model", "votes", "none")),
      "serve.signal": (config.serve.signal, ("binary", "opd", "combined")),
      "serve.advantage": (config.serve.advantage, ("baseline", "signed")),
      "serve.teacher_at": (config.serve.teacher_at, ("trainer", "judge")),
      "serve.teacher_weights": (config.serve.teacher_weights, ("start", "current")),
      "serve.sim_feedback": (config.serve.sim_feedback, ("verdict", "words", "both")),
      "runtime.worker_devices": (config.runtime.worker_devices, ("cpu", "gpu", "tpu")),
      "actor.behav_imp_weight_mode": (a.behav_imp_weight_mode, ("mask", "clamp")),
      "actor.behav_imp_weight_level": (a.behav_imp_weight_level, ("token", "sequence")),
      "actor.adv_norm": (a.adv_norm, ("group", "group_mean", "rloo", "none")),
      "actor.lr_schedule": (a.lr_schedule, ("constant", "cosine", "linear")),
      "actor.remat": (a.remat, ("none", "full", "dots", "offload")),
      "weights.transfer": (config.weights.transfer, ("device_put", "orbax", "jax_transfer")),
      "rollout.weight_swap": (r.get("weight_swap", "auto"), ("auto", "overlap", "pause")),
      "task.name": (config.task.name, ("gsm8k", "arithmetic")),
      "task.reward": (config.task.reward, ("answer", "digit_share")),
  }
  from areal_jax.kernels import choice as kernel_choice  # noqa: PLC0415 (imports jax)
  choices["rollout.decode_attention"] = (r.decode_attention, ("auto",) + kernel_choice.ATTENTION)
  choices["rollout.prefill_attention"] = (r.get("prefill_attention", "auto"),
                                          ("auto",) + kernel_choice.CAUSAL)
  choices["actor.attention"] = (a.get("attention", "auto"), ("auto",) + kernel_choice.CAUSAL)
  choices["actor.context_attention"] = (a.get("context_attention", "auto"),
                                        ("auto",) + kernel_choice.CONTEXT)
  choices["rollout.decode_matmul"] = (r.decode_matmul, ("auto",) + kernel_choice.MATMUL)
  choices["rollout.decode_layers"] = (r.decode_layers, ("auto",) + kernel_choice.LAYERS)
  choices["rollout.decode_projections"] = (r.get("decode_projections", "auto"),
                                           ("auto",) + kernel_choice.PROJECTIONS)
  vllm = r.get("vllm", None) or {}
  if vllm:  # (checked again where the engine is built; here before any model loads)
    from areal_jax.vllm_rollout import factory as vllm_factory  # noqa: PLC0415
    choices["rollout.vllm.mode"] = (vllm.get("mode", "inprocess"), vllm_factory.MODES)
    choices["rollout.vllm.dtype"] = (vllm.get("dtype", "auto"), vllm_factory.DTYPES)
    if not 0 <= vllm.get("gpu_memory_utilization", 0.0) <= 1:
      errors.append(f"rollout.vllm.gpu_memory_utilization={vllm.gpu_memory_utilization} must be in "
                    "[0, 1] (0: what is free when vLLM starts)")
  for key, (value, valid) in choices.items():
    if value not in valid:
      errors.append(f"{key}={value!r} is not one of {valid}")
  positive = {"actor.batch_size": a.batch_size, "rollout.n_samples": r.n_samples,
              "rollout.max_new_tokens": r.max_new_tokens, "rollout.num_slots": r.num_slots,
              "actor.ppo_n_minibatches": a.ppo_n_minibatches, "train.total_steps": config.train.total_steps}
  errors += [f"{k}={v} must be >= 1" for k, v in positive.items() if v < 1]
  if not 0 <= config.serve.baseline_decay < 1:
    errors.append(f"serve.baseline_decay={config.serve.baseline_decay} must be in [0, 1)")
  if config.serve.trainer_cores < 0:
    errors.append(f"serve.trainer_cores={config.serve.trainer_cores} must be >= 0 (0: half)")
  if config.serve.cut_off_penalty < 0:
    errors.append(f"serve.cut_off_penalty={config.serve.cut_off_penalty} must be >= 0 (it is "
                  f"subtracted from a cut-off turn's advantage)")
  if config.serve.judge_votes < 1:
    errors.append(f"serve.judge_votes={config.serve.judge_votes} must be >= 1")
  if config.serve.teacher_topk < 0 or config.serve.teacher_batch < 1:
    errors.append(f"serve.teacher_topk={config.serve.teacher_topk} must be >= 0 (0: token-level "
                  f"OPD) and serve.teacher_batch={config.serve.teacher_batch} >= 1")
  if config.serve.signal != "binary" and config.serve.judge not in ("rule", "votes"):
    errors.append(f"serve.signal={config.serve.signal!r} takes hints from the judge: serve.judge "
                  f"must be 'rule' or 'votes', got {config.serve.judge!r}")
  if config.serve.advantage == "signed" and config.serve.judge not in ("rule", "model"):
    errors.append(f"serve.advantage='signed' maps a rule or model judge's score in [0, 1] to "
                  f"+1 / -1; serve.judge={config.serve.judge!r} gives no such score (the votes "
                  "judge's verdict is already the advantage): set serve.advantage='baseline'")
  if config.serve.opd_center and config.serve.teacher_topk:
    errors.append(f"serve.opd_center=True centres the token-level teacher term: it needs "
                  f"serve.teacher_topk=0, got {config.serve.teacher_topk}")
  if config.serve.teacher_weights == "current" and config.serve.teacher_url:
    errors.append("serve.teacher_weights='current' (the policy being trained, with the hint) is "
                  "the in-process teacher's: set serve.teacher_url='' or teacher_weights='start'")
  if (config.serve.teacher_weights == "current" and config.serve.teacher_at == "judge"
      and config.actor.lora.rank):
    errors.append("serve.teacher_weights='current' with serve.teacher_at='judge' follows the full "
                  "weights of each version serving gets, and with actor.lora.rank > 0 a version is "
                  "the adapters: set serve.teacher_at='trainer' (the learner merges them)")
  if (config.serve.signal != "binary" and config.serve.teacher_at == "trainer"
      and not config.serve.train):
    errors.append(f"serve.signal={config.serve.signal!r} with serve.teacher_at='trainer' needs "
                  "serve.train=True (the trainer loop runs the teacher); without training, set "
                  "serve.teacher_at='judge'")
  if config.serve.max_staleness < 0:
    errors.append(f"serve.max_staleness={config.serve.max_staleness} must be >= 0")
  if config.train.keep_checkpoint_every < 0:
    errors.append(f"train.keep_checkpoint_every={config.train.keep_checkpoint_every} must be >= 0 "
                  "(0: only the newest train.keep_checkpoints)")
  if a.logits_chunk < 0:
    errors.append(f"actor.logits_chunk={a.logits_chunk} must be >= 0 (0: no chunking)")
  if m.device_memory_gib < 0:
    errors.append(f"mesh.device_memory_gib={m.device_memory_gib} must be >= 0 (0: as reported)")
  if not 0 < m.memory_fraction <= 1:
    errors.append(f"mesh.memory_fraction={m.memory_fraction} must be in (0, 1]")
  if r.max_head_offpolicyness < 0:
    errors.append(f"rollout.max_head_offpolicyness={r.max_head_offpolicyness} must be >= 0")
  if r.decode_layers == "scan" and r.decode_matmul == "cpu_packed":
    errors.append("rollout.decode_layers='scan' needs XLA matmuls (rollout.decode_matmul 'xla', "
                  "'blas' or 'auto'): the CPU kernel's packed weights are per layer")
  if r.steps_per_call < 0:
    errors.append(f"rollout.steps_per_call={r.steps_per_call} must be >= 0 (0: per platform)")
  if r.get("max_prefill_tokens", 0) < 0:
    errors.append(f"rollout.max_prefill_tokens={r.max_prefill_tokens} must be >= 0 (0: no bound)")
  if r.get("prefill_chunk", -1) < -1:
    errors.append(f"rollout.prefill_chunk={r.prefill_chunk} must be >= 0 (0: prefills run whole) "
                  "or -1 (per platform)")
  kv_pages, page_size = r.get("kv_pages", -1), r.get("page_size", 64)
  if kv_pages < -1 or page_size < 1:
    errors.append(f"rollout.kv_pages={kv_pages} must be >= -1 (-1: per platform, 0: no paging) "
                  f"and rollout.page_size={page_size} >= 1")
  elif kv_pages > 0 and kv_pages * page_size < max(r.prefill_buckets) + r.max_new_tokens:
    errors.append(f"rollout.kv_pages={kv_pages} pages of rollout.page_size={page_size} positions "
                  f"cannot hold one sequence of {max(r.prefill_buckets) + r.max_new_tokens} "
                  "positions (the largest of rollout.prefill_buckets + rollout.max_new_tokens)")
  if r.get("data_parallel", "replicas") not in ("replicas", "sharded"):
    errors.append(f"rollout.data_parallel={r.data_parallel!r} must be 'replicas' or 'sharded'")
  if r.max_concurrent_rollouts < 0:
    errors.append(f"rollout.max_concurrent_rollouts={r.max_concurrent_rollouts} must be >= 0")
  if r.temperature <= 0:
    errors.append(f"rollout.temperature={r.temperature} must be > 0 (use top_k=1 for greedy)")
  if not 0 < r.top_p <= 1:
    errors.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
  if r.max_turns < 1:
    errors.append(f"rollout.max_turns={r.max_turns} must be >= 1")
  if r.max_concurrent_episodes < 0:
    errors.append(f"rollout.max_concurrent_episodes={r.max_concurrent_episodes} must be >= 0")
  if not 0 < r.turn_discount <= 1:
    errors.append(f"rollout.turn_discount={r.turn_discount} must be in (0, 1]")
  if a.batch_size % a.ppo_n_minibatches:
    errors.append(f"actor.batch_size={a.batch_size} is not divisible by "
                  f"actor.ppo_n_minibatches={a.ppo_n_minibatches}")
  if r.n_samples > r.num_slots:
    errors.append(f"rollout.n_samples={r.n_samples} exceeds rollout.num_slots={r.num_slots}")
  if a.dual_clip and a.dual_clip <= 1:
    errors.append(f"actor.dual_clip={a.dual_clip} must be > 1 (or 0 to disable)")
  # the optimizer's and the loss's coefficients (a negative learning rate climbs the loss)
  for name, value, hint in (
      ("actor.lr", a.lr, ""), ("actor.weight_decay", a.weight_decay, ""),
      ("actor.warmup_steps", a.warmup_steps, ""), ("actor.grad_clip", a.grad_clip, " (0: off)"),
      ("actor.eps_clip_high", a.eps_clip_high, " (0: actor.eps_clip)"),
      ("actor.kl_coef", a.kl_coef, ""), ("actor.adv_eps", a.adv_eps, ""),
      ("actor.behav_imp_weight_cap", a.behav_imp_weight_cap, " (0: off)"),
      ("rollout.top_k", r.top_k, " (0: off)")):
    if value < 0:
      errors.append(f"{name}={value} must be >= 0{hint}")
  if a.eps_clip <= 0:
    errors.append(f"actor.eps_clip={a.eps_clip} must be > 0")
  for name in ("b1", "b2"):
    if not 0 <= a[name] < 1:
      errors.append(f"actor.{name}={a[name]} must be in [0, 1)")
  if a.lora.rank:
    from areal_jax.models import lora as lora_lib  # pylint: disable=import-outside-toplevel
    try:
      lora_lib.LoraConfig.from_config(a.lora)
    except ValueError as e:
      errors.append(str(e))
  if r.max_prompt_len > max(r.prefill_buckets):
    errors.append(f"rollout.max_prompt_len={r.max_prompt_len} exceeds the largest "
                  f"rollout.prefill_buckets entry {max(r.prefill_buckets)}")
  if config.weights.get("pull_timeout_s", 1.0) <= 0:
    errors.append(f"weights.pull_timeout_s={config.weights.pull_timeout_s} must be > 0")
  if config.weights.transfer == "jax_transfer" and config.runtime.mode != "ray":
    errors.append("weights.transfer='jax_transfer' moves weights between processes: it needs "
                  "runtime.mode='ray' (in one process use 'device_put' or 'orbax')")
  if config.weights.transfer == "jax_transfer" and (a.lora.rank or config.runtime.learner_processes > 1):
    errors.append("weights.transfer='jax_transfer' sends the full weights of a one-process learner: "
                  "with actor.lora.rank > 0 or runtime.learner_processes > 1 use 'orbax'")
  if config.runtime.mode == "ray":
    if r.workers < 1:
      errors.append(f"rollout.workers={r.workers} must be >= 1 with runtime.mode='ray'")
    if m.colocated:
      errors.append("runtime.mode='ray' runs rollout workers in processes of their own: "
                    "set mesh.colocated=False")
  errors += learner_group_errors(config)
  if n_devices is not None:
    errors += _mesh_errors(m, n_devices, a.batch_size * r.n_samples, r.num_slots,
                           remote_sampler=config.runtime.mode == "ray",
                           group=r.n_samples if r.get("data_parallel", "replicas") == "replicas"
                           and r.backend == "jax" else 0)
  if errors:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def learner_group_errors(config: ConfigDict) -> list[str]:
  """What a learner group (``runtime.learner_processes`` > 1) needs of the other keys."""
  n = int(config.runtime.learner_processes)
  if n < 1:
    return [f"runtime.learner_processes={n} must be >= 1"]
  if n == 1:
    return []
  errors = []
  if config.weights.transfer != "orbax" and config.runtime.mode != "ray":  # (ray: always Orbax)
    errors.append(f"runtime.learner_processes={n} needs weights.transfer='orbax' (the group "
                  f"publishes Orbax versions), got {config.weights.transfer!r}")
  if config.mesh.colocated:
    errors.append(f"runtime.learner_processes={n} needs mesh.colocated=False (the learner's "
                  "devices belong to its processes)")
  if config.mesh.learner_devices % n:
    errors.append(f"mesh.learner_devices={config.mesh.learner_devices} is not divisible by "
                  f"runtime.learner_processes={n}")
  address = config.runtime.learner_address
  host, _, port = address.rpartition(":")
  if address and (not host or not port.isdigit()):
    errors.append(f"runtime.learner_address={address!r} is not host:port")
  return errors


def _mesh_errors(m: ConfigDict, n_devices: int, batch_seqs: int, num_slots: int,
                 remote_sampler: bool = False, group: int = 0) -> list[str]:
  """``remote_sampler``: rollout workers bring their own devices; ``n_devices`` are the learner's.
  ``group``: a group's samples, which must fit one sampler replica's slots (0: no replicas)."""
  errors = []
  if remote_sampler and m.learner_devices > n_devices:
    return [f"mesh.learner_devices={m.learner_devices} exceeds the {n_devices} devices of the "
            "learner's process"]
  learner_n = m.learner_devices
  sampler_n = m.learner_devices if m.colocated else m.sampler_devices
  if m.colocated and m.learner_devices > n_devices:
    return [f"mesh.learner_devices={m.learner_devices} (colocated: both meshes) exceeds the "
            f"{n_devices} available devices"]
  if not m.colocated and not remote_sampler and m.learner_devices + m.sampler_devices > n_devices:
    return [f"mesh.learner_devices={m.learner_devices} + mesh.sampler_devices={m.sampler_devices} "
            f"needs {m.learner_devices + m.sampler_devices} devices, but only {n_devices} exist"]
  for name, n in (("learner", learner_n), ("sampler", sampler_n)):
    try:
      sizes = mesh_sizes(m[name], n, f"mesh.{name}")
    except ValueError as e:
      errors.append(str(e))
      continue
    dp = sizes["data"] * sizes["fsdp"]
    if name == "learner" and batch_seqs % dp:
      errors.append(f"actor.batch_size x rollout.n_samples = {batch_seqs} sequences is not divisible "
                    f"by the learner's data-parallel size {dp} (mesh.learner {sizes})")
    if name == "sampler" and num_slots % dp:
      errors.append(f"rollout.num_slots={num_slots} is not divisible by the sampler's data-parallel "
                    f"size {dp} (mesh.sampler {sizes})")
    elif name == "sampler" and group > num_slots // sizes["data"]:
      errors.append(f"rollout.n_samples={group} exceeds the {num_slots // sizes['data']} slots of "
                    f"one sampler replica (rollout.num_slots={num_slots} over data="
                    f"{sizes['data']}, mesh.sampler {sizes}): raise rollout.num_slots or set "
                    "rollout.data_parallel='sharded'")
  return errors
