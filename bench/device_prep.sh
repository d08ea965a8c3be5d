#!/usr/bin/env bash
# Prepares, on this machine, what bench/accelerator_check.sh needs on a lent GPU machine (Python
# 3.12 and jax 0.11.2 with its CUDA plugin are installed there; nothing can be fetched there):
#   bash bench/device_prep.sh          (from the repository root; then the command it prints)
# - .whl/: flax 0.12.12 for Python 3.12. The lock's flax (0.12.8) does not import under jax 0.11.2
#   (jax.experimental.hijax has no HiPrimitive); 0.12.12 does, and the suite passed under it
#   (bench/results/cpu-aot-h100-jax0112-2026-11-29-4409721).
# - .old/areal_jax: the code before the decode work (955fbb8^), whose SmolLM2 step is the baseline
#   the shipped step is compared with.
# Both are kept out of git (.git/info/exclude) and travel with the device call (its `carry`).
set -eu
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
for p in /.whl/ /.old/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
rm -rf .whl .old && mkdir -p .whl .old
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl flax==0.12.12
git archive 955fbb8^ areal_jax | tar -x -C .old
ls .whl; ls .old
cat <<'EOF'
On the device (tool `run`, carry [".whl", ".old"], timeout_s 600):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; OUT=$OUT ACC_DEADLINE=560 bash bench/accelerator_check.sh $PWD/.old > $OUT/log.txt 2>&1; tail -c 11000 $OUT/log.txt
EOF
