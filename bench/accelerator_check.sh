#!/usr/bin/env bash
# The sampler's accelerator measurements in one go, most telling first (for a GPU/TPU machine):
#   OUT=/some/dir bash bench/accelerator_check.sh [legacy_checkout_root]
# 1. SmolLM2 shape (64 slots, context 128): the floor loop and our step under the kernel choices,
#    fused projections (the default) against separate ones (bench/decode_variants.py; about a
#    minute; pallas_gpu:scan reads the stacked cache in place through JAX's paged GPU kernel),
#    with a profiler trace of the first variant
#    (summarize it with bench/trace_top.py "$OUT/smollm2_trace.json.gz");
# 1b. the same shape with XLA's DotMerger off (--xla_gpu_dot_merger_threshold_mb=0): the floor and
#    our separate-weights variants, so the cost of the weight concatenations it makes is measured;
# 2. with a legacy checkout's areal_jax (argument 1, e.g. `git archive 955fbb8^ areal_jax`), the
#    same SmolLM2 step as that code ran it;
# 3. Qwen2.5-1.5B shape (128 slots, context 512): bench/sampler.py --decode-only (floor_ratio,
#    hbm_roofline_frac) with a fresh compilation cache, so XLA's per-fusion matmul autotuning is
#    shared by the floor and our programs (on an H200, jax 0.11.2, autotuning one such program took
#    minutes: bench/results/h200-2026-11-26);
# 4. the 1.5B shape again with cuBLAS for every matmul (--xla_gpu_enable_triton_gemm=false: less to
#    autotune), the paged Pallas GPU kernel among the variants;
# 5. the same with the paged KV cache (rollout.kv_pages): the paged GPU kernel and the dense read
#    over gathered pages.
# Every step has its own time limit, so one that hangs or fails leaves the others' results.
set -u
OUT=${OUT:-/tmp/accelerator_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
BIG=${ACC_BIG:-qwen2.5-1.5b}
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|read |first call| s |error|Error|bench took"; }
log() { echo "=== $(date +%T) $*"; }
log machine; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
log variants smollm2; timeout 120 python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:scan:16,dense:scan:16:separate,dense:unrolled:16,dense:unrolled:16:separate,pallas_gpu:scan:16 \
  --fused-floor --trace "$OUT/trace" --json "$OUT/variants_smollm2.json" 2>&1 | keep
f=$(ls "$OUT"/trace/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)
[ -n "$f" ] && mv "$f" "$OUT/smollm2_trace.json.gz"; rm -rf "$OUT/trace"
log variants smollm2 no-dot-merger; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_dot_merger_threshold_mb=0" \
  timeout 90 python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:scan:16:separate,dense:unrolled:16:separate,dense:scan:16 \
  --json "$OUT/variants_smollm2_nomerge.json" 2>&1 | keep
if [ -n "${1:-}" ]; then
  log legacy smollm2; PYTHONPATH="$1:$PYTHONPATH" timeout 90 python3 bench/decode_variants.py --legacy \
    --no-floor --model=smollm2-135m --variants x:x:1,x:x:8 --json "$OUT/legacy_smollm2.json" 2>&1 | keep
fi
log sampler "$BIG"; timeout 600 python3 bench/sampler.py --decode-only --model="$BIG" \
  --json "$OUT/sampler_big.json" 2>&1 | keep
log variants "$BIG" cublas; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" timeout 300 \
  python3 bench/decode_variants.py --model="$BIG" --reps 3 \
  --variants dense:scan:16,dense:scan:16:separate,dense:unrolled:16,pallas_gpu:scan:16 \
  --json "$OUT/variants_big_cublas.json" 2>&1 | keep
log variants "$BIG" paged cublas; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
  timeout 240 python3 bench/decode_variants.py --model="$BIG" --reps 3 --no-floor \
  --variants pallas_gpu:scan:16:auto:paged,dense:scan:16:auto:paged \
  --json "$OUT/variants_big_paged.json" 2>&1 | keep
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
