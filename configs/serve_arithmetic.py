r"""Learning from serving: SmolLM2-135M-Instruct serves arithmetic questions and learns from users.

  make serve-demo   # server + simulated users + judge + trainer, held-out pass@1 before/after
  python -m areal_jax.serve --config=configs/serve_arithmetic.py --workdir=runs/serve
  python -m areal_jax.serve --config=configs/serve_arithmetic.py:tiny --workdir=/tmp/serve_tiny
  # the trainer loop as a thread of the server instead of its own process
  python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py:thread --workdir=runs/serve_thread

Users send each question once, so turns are trained one sample per prompt: decoupled PPO with the
advantage ``score - running baseline`` (``serve.baseline_decay``), computed by the trainer loop
(``actor.adv_norm = "none"``). The task settings are those of ``configs/arithmetic.py``, so the
standalone evaluator measures the served policy on the same held-out split:

  python -m areal_jax.evaluate --config=configs/serve_arithmetic.py --checkpoint=runs/serve

The trainer loop runs as its own process (``serve.trainer_process``, ``python -m
areal_jax.serve.trainer_process``), pinned to one core and the server to the other, versions through
Orbax weights under ``<workdir>/weights``: request p99 while training stays at idle's
(bench/serve.py). ``:thread`` keeps it a thread of the server, sharing the cores (request p99 while
training 3x idle's).

Result of ``python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py[:thread]
--workdir=... --duration_s=1200 --curve_points=3`` (Intel Xeon, 2 CPU cores, 2026-11-25, before the
learning-rate warm-up): 16 simulated users, 20 minutes of serving, held-out greedy pass@1 on 100
problems (standalone evaluator) 0.26 before; with the trainer process 1355 conversations, 688 turns
trained over 43 versions, 0.52 (version 5), 0.60 (version 25), 0.52 (version 44), 24 min 46 s in
all; with the trainer thread (``:thread``) 0.45, 0.56, 0.74 (version 45). With the warm-up and users
who give the verdict and the worked answer (``--feedback=both``; 2-core AMD EPYC, 2026-12-07,
06becfe, efa455c): ``--signal=binary`` 0.26 -> 0.60, 0.74, 0.60 in three runs;
``--signal=combined --config.serve.teacher_weights=current --config.serve.signal_w_opd=0.05`` 0.26
-> 0.61, 0.58, 0.32. Outcomes vary from run to run. The signals
(``--signal=binary|opd|combined``, ``--feedback``) and what each learned are in the serving guide
(docs/guides/serving.md, "Signals: binary RL, hindsight OPD, or both").
"""

from areal_jax.config import lock

import importlib.util
import pathlib


def _arithmetic(preset: str):
  path = pathlib.Path(__file__).with_name("arithmetic.py")
  spec = importlib.util.spec_from_file_location("arithmetic_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset)


def get_config(preset: str = "default"):
  if preset not in ("default", "tiny", "thread"):
    raise ValueError(f"unknown preset {preset!r} for configs/serve_arithmetic.py: default, tiny, "
                     f"thread")
  c = _arithmetic("tiny" if preset == "tiny" else "default")
  c.unlock()
  c.actor.adv_norm = "none"  # the trainer loop passes score - baseline as the reward
  c.actor.batch_size = 16  # judged turns per train step
  c.actor.ppo_n_minibatches = 1
  c.actor.lr = 2e-5
  # Adam's first steps move every weight by about the learning rate whatever its gradient's size,
  # so one 16-turn batch could set where a run went (answers growing into the token limit, or not):
  # the learning rate rises over the first 10 steps instead
  # (bench/results/serve-signals-early-steps-2026-12-07-06becfe). Runs can still grow long later and
  # come back (bench/results/serve-signals-replicates-2026-12-07-efa455c).
  c.actor.warmup_steps = 10
  # The learner trains while the sampler serves: chunk the LM head (exact gradients) so a step's
  # logits stay small (an unchunked run was killed for memory at 10 GB RSS on a shared 24 GiB
  # machine; the effect of this setting on the peak is not measured).
  c.actor.logits_chunk = 1024
  # A conversation's second turn (question, answer, "right") must fit the prompt budget.
  c.rollout.max_prompt_len = 192
  c.rollout.prefill_buckets = (96, 192)
  c.rollout.num_slots = 32
  c.train.total_steps = 10000  # the constant learning rate's horizon; serving stops on a signal
  c.train.checkpoint_every = 5
  # The demo's curve evaluates kept checkpoints: every 10th version's and the newest two (each
  # holds the learner and optimizer state).
  c.train.keep_checkpoints = 2
  c.train.keep_checkpoint_every = 10
  c.serve.max_staleness = 4
  c.serve.trainer_process = preset == "default"  # its own process on its own cores (docstring)
  # Enough concurrent conversations to keep the sampler batched (4 users with batches of 8 gave too
  # few conversations to learn from in 11 minutes).
  c.serve.sim_users = 16
  c.serve.sim_duration_s = 1200.0
  if preset == "tiny":
    c.actor.batch_size = 4
    c.actor.lr = 1e-3
    c.actor.warmup_steps = 0  # tests train a few steps
    c.rollout.max_new_tokens = 16
    c.rollout.max_prompt_len = 512  # byte tokens: a question with its template is ~240
    c.rollout.prefill_buckets = (512,)
    c.rollout.num_slots = 8
    c.train.checkpoint_every = 2
    c.train.eval_size = 8
    c.serve.warmup = False  # tests: compile on first use
    c.serve.sim_users = 2
    c.serve.sim_duration_s = 20.0
  return lock(c)
