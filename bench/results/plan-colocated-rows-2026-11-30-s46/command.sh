# Session 46 (2026-11-30, AMD EPYC 2 cores, jax 0.10.2; libtpu in /tmp/tpu; no accelerator): the
# colocated LoRA recipe's plan compiled for a TPU v5e chip with multi-turn episodes, before (d1751db +
# this session's continuation change: bench/learner.py unchanged, *-before.*) and after (rows counted).
PYTHONPATH=$PWD:$PWD/bench /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only qwen3_lora \
  --set rollout.workflow=multi_turn --json bench/results/plan-colocated-rows-2026-11-30-s46/v5e-qwen3_lora-multi_turn.json
