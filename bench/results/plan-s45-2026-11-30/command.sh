# Session 45 (2026-11-30, AMD EPYC 2 cores, jax 0.10.2; libtpu 0.0.42 in /tmp/tpu, jax[cuda12] 0.10.2 in
# /tmp/cuda; no accelerator): the default recipe's sampler memory plan compiled for an H100 and for a
# TPU v5e chip, before this session's changes (0288743, a git worktree at /tmp/wt_before) and after.
# before (run in /tmp/wt_before, the logs and JSON copied here as *-before.*):
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cuda/bin/python bench/learner.py --plan \
  --target h100 --only default --json /tmp/plan_before_h100.json
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only default \
  --set rollout.workflow=multi_turn --json /tmp/plan_before_v5e_mt.json
# after (this checkout):
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cuda/bin/python bench/learner.py --plan \
  --target h100 --only default --json bench/results/plan-s45-2026-11-30/h100-default.json
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only default \
  --set rollout.workflow=multi_turn --json bench/results/plan-s45-2026-11-30/v5e-default-multi_turn.json
