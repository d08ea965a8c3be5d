"""The configuration tree shared by every task config, and its validation.

Task configs (``configs/*.py``) start from ``base_config()`` and change what they need. Names follow
the reference system (AReaL) where one exists: ``rollout.max_head_offpolicyness``,
``rollout.max_concurrent_rollouts``, ``actor.use_decoupled_loss``, ``actor.recompute_logprobs``,
``actor.eps_clip``, ``actor.ppo_n_minibatches``, ``actor.lr``. The returned config is locked: an
unknown key is an error, never a silently ignored setting.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib

import ml_collections

ConfigDict = ml_collections.ConfigDict


def base_config() -> ConfigDict:
  c = ConfigDict()
  c.seed = 0

  c.model = ConfigDict()
  c.model.source = "tiny"  # Hugging Face dir | "gguf:<path>" | "smollm2" | "tiny" | "small" (random, byte tokenizer)
  c.model.dtype = "float32"  # compute dtype ("bfloat16" on TPU); parameters stay float32

  # Devices: learner and sampler get disjoint sub-meshes unless colocated.
  c.mesh = ConfigDict()
  # colocated: one mesh of the first learner_devices devices; generation and training alternate
  # (a single chip, Colab, or a CPU with few cores where two computations at once would thrash).
  c.mesh.colocated = False
  c.mesh.learner_devices = 4
  c.mesh.sampler_devices = 4
  c.mesh.learner = ConfigDict(dict(data=1, fsdp=-1, tensor=1))  # -1: all remaining devices
  c.mesh.sampler = ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  # The memory plans (areal_jax/learner/memory.py, areal_jax/sampler/memory.py) check the train
  # step and the sampler against memory_fraction x device_memory_gib per device before the first
  # step (colocated: one budget for both, the sampler's slots planned first); 0: the memory the
  # device reports (accelerators; never more than that), no check where it reports none (CPU).
  c.mesh.device_memory_gib = 0.0
  c.mesh.memory_fraction = 0.9

  c.task = ConfigDict()
  c.task.name = "gsm8k"  # "gsm8k" | "arithmetic"
  c.task.train_path = ""  # "" = the shipped copy; or a .jsonl / .parquet / .arrow file or directory
  c.task.test_path = ""
  c.task.skip_malformed = False  # True: count and skip bad rows instead of failing
  c.task.system_prompt = ""
  c.task.instruction = "Please reason step by step, and put your final answer within \\boxed{}."
  c.task.use_chat_template = True
  c.task.enable_thinking = True  # False: the chat template gets enable_thinking=False (Qwen3)
  c.task.difficulty = 1  # arithmetic task only: number of operations
  c.task.max_operand = 20  # arithmetic task only
  c.task.num_train = 10000  # arithmetic task only: size of the generated train split
  c.task.num_test = 200  # arithmetic task only
  c.task.seed = 0  # arithmetic task only: seed of the generated problems (fixed across runs)
  # "answer": the final answer against the reference (the task metric); "digit_share": a dense toy
  # reward (share of digit characters) that a random model learns, for benchmarks' learning curves
  c.task.reward = "answer"

  c.rollout = ConfigDict()
  c.rollout.backend = "jax"  # "jax" | "vllm"
  c.rollout.n_samples = 4  # completions per prompt (a GRPO group)
  c.rollout.max_prompt_len = 256
  c.rollout.max_new_tokens = 256
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0  # 0: off
  c.rollout.max_head_offpolicyness = 2  # eta; 0 is synchronous RL
  c.rollout.max_concurrent_rollouts = 0  # C in groups; 0: equal to actor.batch_size
  c.rollout.partial_rollouts = True  # apply new weights mid-sequence
  c.rollout.continuation = "keep_cache"  # "keep_cache" | "reprefill" after a weight swap
  # how the JAX sampler takes a new version: "overlap" (converted while it decodes with the current
  # one: both held) | "pause" (it stops between two calls, lets go of the current one, converts
  # the new one: one version less at the swap's peak) | "auto" (overlap where the memory plan
  # fits it, else pause; pause when colocated, where the sampler is idle during a swap anyway)
  c.rollout.weight_swap = "auto"
  c.rollout.num_slots = 64  # decode slots of the JAX sampler
  c.rollout.prefill_buckets = (64, 128, 256, 512)
  # tokens per prefill call (rows x bucket, at least one row): fewer prompts per call at long
  # buckets bound the call's memory (the sampler's plan counts its largest); 0: no bound
  c.rollout.max_prefill_tokens = 4096
  c.rollout.steps_per_call = 0  # decode steps per jitted call (host sync); 0: 1 on CPU, 16 on GPU/TPU
  c.rollout.decode_attention = "auto"  # "auto" | "cpu" | "xla" | "dense" | "pallas_gpu" | "pallas_tpu"
  # a prefill's attention: "auto" (a flash kernel on GPU and TPU, dense on CPU) | "dense" |
  # "pallas_gpu" | "pallas_tpu"
  c.rollout.prefill_attention = "auto"
  c.rollout.decode_matmul = "auto"  # "auto" | "cpu_packed" | "xla" | "blas" (GPU library GEMMs)
  c.rollout.decode_layers = "auto"  # "auto" | "scan" | "unrolled" (auto: scan for pallas_tpu unpaged)
  c.rollout.decode_projections = "auto"  # "auto" | "fused" | "separate" (q/k/v, gate/up as one)
  # "auto": on a GPU the decode kernels' launches are timed on the device before the first decode
  # and the fastest kept (areal_jax/sampler/launch_tuning.py) | "off": the defaults (or $AREAL_JAX_*)
  c.rollout.decode_tuning = "auto"
  # paged KV cache: pages in the pool (0: no paging, max_len positions per slot; -1: per
  # platform, kernels.choice.kv_pages: on GPU a pool of max_len positions and a page per slot).
  # Where the pool does not fit the sampler's memory plan keeps the slots over the pages that do
  # (at least a group's sequences to max_len), before it takes slots away (sampler/memory.py)
  c.rollout.kv_pages = -1
  c.rollout.page_size = 64  # positions per page of the paged KV cache
  # The JAX sampler over the sampler mesh's data axis: "replicas" (an engine per data index, each
  # with num_slots / data slots; areal_jax/sampler/replicas.py) | "sharded" (one engine, its
  # slots split over the axis)
  c.rollout.data_parallel = "replicas"
  c.rollout.filter_uniform_groups = True  # drop groups whose rewards are all equal
  c.rollout.reward_timeout_s = 5.0
  c.rollout.reward_workers = 2
  c.rollout.workers = 1  # runtime.mode="ray": rollout worker processes (Ray actors)
  # The episode each prompt group runs (areal_jax/workflows/): "single_turn" (GRPO as before) |
  # "multi_turn" (feedback "wrong, try again" up to rollout.max_turns) | "tool" (a calculator tool).
  c.rollout.workflow = "single_turn"
  c.rollout.max_turns = 1
  c.rollout.turn_discount = 1.0  # reward x discount^(turns - 1)
  c.rollout.vllm = ConfigDict()  # rollout.backend="vllm" only (see areal_jax/vllm_rollout/factory.py)
  c.rollout.vllm.mode = "inprocess"  # "inprocess" | "server" (OpenAI-compatible, on 127.0.0.1)
  c.rollout.vllm.server_url = ""  # attach to a running server instead of starting one
  c.rollout.vllm.kv_cache_gib = 0.0  # 0: 1 GiB on CPU, on a GPU vLLM's own (its memory share)
  c.rollout.vllm.num_threads = 0  # 0: all cores (CPU)
  c.rollout.vllm.dtype = "auto"  # "auto": float32 on CPU, bfloat16 on a GPU | a dtype vLLM takes
  c.rollout.vllm.gpu_memory_utilization = 0.0  # GPU: vLLM's share; 0: what is free at its start
  c.rollout.vllm.workdir = ""  # "": under weights.path, else a temporary directory

  c.actor = ConfigDict()
  c.actor.batch_size = 8  # B: prompt groups per training step
  c.actor.lr = 1e-5
  c.actor.weight_decay = 0.0
  c.actor.b1 = 0.9
  c.actor.b2 = 0.999
  c.actor.warmup_steps = 0
  c.actor.lr_schedule = "constant"  # "constant" | "cosine" | "linear"
  c.actor.grad_clip = 1.0
  c.actor.eps_clip = 0.2
  c.actor.eps_clip_high = 0.0  # 0: same as eps_clip (clip-higher when larger)
  c.actor.dual_clip = 0.0  # c > 1 enables dual clip
  c.actor.use_decoupled_loss = True
  c.actor.recompute_logprobs = True
  c.actor.behav_imp_weight_cap = 5.0
  c.actor.behav_imp_weight_mode = "mask"  # "mask" | "clamp"
  c.actor.behav_imp_weight_level = "token"  # "token" | "sequence"
  c.actor.seq_level_ratio = False  # GSPO
  c.actor.ppo_n_minibatches = 1
  c.actor.adv_norm = "group"  # "group" (GRPO) | "group_mean" (Dr.GRPO) | "rloo" | "none"
  c.actor.group_std_unbiased = True
  c.actor.adv_eps = 1e-5
  c.actor.batch_adv_norm = False  # token-weighted normalization over the batch after the group step
  c.actor.reward_scaling = 1.0
  c.actor.reward_bias = 0.0
  c.actor.kl_coef = 0.0  # KL penalty against the frozen initial model
  c.actor.micro_batch_tokens = 4096  # token budget of one micro-batch (gradient accumulation)
  c.actor.pack_sequences = True
  c.actor.dtype = "float32"  # compute dtype; master weights stay float32
  # Rematerialisation of the layers in the train step: "none" | "full" (keep each layer's input
  # only) | "dots" (keep the projections' outputs) | "offload" (dots, kept in host memory).
  c.actor.remat = "none"
  c.actor.scan_layers = False  # run the layers as one lax.scan (compile time flat in depth)
  c.actor.logits_chunk = 0  # tokens whose LM-head logits exist at once; 0: the whole micro-batch
  # the train step's causal attention: "auto" (a flash kernel on GPU and TPU, which holds no
  # L x L scores; dense on CPU) | "dense" | "pallas_gpu" | "pallas_tpu"
  c.actor.attention = "auto"
  # LoRA (rank 0: off, full fine-tuning). The base is frozen and stored in actor.dtype; only the
  # adapters train, get optimizer state, are checkpointed and are published to the sampler.
  c.actor.lora = ConfigDict()
  c.actor.lora.rank = 0
  c.actor.lora.alpha = 32.0  # scale = alpha / rank
  c.actor.lora.dropout = 0.0  # on the adapters' input
  c.actor.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

  c.train = ConfigDict()
  c.train.total_steps = 100
  c.train.epochs = 1
  c.train.checkpoint_every = 10
  c.train.keep_checkpoints = 2
  c.train.resume = True  # False: start over; existing checkpoints move to checkpoints.old-<time>
  c.train.eval_every = 0  # 0: no periodic evaluation
  c.train.eval_size = 64
  c.train.eval_samples = 1  # k of mean@k (1 = greedy pass@1 only)
  c.train.eval_temperature = 0.6
  c.train.dump_trajectories = False

  c.weights = ConfigDict()
  c.weights.transfer = "device_put"  # "device_put" (one process) | "orbax"
  # | "jax_transfer" (runtime.mode="ray" only: workers pull each version from the learner's memory
  # over sockets with jax.experimental.transfer, no files; areal_jax/runtime/jax_transfer.py)
  c.weights.path = ""  # "" = <workdir>/weights; any Orbax/etils path (e.g. gs://bucket/run)
  c.weights.keep = 2
  # jax_transfer: a worker whose pull of a version has not finished in this many seconds ends (Ray
  # restarts it, its groups are redone and it pulls the current version under a new uuid): jaxlib
  # enforces no timeout of its own on a pull (one cut off by a killed worker was seen to stall).
  c.weights.pull_timeout_s = 120.0

  # Processes (issue 20): "local" runs everything in this process; "ray" runs rollout.workers
  # rollout worker actors and runtime.learner_processes learner processes on a Ray cluster.
  c.runtime = ConfigDict()
  c.runtime.mode = "local"  # "local" | "ray"
  c.runtime.ray_address = ""  # "": start a local Ray cluster; "auto" or host:port: join one
  c.runtime.learner_processes = 1  # >1: one learner process per host, joined by jax.distributed
  c.runtime.max_learner_restarts = 3  # a dead learner process group restarts from its checkpoint
  # "": the driver starts the runtime.learner_processes learner processes on its own host;
  # "host:port": it listens there for learner processes started on their hosts (learner_worker.py)
  c.runtime.learner_address = ""
  # Rollout workers (runtime.mode="ray", areal_jax/runtime/ray_rollout.py):
  c.runtime.max_worker_restarts = 3  # a killed worker restarts and redoes its groups; -1: always
  c.runtime.worker_devices = "cpu"  # "cpu": pinned cores + mesh.sampler_devices fake devices each |
  # "gpu" | "tpu": mesh.sampler_devices chips per worker, assigned by Ray
  c.runtime.learner_cores = 0  # CPU: cores kept for the learner (the driver); 0: an equal share
  # launch.py: JAX's persistent compilation cache (with XLA's per-fusion autotuning results on
  # GPU), shared by the run's processes and by later runs; "": off; $JAX_COMPILATION_CACHE_DIR wins
  c.runtime.compile_cache_dir = "~/.cache/areal_jax/jax_cache"

  # Learning from serving (issue 21): python -m areal_jax.serve (see configs/serve_arithmetic.py).
  c.serve = ConfigDict()
  c.serve.host = "127.0.0.1"
  c.serve.port = 8000
  c.serve.max_staleness = 4  # judged turns older than this many versions are counted, not trained
  c.serve.model_name = "areal-jax-policy"  # the one id /v1/models lists; requests must name it
  c.serve.db_path = ""  # the turn store (SQLite); "": <workdir>/turns.sqlite
  c.serve.max_candidates = 8  # the largest ``n`` one request may ask for
  c.serve.warmup = True  # compile every decode bucket before accepting requests (no compile stalls)
  # each chat turn's KV kept by the sampler for the conversation's next request, which then runs
  # only its new messages through the model (sampler/continuation.py); a row cache plans a row a slot
  c.serve.keep_turns = True
  c.serve.train = True  # False: serve and record (and judge) only, no trainer loop
  # The trainer loop as its own process (python -m areal_jax.serve.trainer_process), started and
  # restarted by the server; versions reach the server as Orbax weights (<workdir>/weights). On CPU
  # the two processes are pinned to disjoint cores so training does not slow serving down.
  c.serve.trainer_process = False
  c.serve.trainer_cores = 0  # CPU cores of the trainer process (0: half, the server keeps the rest)
  c.serve.weights_poll_s = 0.5  # how often the server looks for a newer published version
  c.serve.baseline_decay = 0.9  # EMA of past scores: the baseline of single-candidate turns
  # The judge loop: "rule" (the user's next message says right / wrong), "model" (serve.judge_prompt
  # sent to serve.judge_url, or to this server's own policy in process when ""), "none".
  c.serve.judge = "rule"
  c.serve.judge_prompt = ("Question: {question}\nAnswer: {answer}\nThe user replied: {reply}\n"
                          "Rate how good the answer was from 0 to 10. Reply with the score only.")
  c.serve.judge_url = ""  # an OpenAI-compatible base URL (e.g. http://127.0.0.1:8001/v1)
  c.serve.judge_model = ""  # model name at serve.judge_url
  c.serve.judge_scale = 10.0  # the judge's scores lie in [0, judge_scale]
  c.serve.judge_interval_s = 0.5
  c.serve.judge_timeout_s = 300.0  # a turn with no next state after this long is not trained
  # The simulated user (areal_jax/serve/simulated_user.py, make serve-demo).
  c.serve.sim_users = 4  # concurrent conversations
  c.serve.sim_duration_s = 1200.0
  c.serve.sim_feedback_tokens = 4  # max_tokens of the reply turn ("right" / "that's wrong")
  return c


def lock(config: ConfigDict) -> ConfigDict:
  config.lock()
  return config


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
      "rollout.workflow": (r.workflow, ("single_turn", "multi_turn", "tool")),
      "runtime.mode": (config.runtime.mode, ("local", "ray")),
      "serve.judge": (config.serve.judge, ("rule", "model", "none")),
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
  if config.serve.max_staleness < 0:
    errors.append(f"serve.max_staleness={config.serve.max_staleness} must be >= 0")
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


def load(spec: str) -> ConfigDict:
  """Loads ``path/to/config.py[:preset]`` the way ``--config`` does (for notebooks and tests)."""
  path, _, arg = spec.partition(":")
  file = pathlib.Path(path)
  if not file.is_file():
    raise FileNotFoundError(f"config file not found: {path}")
  module_spec = importlib.util.spec_from_file_location(file.stem, file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def override(config: ConfigDict, key: str, value) -> None:
  """Sets a dotted ``key``; an unknown key fails with the valid keys closest to it."""
  node, parts = config, key.split(".")
  for i, part in enumerate(parts):
    keys = list(node.keys()) if isinstance(node, ConfigDict) else []
    if part not in keys:
      where = ".".join(parts[:i]) or "<root>"
      near = difflib.get_close_matches(part, keys, n=3, cutoff=0.5)
      raise KeyError(f"unknown config key {key!r}: {where!r} has no {part!r}. "
                     f"Did you mean {near}? Valid keys there: {sorted(keys)}")
    if i == len(parts) - 1:
      node[part] = value
    else:
      node = node[part]


def check_overrides(argv: list[str], flag: str = "config") -> None:
  """Fails early, with the nearby valid keys, on a ``--config.x.y=`` override naming no key; and
  in one line on a config file that is not there or a preset it does not have."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")), None)
  if spec is None:
    return
  try:
    config = load(spec)
  except FileNotFoundError:
    raise SystemExit(f"error: --{flag}={spec}: no such file") from None
  except ValueError as e:  # get_config's unknown preset
    raise SystemExit(f"error: --{flag}={spec}: {e}") from None
  for arg in argv:
    if arg.startswith(f"--{flag}."):
      key = arg[len(flag) + 3:].split("=", 1)[0]
      node = config
      for part in key.split("."):
        keys = sorted(node.keys()) if isinstance(node, ConfigDict) else []
        if part not in keys:
          near = difflib.get_close_matches(part, keys, n=3, cutoff=0.5)
          hint = f" Did you mean {', '.join(near)}?" if near else ""
          raise SystemExit(f"error: unknown config key {key!r} in {arg!r}.{hint}\n"
                           f"Valid keys at that level: {', '.join(keys)}")
        node = node[part]
