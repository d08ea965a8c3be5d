#!/usr/bin/env bash
# Call 2 of session 27 on the H100: the Pallas GPU kernel (paged and not) against the dense read,
# at both shapes, and bench/sampler.py with $AREAL_JAX_DECODE_ATTENTION=pallas_gpu (the issue's
# keys for that choice). OUT=dir bash 2_command.sh (from the repo root)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|read |first call|error|Error|bench took|decode at" | cut -c1-260; }
log() { echo "=== $(date +%T) $*"; }
DEADLINE=${ACC_DEADLINE:-400}
limit() { local left=$((DEADLINE - SECONDS - 10)); [ "$left" -lt "$1" ] && set -- "$left"
  [ "$1" -ge 30 ] || { echo "=== skipped: $((DEADLINE - SECONDS)) s left" >&2; return 1; }; echo "$1"; }
log variants qwen2.5-1.5b; t=$(limit 130) && timeout "$t" python3 bench/decode_variants.py --model=qwen2.5-1.5b \
  --reps 3 --floor-matmul blas --trace "$OUT/trace" --json "$OUT/variants_big.json" --variants \
  pallas_gpu:unrolled:16:blas:paged,pallas_gpu:unrolled:16:blas,dense:unrolled:16:blas:paged,pallas_gpu:unrolled:16:xla:paged,dense:unrolled:16:blas \
  2>&1 | keep
f=$(ls "$OUT"/trace/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1)
[ -n "$f" ] && mv "$f" "$OUT/big_paged_trace.json.gz" && python3 bench/trace_top.py \
  "$OUT/big_paged_trace.json.gz" --top 22 2>&1 | sed -n '/device:GPU/,$p' | head -26; rm -rf "$OUT/trace"
log variants smollm2; t=$(limit 100) && timeout "$t" python3 bench/decode_variants.py --model=smollm2-135m \
  --reps 5 --floor-matmul blas --json "$OUT/variants_smollm2.json" --variants \
  dense:unrolled:16:blas,pallas_gpu:unrolled:16:blas,pallas_gpu:unrolled:16:blas:paged,dense:unrolled:16:xla,pallas_gpu:unrolled:16:xla,pallas_gpu:unrolled:16:xla:paged \
  2>&1 | keep
for m in qwen2.5-1.5b smollm2-135m; do
  log sampler $m pallas_gpu; t=$(limit 60) && AREAL_JAX_DECODE_ATTENTION=pallas_gpu timeout "$t" \
    python3 bench/sampler.py --decode-only --model=$m --json "$OUT/sampler_${m%%-*}_pallas.json" 2>&1 | keep
done
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
