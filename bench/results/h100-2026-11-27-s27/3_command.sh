#!/usr/bin/env bash
# Call 3 of session 27 on the H100: bench/sampler.py as shipped with the paged cache the GPU's
# default (kernels.choice.kv_pages, the Pallas GPU kernel over pages), both decode shapes, then the
# quick run's continuous/static rows (the service over the pages). OUT=dir bash 3_command.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|tok/s|speedup|error|Error|Traceback|bench took|decode at" | cut -c1-300; }
log() { echo "=== $(date +%T) $*"; }
DEADLINE=${ACC_DEADLINE:-330}
limit() { local left=$((DEADLINE - SECONDS - 10)); [ "$left" -lt "$1" ] && set -- "$left"
  [ "$1" -ge 30 ] || { echo "=== skipped: $((DEADLINE - SECONDS)) s left" >&2; return 1; }; echo "$1"; }
for m in qwen2.5-1.5b smollm2-135m; do
  log sampler $m as shipped; t=$(limit 75) && timeout "$t" python3 bench/sampler.py --decode-only \
    --model=$m --json "$OUT/sampler_${m%%-*}.json" 2>&1 | keep
done
log sampler quick; t=$(limit 170) && timeout "$t" python3 bench/sampler.py --quick \
  --json "$OUT/sampler_quick.json" 2>&1 | keep
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
