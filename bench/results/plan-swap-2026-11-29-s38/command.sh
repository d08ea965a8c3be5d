# Session 38 (2026-11-29, AMD EPYC 2 cores, jax 0.10.2, libtpu 0.0.42; no accelerator): the
# sampler's memory plans with a weight swap as it happens, compiled by libtpu for TPU v5e chips.
# venv with jax[tpu]==0.10.2 at /tmp/tpu (make install ACCEL=tpu into a scratch venv)
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 \
  --only default,qwen3_lora --json bench/results/plan-swap-2026-11-29-s38/v5e-default-qwen3_lora.json
#   (this first run printed no sampler plan for the default recipe: the bench's check of the
#    sampler's replicas refused a target's multi-host devices; fixed, then:)
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 \
  --only default --json bench/results/plan-swap-2026-11-29-s38/v5e-default.json
# a LoRA version merged, converted, and both in one program, Qwen3-1.7B shape, rank 16
# (temporaries and outputs of each program as the target's compiler assigns them):
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/results/plan-swap-2026-11-29-s38/lora_merge.py v5e:2x2
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cu/bin/python \
  bench/results/plan-swap-2026-11-29-s38/lora_merge.py h100
PYTHONPATH=$PWD:$PWD/bench .venv/bin/python bench/results/plan-swap-2026-11-29-s38/lora_merge.py cpu
# :qwen3 thinking at 16k (the learner and the sampler's plan; the sampler lowers its slots to 4)
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only qwen3 \
  --set rollout.max_new_tokens=16384 --set task.enable_thinking=True --set actor.scan_layers=False \
  --json bench/results/plan-swap-2026-11-29-s38/v5e-qwen3-thinking16k.json
# the same sampler at 4 slots by the count before this session (2 x weights + programs), run at
# the start of the session with the code of f51ba0f (q3plan_old_count.py 4 0 auto auto)
# default recipe, versions arriving in float32 (Orbax), before the pausing swap existed (0dedcf4^):
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 \
  --only default --set weights.transfer=orbax --json bench/results/plan-swap-2026-11-29-s38/v5e-default-orbax.json
# qwen3_lora compiled for an H100 (jax[cuda12]==0.10.2 at /tmp/cu)
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cu/bin/python bench/learner.py --plan \
  --target h100 --devices 1 --only qwen3_lora --json bench/results/plan-swap-2026-11-29-s38/h100-qwen3_lora.json
# final v5e plans (default, qwen3_lora) with every change of the session:
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 \
  --only default,qwen3_lora --json bench/results/plan-swap-2026-11-29-s38/v5e-final.json
# the default recipe compiled for 8 H100s (4 + 4; the bench plans every recipe against 16 GiB)
PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cu/bin/python bench/learner.py --plan \
  --target h100 --devices 8 --only default --json bench/results/plan-swap-2026-11-29-s38/h100-default.json
