# On a 2-core CPU machine with no accelerator, session 41: the learner's memory plan with the cast
# each published version makes (the `publish` column). Venv for libtpu: jax[tpu]==0.10.2.
XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/learner.py --plan \
    --json cpu.json > cpu.txt 2>&1                                          # 3 min 8 s
PYTHONPATH=$PWD /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only default,qwen3 \
    --json tpu_v5e.json > tpu_v5e.txt 2>&1                                  # 6 min 16 s
