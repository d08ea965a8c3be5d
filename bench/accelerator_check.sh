#!/usr/bin/env bash
# The sampler's accelerator measurements in one go, most telling first (for a GPU/TPU machine):
#   OUT=/some/dir bash bench/accelerator_check.sh [legacy_checkout_root]
# The whole script keeps to $ACC_DEADLINE seconds (default 570: one device call may run 600 s);
# each step gets its own limit or what is left, whichever is less, and a step with under 30 s left
# is skipped (its log line says so), so one that hangs or fails leaves the others' results.
# 1. SmolLM2 shape (64 slots, context 128): the floor loop and our step under the kernel choices,
#    fused projections (the default) against separate ones (bench/decode_variants.py; about a
#    minute; pallas_gpu:scan reads the stacked cache in place through JAX's paged GPU kernel),
#    with a profiler trace of the first variant
#    (summarize it with bench/trace_top.py "$OUT/smollm2_trace.json.gz");
# 2. with a legacy checkout's areal_jax (argument 1, e.g. `git archive 955fbb8^ areal_jax`), the
#    same SmolLM2 step as that code ran it;
# 3. Qwen2.5-1.5B shape (128 slots, context 512): bench/sampler.py --decode-only (floor_ratio,
#    hbm_roofline_frac) with a fresh compilation cache, so XLA's per-fusion matmul autotuning is
#    shared by the floor and our programs (on an H200, jax 0.11.2, autotuning one such program took
#    minutes: bench/results/h200-2026-11-26);
# 4. the 1.5B shape again with cuBLAS for every matmul (--xla_gpu_enable_triton_gemm=false: less to
#    autotune), the paged Pallas GPU kernel among the variants;
# 5. the same with the paged KV cache (rollout.kv_pages): the paged GPU kernel and the dense read
#    over gathered pages;
# 6. the SmolLM2 shape with XLA's dynamic-slice fusion on (--xla_gpu_enable_dynamic_slice_fusion):
#    whether the scan's extra time over the unrolled layers on the H200 (1.95 against 1.50 ms) is
#    the copy of each layer's weight slices out of the stacked weights before its matmuls;
# 7. the SmolLM2 shape with XLA's DotMerger off (--xla_gpu_dot_merger_threshold_mb=0): the floor and
#    our separate-weights variants, so the cost of the weight concatenations it makes is measured.
set -u
OUT=${OUT:-/tmp/accelerator_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
BIG=${ACC_BIG:-qwen2.5-1.5b}
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|read |first call| s |error|Error|bench took"; }
log() { echo "=== $(date +%T) $*"; }
DEADLINE=${ACC_DEADLINE:-570}
# limit SECS: prints the step's time limit (SECS or what is left before DEADLINE, less 10 s);
# fails (the step is skipped) when under 30 s are left
limit() { local left=$((DEADLINE - SECONDS - 10)); [ "$left" -lt "$1" ] && set -- "$left"
  [ "$1" -ge 30 ] || { echo "=== skipped: $((DEADLINE - SECONDS)) s left of $DEADLINE" >&2; return 1; }
  echo "$1"; }
log machine; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
log variants smollm2; t=$(limit 120) && timeout "$t" python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:scan:16,dense:scan:16:separate,dense:unrolled:16,dense:unrolled:16:separate,pallas_gpu:scan:16 \
  --fused-floor --trace "$OUT/trace" --json "$OUT/variants_smollm2.json" 2>&1 | keep
f=$(ls "$OUT"/trace/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)
[ -n "$f" ] && mv "$f" "$OUT/smollm2_trace.json.gz"; rm -rf "$OUT/trace"
if [ -n "${1:-}" ]; then
  log legacy smollm2; t=$(limit 60) && PYTHONPATH="$1:$PYTHONPATH" timeout "$t" python3 bench/decode_variants.py --legacy \
    --no-floor --model=smollm2-135m --variants x:x:1,x:x:8 --json "$OUT/legacy_smollm2.json" 2>&1 | keep
fi
log sampler "$BIG"; t=$(limit 330) && timeout "$t" python3 bench/sampler.py --decode-only --model="$BIG" \
  --json "$OUT/sampler_big.json" 2>&1 | keep
log variants "$BIG" cublas; t=$(limit 300) && \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" timeout "$t" python3 bench/decode_variants.py --model="$BIG" --reps 3 \
  --variants dense:scan:16,dense:scan:16:separate,dense:unrolled:16,pallas_gpu:scan:16 \
  --json "$OUT/variants_big_cublas.json" 2>&1 | keep
log variants "$BIG" paged cublas; t=$(limit 240) && \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" timeout "$t" python3 bench/decode_variants.py --model="$BIG" --reps 3 --no-floor \
  --variants pallas_gpu:scan:16:auto:paged,dense:scan:16:auto:paged \
  --json "$OUT/variants_big_paged.json" 2>&1 | keep
log variants smollm2 dynamic-slice-fusion; t=$(limit 90) && \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" timeout "$t" python3 \
  bench/decode_variants.py --model=smollm2-135m --reps 5 --variants dense:scan:16,dense:unrolled:16 \
  --fused-floor --json "$OUT/variants_smollm2_dsfusion.json" 2>&1 | keep
log variants smollm2 no-dot-merger; t=$(limit 90) && \
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_dot_merger_threshold_mb=0" timeout "$t" python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:scan:16:separate,dense:unrolled:16:separate,dense:scan:16 \
  --json "$OUT/variants_smollm2_nomerge.json" 2>&1 | keep
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
