# On a 2-core CPU machine with no accelerator: the learner's memory plan (areal_jax/learner/memory.py)
# compiled by each target's own compiler. Venvs: jax[tpu]==0.10.2 (libtpu) and jax[cuda12]==0.10.2.
PYTHONPATH=$PWD /tmp/tpu/bin/python bench/learner.py --plan --target v5e:2x4 --only default,qwen3_lora \
    --json tpu_v5e.json > tpu_v5e.txt 2>&1
PYTHONPATH=$PWD /tmp/cu/bin/python bench/learner.py --plan --target h100 --devices 8 --only qwen7b,default \
    --json h100x8.json > h100x8.txt 2>&1
