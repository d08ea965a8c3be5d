"""The configuration tree shared by every task config: ``base_config()`` and its helpers.

Task configs (``configs/*.py``) start from ``base_config()`` and change what they need; the command
line overrides single keys (``--config.rollout.n_samples=8``). Names follow the reference system
(AReaL) where one exists: ``rollout.max_head_offpolicyness``, ``rollout.max_concurrent_rollouts``,
``actor.use_decoupled_loss``, ``actor.recompute_logprobs``, ``actor.eps_clip``,
``actor.ppo_n_minibatches``, ``actor.lr``. A locked config rejects unknown keys, so a misspelt
setting is an error rather than silently ignored.

Every key's comment below is its entry in the configuration reference: the comment block right
above the key and its trailing comment, whose first sentence is the one-line meaning
(``areal_jax/config_reference.py`` reads them; ``tests/test_config_reference.py`` requires one per
key). Validation lives in ``areal_jax/config_validation.py`` and is re-exported here.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib

import ml_collections

# Re-exported: callers use config.validate, config.ConfigError, ...
from areal_jax.config_validation import (  # noqa: F401
    ConfigError, learner_group_errors, mesh_sizes, validate)

ConfigDict = ml_collections.ConfigDict


def base_config() -> ConfigDict:
  """Every key with its default (unlocked: task configs edit it, then ``lock`` it)."""
  c = ConfigDict()
  # Seed of the run: the training data's order, the sampling and a random model's initial weights.
  c.seed = 0

  # The policy model: where its weights and tokenizer come from and the sampler's dtype.
  c.model = ConfigDict()
  # Where the model comes from: a local Hugging Face directory, "gguf:<path>", "smollm2" (the
  # installed SmolLM2-135M-Instruct package) or a random model with a byte tokenizer ("tiny",
  # "small"). Runs read local files only, never the network.
  c.model.source = "tiny"
  # The JAX sampler's compute dtype, "float32" | "bfloat16" (bfloat16 on TPU). The learner's
  # master weights stay float32; each published version is cast to this dtype.
  c.model.dtype = "float32"

  # Devices: the learner and the sampler get disjoint sub-meshes unless colocated.
  c.mesh = ConfigDict()
  # True: one mesh of the first learner_devices devices, on which generation and training take
  # turns. For a single chip, Colab, or a CPU with few cores, where two computations at once
  # would thrash.
  c.mesh.colocated = False
  c.mesh.learner_devices = 4  # Devices of the learner's mesh (the first ones).
  # Devices of the sampler's mesh, after the learner's (unused when colocated).
  c.mesh.sampler_devices = 4
  # The learner mesh's axis sizes; -1 takes all the devices the other axes leave.
  c.mesh.learner = ConfigDict()
  c.mesh.learner.data = 1  # Learner data-parallel axis: replicas of the whole model.
  c.mesh.learner.fsdp = -1  # Learner FSDP axis: parameters and optimizer state sharded over it.
  # Learner context-parallel axis: each row's positions split over it (long sequences).
  c.mesh.learner.context = 1
  c.mesh.learner.tensor = 1  # Learner tensor-parallel axis: each layer's matmuls split over it.
  # The sampler mesh's axis sizes; -1 takes all the devices the other axes leave.
  c.mesh.sampler = ConfigDict()
  # Sampler data-parallel axis: its slots (or engines, rollout.data_parallel) split over it.
  c.mesh.sampler.data = -1
  c.mesh.sampler.fsdp = 1  # Sampler FSDP axis: the weights sharded over it.
  c.mesh.sampler.tensor = 1  # Sampler tensor-parallel axis: each layer's matmuls split over it.
  # Memory of one device in GiB for the memory plans; 0: what the device reports. The plans
  # (areal_jax/learner/memory.py, areal_jax/sampler/memory.py) check the train step and the sampler
  # against memory_fraction x this before the first step (colocated: one budget for both, the
  # sampler's slots planned first); never more than the device reports. CPU devices report none:
  # 0 then takes each device's share of the host memory available (learner.memory.host_budget).
  c.mesh.device_memory_gib = 0.0
  c.mesh.memory_fraction = 0.9  # Share of device_memory_gib the memory plans may fill, in (0, 1].

  # The task: its data, its prompts and its reward.
  c.task = ConfigDict()
  c.task.name = "gsm8k"  # The task, "gsm8k" | "arithmetic" (generated word problems).
  # Training data: a .jsonl / .parquet / .arrow file or a directory; "": the shipped copy.
  c.task.train_path = ""
  c.task.test_path = ""  # Held-out data for evaluation; "": the shipped copy (same formats).
  # True: count and skip bad data rows instead of failing on the first.
  c.task.skip_malformed = False
  c.task.system_prompt = ""  # A system message put before each question; "": none.
  # Text appended to each question.
  c.task.instruction = "Please reason step by step, and put your final answer within \\boxed{}."
  # Format prompts with the tokenizer's chat template (else plain text).
  c.task.use_chat_template = True
  # Passed to the chat template as enable_thinking. False turns Qwen3's thinking mode off.
  c.task.enable_thinking = True
  c.task.difficulty = 1  # Arithmetic task: operations per problem.
  c.task.max_operand = 20  # Arithmetic task: the largest number in a problem.
  c.task.num_train = 10000  # Arithmetic task: problems in the generated train split.
  c.task.num_test = 200  # Arithmetic task: problems in the generated test split.
  c.task.seed = 0  # Arithmetic task: seed of the generated problems (the same splits in every run).
  # The training reward, "answer" | "digit_share". "answer": the final answer against the
  # reference (the task's metric); "digit_share": a dense toy reward (the share of digit
  # characters) that even a random model learns, for benchmarks' learning curves.
  c.task.reward = "answer"

  # Rollouts: sampling, the staleness bound, the JAX sampler's engine and kernels, workflows.
  c.rollout = ConfigDict()
  c.rollout.backend = "jax"  # The inference engine, "jax" (this package's sampler) | "vllm".
  c.rollout.n_samples = 4  # Completions per prompt: the size of a GRPO group.
  # Longest prompt in tokens; longer prompts are skipped and counted.
  c.rollout.max_prompt_len = 256
  c.rollout.max_new_tokens = 256  # Most tokens generated per completion.
  c.rollout.temperature = 1.0  # Sampling temperature (> 0; for greedy use top_k=1).
  c.rollout.top_p = 1.0  # Nucleus sampling: the smallest token set whose probability reaches top_p.
  c.rollout.top_k = 0  # Sample among the k likeliest tokens; 0: off.
  # The staleness bound eta: a group may start at most this many versions before the one that
  # trains on it. 0 is synchronous RL.
  c.rollout.max_head_offpolicyness = 2
  # Most prompt groups in flight at once; 0: actor.batch_size.
  c.rollout.max_concurrent_rollouts = 0
  # Apply a new weight version in the middle of sequences being generated. False: admission
  # pauses and running sequences finish before each update.
  c.rollout.partial_rollouts = True
  # What in-flight sequences do after a weight swap, "keep_cache" | "reprefill". "keep_cache":
  # continue on the KV cache computed by the old weights; "reprefill": recompute it under the new.
  c.rollout.continuation = "keep_cache"
  # How the JAX sampler takes a new version, "auto" | "overlap" | "pause". "overlap": converted
  # while it decodes with the current one (both held); "pause": it stops between two calls, lets
  # go of the current one and converts the new one (one version less at the swap's peak); "auto":
  # overlap where the memory plan fits it, else pause (pause when colocated, where the sampler is
  # idle during a swap anyway).
  c.rollout.weight_swap = "auto"
  c.rollout.num_slots = 64  # Decode slots of the JAX sampler: sequences generated at once.
  # Prompt lengths the JAX sampler compiles prefills for; a prompt is padded to the next one.
  c.rollout.prefill_buckets = (64, 128, 256, 512)
  # Most tokens per prefill call (rows x bucket, at least one row); 0: no bound. Fewer prompts
  # per call at long buckets bound the call's memory (the sampler's plan counts its largest).
  c.rollout.max_prefill_tokens = 4096
  # Positions per chunk of the JAX sampler's long prefills, each run between two decode calls so
  # no decode step waits longer than one chunk (areal_jax/sampler/chunked_prefill.py); 0: a
  # prefill runs whole; -1: per platform.
  c.rollout.prefill_chunk = -1
  # Decode steps per jitted call (one host sync per call); 0: 1 on CPU, 16 on GPU and TPU.
  c.rollout.steps_per_call = 0
  # The decode attention kernel, "auto" | "cpu" | "xla" | "dense" | "pallas_gpu" | "pallas_tpu".
  # "auto": the platform's choice (areal_jax/kernels/), else $AREAL_JAX_DECODE_ATTENTION.
  c.rollout.decode_attention = "auto"
  # A prefill's attention, "auto" | "dense" | "pallas_gpu" | "pallas_tpu". "auto": a flash
  # kernel on GPU and TPU, dense on CPU.
  c.rollout.prefill_attention = "auto"
  # The decode step's matmuls, "auto" | "cpu_packed" | "xla" | "blas" (GPU library GEMMs).
  c.rollout.decode_matmul = "auto"
  # How the decode step runs the layers, "auto" | "scan" | "unrolled". "auto": scan for the TPU
  # kernel without paging, else unrolled.
  c.rollout.decode_layers = "auto"
  # The decode step's q/k/v and gate/up projections, "auto" | "fused" (one matmul each) |
  # "separate".
  c.rollout.decode_projections = "auto"
  # Launch tuning of the GPU decode kernels, "auto" | "off". "auto": their launch settings are
  # timed on the device before the first decode and the fastest kept
  # (areal_jax/sampler/launch_tuning.py); "off": the defaults (or the $AREAL_JAX_* overrides).
  c.rollout.decode_tuning = "auto"
  # Pages in the paged KV cache's pool; 0: no paging (max_len positions per slot); -1: per
  # platform (kernels.choice.kv_pages: on GPU a pool of max_len positions and a page per slot).
  # Where the pool does not fit, the sampler's memory plan keeps the slots over the pages that do
  # (at least a group's sequences to max_len) before it takes slots away (sampler/memory.py).
  c.rollout.kv_pages = -1
  c.rollout.page_size = 64  # Positions per page of the paged KV cache.
  # The JAX sampler over the sampler mesh's data axis, "replicas" | "sharded". "replicas": an
  # engine per data index, each with num_slots / data slots (areal_jax/sampler/replicas.py);
  # "sharded": one engine, its slots split over the axis.
  c.rollout.data_parallel = "replicas"
  # Drop groups whose rewards are all equal: their GRPO advantages are all zero.
  c.rollout.filter_uniform_groups = True
  c.rollout.reward_timeout_s = 5.0  # A reward call running longer scores 0 and is counted.
  c.rollout.reward_workers = 2  # Processes that compute rewards.
  c.rollout.workers = 1  # Rollout worker processes (Ray actors) with runtime.mode="ray".
  # The episode each prompt group runs (areal_jax/workflows/), "single_turn" | "multi_turn" |
  # "tool" | "python_tool" | "env". "single_turn": one completion (GRPO); "multi_turn": "wrong, try
  # again" feedback up to max_turns; "tool": the model may call a calculator tool;
  # "python_tool": the model may run Python programs in a sandbox (rollout.python_tool);
  # "env": the model acts in the environment of rollout.env (areal_jax/workflows/env_episode.py).
  c.rollout.workflow = "single_turn"
  c.rollout.max_turns = 1  # Most model turns in one multi-turn or tool episode.
  # Most episodes running at once (an async workflow's on one event loop, a blocking one's a
  # thread each); 0: every episode of the groups in flight (n_samples x max_concurrent_rollouts).
  c.rollout.max_concurrent_episodes = 0
  c.rollout.turn_discount = 1.0  # A multi-turn episode's reward is reward x discount^(turns - 1).
  # Limits of each program of rollout.workflow="python_tool" (areal_jax/envs/python_sandbox.py).
  c.rollout.python_tool = ConfigDict()
  c.rollout.python_tool.wall_s = 10.0  # Wall-clock seconds, then its whole process group is killed.
  c.rollout.python_tool.cpu_s = 5  # CPU seconds of each of its processes (RLIMIT_CPU).
  c.rollout.python_tool.memory_mib = 512  # Address space of each of its processes (RLIMIT_AS).
  c.rollout.python_tool.max_processes = 16  # Processes it may run at once (RLIMIT_NPROC).
  # Largest file it may write (RLIMIT_FSIZE), and the size of its scratch /tmp.
  c.rollout.python_tool.max_file_mib = 16
  # Bytes of stdout + stderr kept and shown to the model; more ends the program.
  c.rollout.python_tool.max_output_bytes = 1024
  c.rollout.python_tool.max_code_bytes = 16384  # A longer program is not run (an error result).
  # Run programs even where no namespace can be made (no network or file isolation then, only
  # the resource limits); False: such a machine refuses the workflow at start.
  c.rollout.python_tool.allow_unisolated = False
  # The environment of rollout.workflow="env" (areal_jax/envs/, docs/guides/environments.md).
  c.rollout.env = ConfigDict()
  # Where it runs, "inprocess" | "pool" | "remote" | "ray". "pool": worker processes on this host;
  # "remote": an HTTP server (env.url); "ray": pool workers as Ray actors (runtime.mode="ray").
  c.rollout.env.kind = "inprocess"
  c.rollout.env.class_path = ""  # The environment class, "package.module:Class" (not for remote).
  c.rollout.env.args = ""  # Its constructor's keyword arguments, a JSON object ("": none).
  c.rollout.env.workers = 2  # Threads (inprocess), processes (pool) or actors (ray) running them.
  # Episodes one pool worker holds at once; a worker killed for a fault ends all of them.
  c.rollout.env.episodes_per_worker = 1
  c.rollout.env.url = ""  # The environment server (kind="remote"), e.g. http://127.0.0.1:8900.
  # Time limit of each reset / step; a call past it ends the episode (a pool worker is restarted).
  c.rollout.env.step_timeout_s = 30.0
  # Largest answer of a reset / step in bytes; a larger one ends the episode ("too_large").
  c.rollout.env.max_response_bytes = 1048576
  # The vLLM engine, with rollout.backend="vllm" only (areal_jax/vllm_rollout/factory.py).
  c.rollout.vllm = ConfigDict()
  # How vLLM runs, "inprocess" | "server". "server": an OpenAI-compatible server on 127.0.0.1.
  c.rollout.vllm.mode = "inprocess"
  c.rollout.vllm.server_url = ""  # Attach to this running vLLM server instead of starting one.
  # KV cache of vLLM in GiB; 0: 1 GiB on CPU, on a GPU vLLM's own sizing from its memory share.
  c.rollout.vllm.kv_cache_gib = 0.0
  c.rollout.vllm.num_threads = 0  # Torch threads of vLLM on CPU; 0: all cores.
  # vLLM's dtype; "auto": float32 on CPU, bfloat16 on a GPU; else any dtype vLLM takes.
  c.rollout.vllm.dtype = "auto"
  # Share of the GPU's memory vLLM may use, in [0, 1]; 0: what is free when it starts.
  c.rollout.vllm.gpu_memory_utilization = 0.0
  # vLLM's working files; "": under weights.path, else a temporary directory.
  c.rollout.vllm.workdir = ""

  # The learner: optimizer, PPO / GRPO objective, advantages, memory and LoRA.
  c.actor = ConfigDict()
  c.actor.batch_size = 8  # Prompt groups per training step (B).
  c.actor.lr = 1e-5  # Peak learning rate of AdamW.
  c.actor.weight_decay = 0.0  # AdamW weight decay.
  c.actor.b1 = 0.9  # AdamW beta1, in [0, 1).
  c.actor.b2 = 0.999  # AdamW beta2, in [0, 1).
  c.actor.warmup_steps = 0  # Steps of linear warm-up to actor.lr.
  # The learning rate after warm-up, "constant" | "cosine" | "linear" ("cosine" and "linear"
  # decay to 0 at train.total_steps).
  c.actor.lr_schedule = "constant"
  c.actor.grad_clip = 1.0  # Clip the gradient's global norm to this; 0: off.
  # PPO clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high].
  c.actor.eps_clip = 0.2
  c.actor.eps_clip_high = 0.0  # Upper clip range; 0: eps_clip (larger: clip-higher).
  c.actor.dual_clip = 0.0  # Dual clip bound c > 1 on negative advantages; 0: off.
  # Decoupled PPO: the clipped ratio is taken against the proximal policy and weighted by the
  # behaviour importance weight (proximal / behaviour policy). It needs recompute_logprobs=True.
  c.actor.use_decoupled_loss = True
  # The learner recomputes the sampled tokens' logprobs under its current weights before the
  # update (the old or proximal policy); False: the sampler's logprobs serve as the old policy.
  c.actor.recompute_logprobs = True
  # Cap on the behaviour importance weight of the decoupled loss; 0: off.
  c.actor.behav_imp_weight_cap = 5.0
  # What happens to a weight above the cap, "mask" (the token is left out) | "clamp" (set to
  # the cap).
  c.actor.behav_imp_weight_mode = "mask"
  # Where the behaviour weight is computed, "token" | "sequence" (geometric mean over the sequence).
  c.actor.behav_imp_weight_level = "token"
  # True: one ratio per sequence, the geometric mean of its tokens' (GSPO).
  c.actor.seq_level_ratio = False
  # Optimizer updates per training step (the batch split in minibatches).
  c.actor.ppo_n_minibatches = 1
  # How rewards become advantages, "group" (GRPO) | "group_mean" (Dr.GRPO) | "rloo" | "none".
  # "group": (r - mean) / (std + adv_eps) in each group; "group_mean": r - mean; "rloo": r minus
  # the mean of the group's other samples; "none": the reward itself.
  c.actor.adv_norm = "group"
  c.actor.group_std_unbiased = True  # The group's standard deviation with Bessel's correction.
  c.actor.adv_eps = 1e-5  # Added to the group's standard deviation before dividing.
  # Normalize the advantages again over the whole batch, weighted by tokens, after the group step.
  c.actor.batch_adv_norm = False
  c.actor.reward_scaling = 1.0  # Rewards are multiplied by this before the advantages.
  c.actor.reward_bias = 0.0  # Added to the rewards after scaling.
  c.actor.kl_coef = 0.0  # Weight of a KL penalty against the frozen initial model; 0: off.
  c.actor.micro_batch_tokens = 4096  # Token budget of one micro-batch (gradient accumulation).
  c.actor.pack_sequences = True  # Pack several short sequences into one row of a micro-batch.
  # The learner's compute dtype, "float32" | "bfloat16"; master weights stay float32.
  c.actor.dtype = "float32"
  # Rematerialisation of the layers in the train step, "none" | "full" | "dots" | "offload".
  # "full": keep each layer's input only; "dots": keep the projections' outputs; "offload":
  # dots, kept in host memory.
  c.actor.remat = "none"
  c.actor.scan_layers = False  # Run the layers as one lax.scan: compile time flat in depth.
  # Tokens whose LM-head logits exist at once; 0: the whole micro-batch.
  c.actor.logits_chunk = 0
  # The train step's causal attention, "auto" | "dense" | "pallas_gpu" | "pallas_tpu". "auto": a
  # flash kernel on GPU and TPU (it holds no L x L scores), dense on CPU.
  c.actor.attention = "auto"
  # Attention across mesh.learner.context > 1, "auto" | "ulysses" | "ring". "auto": ulysses
  # (heads all-to-all) where the heads divide over tensor x context, else ring.
  c.actor.context_attention = "auto"
  # LoRA adapters. The base is frozen and stored in actor.dtype; only the adapters train, get
  # optimizer state, are checkpointed and are published to the sampler.
  c.actor.lora = ConfigDict()
  c.actor.lora.rank = 0  # LoRA rank; 0: off (full fine-tuning).
  c.actor.lora.alpha = 32.0  # LoRA scale numerator: the adapters' output is scaled by alpha / rank.
  c.actor.lora.dropout = 0.0  # Dropout on the adapters' input.
  # The projections that get adapters.
  c.actor.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

  # The training loop: length, checkpoints and evaluation.
  c.train = ConfigDict()
  c.train.total_steps = 100  # Training steps of the run.
  c.train.epochs = 1  # Passes over the training data available to the run.
  c.train.checkpoint_every = 10  # Save a checkpoint every this many steps (and after the last).
  c.train.keep_checkpoints = 2  # Checkpoints kept on disk; older ones are deleted.
  # Also keep every checkpoint whose step is a multiple of this (a curve over the run); 0: none.
  c.train.keep_checkpoint_every = 0
  # Resume from the workdir's latest checkpoint. False: start over; existing checkpoints move
  # to checkpoints.old-<time>.
  c.train.resume = True
  c.train.eval_every = 0  # Evaluate on held-out data every this many steps; 0: never.
  c.train.eval_size = 64  # Held-out examples per evaluation.
  c.train.eval_samples = 1  # Samples per example, k of mean@k; 1: greedy pass@1 only.
  c.train.eval_temperature = 0.6  # Sampling temperature of the mean@k samples.
  # Write every trained sample to <workdir>/trajectories/step_<n>.jsonl, for audits.
  c.train.dump_trajectories = False

  # Weight transfer: how each new version reaches the sampler.
  c.weights = ConfigDict()
  # How versions travel, "device_put" | "orbax" | "jax_transfer". "device_put": within one
  # process; "orbax": files under weights.path; "jax_transfer" (runtime.mode="ray" only): workers
  # pull each version from the learner's memory over sockets with jax.experimental.transfer, no
  # files (areal_jax/runtime/jax_transfer.py).
  c.weights.transfer = "device_put"
  # Where Orbax versions go; "": <workdir>/weights. Any Orbax/etils path (e.g. gs://bucket/run).
  c.weights.path = ""
  c.weights.keep = 2  # Published versions kept; older ones are deleted.
  # jax_transfer: a worker whose pull of a version has not finished in this many seconds ends.
  # Ray then restarts the worker, its groups are redone and it pulls the current version anew.
  # jaxlib enforces no timeout of its own on a pull, and one cut off by a killed worker can stall.
  c.weights.pull_timeout_s = 120.0

  # Processes: "local" runs everything in this process; "ray" runs rollout.workers rollout
  # worker actors and runtime.learner_processes learner processes on a Ray cluster.
  c.runtime = ConfigDict()
  c.runtime.mode = "local"  # Where the parts run, "local" (one process) | "ray".
  # The Ray cluster; "": start a local one; "auto" or host:port: join one.
  c.runtime.ray_address = ""
  # Learner processes; > 1: one per host, joined by jax.distributed.
  c.runtime.learner_processes = 1
  # Restarts of a dead learner process group, each from the latest checkpoint.
  c.runtime.max_learner_restarts = 3
  # Where the learner processes come from; "": the driver starts them on its own host.
  # "host:port": it listens there for learner processes started on their hosts (learner_worker.py).
  c.runtime.learner_address = ""
  # Restarts of a killed rollout worker, which then redoes its groups; -1: always.
  c.runtime.max_worker_restarts = 3
  # A rollout worker's devices, "cpu" | "gpu" | "tpu". "cpu": pinned cores and
  # mesh.sampler_devices fake devices each; "gpu", "tpu": mesh.sampler_devices chips per worker,
  # assigned by Ray.
  c.runtime.worker_devices = "cpu"
  c.runtime.learner_cores = 0  # CPU cores kept for the learner (the driver); 0: an equal share.
  # JAX's persistent compilation cache (launch.py); "": off. Shared by the run's processes and by
  # later runs; on GPU it also keeps XLA's per-fusion autotuning results. A
  # $JAX_COMPILATION_CACHE_DIR already set wins.
  c.runtime.compile_cache_dir = "~/.cache/areal_jax/jax_cache"

  # Learning from serving: python -m areal_jax.serve (see configs/serve_arithmetic.py).
  c.serve = ConfigDict()
  c.serve.host = "127.0.0.1"  # Address the OpenAI-compatible server listens on.
  c.serve.port = 8000  # Port the server listens on.
  c.serve.max_staleness = 4  # Judged turns older than this many versions are counted, not trained.
  # The one model id /v1/models lists; requests must name it.
  c.serve.model_name = "areal-jax-policy"
  c.serve.db_path = ""  # The turn store (SQLite); "": <workdir>/turns.sqlite.
  c.serve.max_candidates = 8  # The largest n one request may ask for.
  # API keys for /v1/...: "file:PATH" (one key a line) or "env:NAME" (keys separated by commas or
  # spaces); "": none, and then the server listens on loopback addresses only.
  c.serve.api_keys = ""
  c.serve.rate_limit_per_min = 0  # Chat requests per minute per API key (429 beyond); 0: no limit.
  c.serve.max_body_bytes = 1 << 20  # The largest request body, in bytes (413 beyond).
  # The largest share of a train batch one API key's turns may take (at least one turn); 1: no cap.
  c.serve.max_key_share = 1.0
  # Compile every decode bucket before accepting requests (no compile stalls).
  c.serve.warmup = True
  # Keep each chat turn's KV cache for the conversation's next request, which then runs only its
  # new messages through the model (sampler/continuation.py). Without paging, the sampler's memory
  # plan reserves a kept row per slot for this; a paged cache keeps the turn's pages.
  c.serve.keep_turns = True
  c.serve.train = True  # Train on the judged turns; False: serve and record (and judge) only.
  # Run the trainer loop as its own process (python -m areal_jax.serve.trainer_process). The
  # server starts and restarts it; versions reach the server as Orbax weights
  # (<workdir>/weights). On CPU the two processes get disjoint cores, so training does not slow
  # serving down.
  c.serve.trainer_process = False
  # CPU cores of the trainer process; 0: half (the server keeps the rest).
  c.serve.trainer_cores = 0
  # How often the server looks for a newer published version, in seconds.
  c.serve.weights_poll_s = 0.5
  # How often the server (and the serve demo) prints a status line, in seconds; 0: never.
  c.serve.status_every_s = 30.0
  # Decay of the score EMA that is the baseline of single-candidate turns.
  c.serve.baseline_decay = 0.9
  # A judged turn's advantage from a rule or model judge's score s in [0, 1]: "baseline": s less
  # the baseline (a request's candidates' mean, else the running one); "signed": 2 * s - 1 (right
  # +1, wrong -1), no baseline, as the votes judge's verdict is.
  c.serve.advantage = "baseline"
  # Subtracted from the advantage of a turn cut off at its token limit (finish_reason "length"),
  # whatever the judge said: a cost on running into the limit; the baseline follows scores alone.
  c.serve.cut_off_penalty = 0.0
  # The judge that scores turns, "rule" | "model" | "votes" | "none". "rule": the user's next
  # message says right or wrong; "model": serve.judge_prompt sent to serve.judge_url (to this
  # server's own policy, in process, when that is ""); "votes": serve.judge_votes votes on the turn
  # and its next state (same models), the majority (+1 / -1) trained as the advantage itself.
  c.serve.judge = "rule"
  # The model judge's prompt, with {question}, {answer} and {reply} filled in.
  c.serve.judge_prompt = ("Question: {question}\nAnswer: {answer}\nThe user replied: {reply}\n"
                          "Rate how good the answer was from 0 to 10. Reply with the score only.")
  # An OpenAI-compatible base URL for the model judge (e.g. http://127.0.0.1:8001/v1).
  c.serve.judge_url = ""
  c.serve.judge_model = ""  # The model name at serve.judge_url.
  c.serve.judge_scale = 10.0  # The judge's scores lie in [0, judge_scale].
  c.serve.judge_interval_s = 0.5  # How often the judge loop looks for turns to score, in seconds.
  # A turn with no next state after this many seconds is not trained.
  c.serve.judge_timeout_s = 300.0
  c.serve.judge_votes = 3  # Votes (judge samples, one request of n) per turn for serve.judge=votes.
  # The votes judge's prompt, with {question}, {answer} and {reply} (the next state) filled in; a
  # vote is the reply's last line, exactly "Score: +1", "Score: -1" or "Score: 0" (else abstains).
  c.serve.judge_vote_prompt = (
      "A user asked an assistant: {question}\nThe assistant answered: {answer}\nWhat came next "
      "(the user's reply or a tool's output):\n{reply}\nJudge from what came next whether the "
      "answer was good. Think briefly, then end with one line: Score: +1 (good), Score: -1 (bad) "
      "or Score: 0 (cannot tell).")
  c.serve.judge_vote_temperature = 1.0  # Sampling temperature of the votes (0: m equal votes).
  c.serve.judge_vote_max_tokens = 128  # The longest vote reply, in tokens (a cut-off one abstains).
  # What judged turns train with, "binary" | "opd" | "combined". "binary": the judge's score (the
  # scalar advantage r); "opd": hindsight-guided on-policy distillation, the per-token advantage
  # teacher - student from a hint the judge took from the next state (no hint: no signal);
  # "combined": signal_w_rl * r + signal_w_opd * (teacher - student).
  c.serve.signal = "binary"
  c.serve.signal_w_rl = 1.0  # Weight of the judge's scalar advantage (binary, combined).
  c.serve.signal_w_opd = 1.0  # Weight of the OPD term, teacher - student or the top-k KL.
  # Token-level OPD: take each turn's mean of teacher - behaviour logprob out of its teacher term,
  # so that the term only moves credit between the response's tokens (combined: the score sets it).
  c.serve.opd_center = False
  # The votes judge's prompt when the signal takes hints (opd, combined): as judge_vote_prompt, and
  # a vote may also say what the assistant should have done between serve.hint_start and hint_end.
  c.serve.judge_hint_prompt = (
      "A user asked an assistant: {question}\nThe assistant answered: {answer}\nWhat came next "
      "(the user's reply or a tool's output):\n{reply}\nIf what came next shows what the "
      "assistant should have done, say it in one or two sentences between [HINT] and [/HINT]. "
      "Then end with one line: Score: +1 (good), Score: -1 (bad) or Score: 0 (cannot tell).")
  c.serve.hint_start = "[HINT]"  # Opens the hint in a judge's reply.
  c.serve.hint_end = "[/HINT]"  # Closes the hint in a judge's reply.
  # A hint shorter than this many characters is not useful (the rule judge: besides verdict words).
  c.serve.hint_min_chars = 12
  c.serve.hint_max_chars = 1000  # A longer hint is cut to this many characters.
  # The rule judge's hint keeps the reply's opening verdict ("no, that's wrong.") when True.
  c.serve.hint_keep_verdict = False
  # A turn cut off at its token limit keeps its hint (the teacher's term) when True; False: it
  # trains on its score alone (combined) or not at all (opd).
  c.serve.hint_cut_off = True
  # How the hint joins the last user message of the teacher's prompt, with {message} and {hint}.
  c.serve.hint_format = "{message}\n\nHint: {hint}"
  # The OPD teacher: "" = in process (serve.teacher_weights, serve.teacher_at);
  # else an OpenAI-compatible base URL whose /completions returns prompt_logprobs (e.g. vLLM).
  c.serve.teacher_url = ""
  c.serve.teacher_model = ""  # The model name at serve.teacher_url.
  # 0: token-level OPD (teacher logprob of each response token); k > 0: distil the teacher's top-k
  # distribution per token (reverse KL over k + 1 bins, the rest of the mass being one bin).
  c.serve.teacher_topk = 0
  c.serve.teacher_batch = 4  # Turns the in-process teacher scores in one forward pass.
  # The in-process teacher's weights: "start" (frozen, the run's start) or "current" (the policy
  # being trained: the learner's before each scoring at the trainer, the served version's at the
  # judge; the term is then only what the hint changes).
  c.serve.teacher_weights = "start"
  # Where the teacher scores hinted turns: "trainer" (the trainer loop, before each step, on the
  # learner's devices: its own process and cores with serve.trainer_process) or "judge" (the judge
  # loop, beside serving, on the sampler's devices).
  c.serve.teacher_at = "trainer"
  # Simulated users: concurrent conversations (serve/simulated_user.py, make serve-demo).
  c.serve.sim_users = 4
  c.serve.sim_duration_s = 1200.0  # How long the simulated users run, in seconds.
  # max_tokens of the simulated user's reply turn ("right" / "that's wrong").
  c.serve.sim_feedback_tokens = 4
  # What the simulated users reply: "verdict" ("right" / "that's wrong"), "words" (how to work the
  # problem out, no right/wrong word: only OPD can use it) or "both" (a verdict; if wrong, the way).
  c.serve.sim_feedback = "verdict"
  # A simulated user calls an answer cut off at its token limit wrong, whatever number it ends on.
  c.serve.sim_cut_off_wrong = True
  return c


def lock(config: ConfigDict) -> ConfigDict:
  config.lock()
  return config


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
