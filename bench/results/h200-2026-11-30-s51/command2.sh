#!/usr/bin/env bash
# Session 51, device call 2 (~200 s left of the session's device time): the 1.5B shape as shipped
# with the launch stages changed after call 1 (warps=4 offered instead of block_pages=4; the
# library's GEMMs autotuned), the same over pages of 128 positions, then the SmolLM2 shape.
# OUT=... bash bench/results/h200-2026-11-30-s51/command2.sh   (from the repository root)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|launch kept|bench took|rror" | cut -c1-900; }
run() { local name=$1 t=$2; shift 2; echo "=== $(date +%T) $name (limit $t s)"
  timeout "$t" python3 bench/sampler.py --decode-only --json "$OUT/$name.json" "$@" 2>&1 | keep; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run big_p64 75 --model=qwen2.5-1.5b
run big_p128 70 --model=qwen2.5-1.5b --page-size 128
run smollm2 50 --model=smollm2-135m
echo "=== $(date +%T) done"
