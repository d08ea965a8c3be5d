# Session 39 (2026-11-29, AMD EPYC 2 cores, jax 0.10.2; no accelerator).
# 1. The sampler's memory plan with a paged pool sized to memory (5b44602) against before (960ff46),
#    :qwen3 with thinking at 16k compiled for H100s (venv with jax[cuda12]==0.10.2 at /tmp/cu);
#    XLA/libtpu log noise filtered out of the .txt files:
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cu/bin/python bench/learner.py --plan \
  --target h100 --devices 8 --only qwen3 --set rollout.max_new_tokens=16384 \
  --set task.enable_thinking=True --set actor.scan_layers=False \
  --json bench/results/pool-plan-2026-11-29-s39/h100-q3-after.json   # (and -before, run at 960ff46)
# 2. paged_cache.py with the plan's choice (the "planned" row), on this CPU:
.venv/bin/python bench/paged_cache.py --json bench/results/pool-plan-2026-11-29-s39/paged_cache.json
# the plan before this session within the same budget (code of 960ff46 in a worktree at /tmp/before):
(cd /tmp/before && PYTHONPATH=/tmp/before /work/main/.venv/bin/python \
  /work/main/bench/results/pool-plan-2026-11-29-s39/oldfit.py 2568959992)   # -> 16 slots, 144 pages
.venv/bin/python bench/results/pool-plan-2026-11-29-s39/oldchoice_run.py    # that engine's throughput
# 3. weights across processes, float32 against cast to bfloat16 before they leave the learner:
.venv/bin/python bench/weight_transfer.py --versions 4 --json bench/results/pool-plan-2026-11-29-s39/weight_transfer.json
# 4. the default recipe with Orbax versions (now cast to bfloat16 before they are written), compiled
#    for TPU v5e chips (venv with jax[tpu]==0.10.2, libtpu 0.0.42 at /tmp/tpu):
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 \
  --only default --set weights.transfer=orbax --json bench/results/pool-plan-2026-11-29-s39/v5e-default-orbax.json
