#!/usr/bin/env bash
# The sampler's accelerator measurements in one go, most telling first (for a GPU/TPU machine):
#   OUT=/some/dir bash bench/accelerator_check.sh [legacy_checkout_root]
# The whole script keeps to $ACC_DEADLINE seconds (default 560: one device call may run 600 s);
# each step gets its own limit or what is left, whichever is less, and a step with under 30 s left
# is skipped (its log line says so), so one that hangs or fails leaves the others' results.
# At most 8 files land in $OUT (what one device call brings back). JAX_LOG_COMPILES is on and the
# decode programs' compile times are kept in the log: on an H100 (bench/results/h100-2026-11-27)
# no program at the 1.5B shape compiled within 60-170 s, the floor loop then holding its weights
# as 3 GB of constants in its program (now arguments; compiled for an H100 on a CPU with
# bench/aot_decode.py the 1.5B programs take 2-16 s without autotuning).
# 1. Qwen2.5-1.5B shape (128 slots, context 512): bench/sampler.py --decode-only as shipped (on a
#    GPU: the layers unrolled, decode_matmul 'blas', the library's GEMMs with no autotuning; the
#    floor loop's program gets the same options), the keys (floor_ratio, hbm_roofline_frac);
# 2. the same shape under several kernel choices with 'blas' (bench/decode_variants.py): unrolled
#    against the scan (which copies each layer's weights and cache slice every step), with a
#    profiler trace of the first summarized per kernel (bench/trace_top.py);
# 3. SmolLM2-135M shape (64 slots, context 128): variants, XLA's autotuned GEMMs against 'blas';
#    then the 'blas' default without its query groups padded to 8 rows (kernels.choice.query_rows);
# 4. with a legacy checkout's areal_jax (argument 1, e.g. `git archive 955fbb8^ areal_jax`), the
#    same SmolLM2 step as that code ran it (the "today");
# 5. the 1.5B shape with XLA's autotuned GEMMs (decode_matmul 'xla': minutes per program on an
#    H200) with the time left.
set -u
OUT=${OUT:-/tmp/accelerator_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d) JAX_LOG_COMPILES=1
BIG=${ACC_BIG:-qwen2.5-1.5b}
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|read |first call| s |error|Error|bench took|decode at|Finished XLA compilation of jit\((fn|<lambda>)\)|Compiling jit\((fn|<lambda>)\)" | cut -c1-220; }
log() { echo "=== $(date +%T) $*"; }
DEADLINE=${ACC_DEADLINE:-560}
# limit SECS: prints the step's time limit (SECS or what is left before DEADLINE, less 10 s);
# fails (the step is skipped) when under 30 s are left
limit() { local left=$((DEADLINE - SECONDS - 10)); [ "$left" -lt "$1" ] && set -- "$left"
  [ "$1" -ge 30 ] || { echo "=== skipped: $((DEADLINE - SECONDS)) s left of $DEADLINE" >&2; return 1; }
  echo "$1"; }
# trace NAME: moves the profile under $OUT/trace to $OUT/NAME_trace.json.gz and prints its top kernels
trace() { local f; f=$(ls "$OUT"/trace/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)
  [ -n "$f" ] && mv "$f" "$OUT/$1_trace.json.gz" && python3 bench/trace_top.py "$OUT/$1_trace.json.gz" \
    --top 22 2>&1 | head -60; rm -rf "$OUT/trace"; }
log machine; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tail -2
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
log sampler "$BIG" as shipped; t=$(limit 150) && timeout "$t" python3 bench/sampler.py \
  --decode-only --model="$BIG" --json "$OUT/sampler_big.json" 2>&1 | keep
log variants "$BIG" blas; t=$(limit 150) && timeout "$t" python3 bench/decode_variants.py --model="$BIG" --reps 3 \
  --floor-matmul blas --variants dense:unrolled:16:blas,dense:scan:16:blas,dense:unrolled:16:separate:blas,pallas_gpu:unrolled:16:blas:paged \
  --trace "$OUT/trace" --json "$OUT/variants_big_blas.json" 2>&1 | keep
trace big
log variants smollm2; t=$(limit 90) && timeout "$t" python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:unrolled:16:blas,dense:unrolled:16:xla,dense:scan:16:blas,dense:scan:16:xla,pallas_gpu:scan:16:blas \
  --floor-matmul blas --json "$OUT/variants_smollm2.json" 2>&1 | keep
log variants smollm2 query groups unpadded; t=$(limit 45) && AREAL_JAX_DECODE_QUERY_ROWS=1 timeout "$t" \
  python3 bench/decode_variants.py --model=smollm2-135m --reps 5 --no-floor --variants dense:unrolled:16:blas \
  --json "$OUT/variants_smollm2_rows1.json" 2>&1 | keep
if [ -n "${1:-}" ]; then
  log legacy smollm2; t=$(limit 60) && PYTHONPATH="$1:$PYTHONPATH" timeout "$t" python3 bench/decode_variants.py --legacy \
    --no-floor --model=smollm2-135m --variants x:x:1 --json "$OUT/legacy_smollm2.json" 2>&1 | keep
fi
log sampler "$BIG" xla; t=$(limit 300) && AREAL_JAX_DECODE_MATMUL=xla timeout "$t" python3 bench/sampler.py \
  --decode-only --model="$BIG" --json "$OUT/sampler_big_xla.json" 2>&1 | keep
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
