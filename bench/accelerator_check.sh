#!/usr/bin/env bash
# The sampler's accelerator measurements in one go, most telling first (for a GPU/TPU machine):
#   OUT=/some/dir bash bench/accelerator_check.sh [legacy_checkout_root]
# (bench/device_prep.sh prepares, on a machine with pip, the flax wheel and the legacy checkout a
# lent GPU machine needs, and prints the command to run there)
# The whole script keeps to $ACC_DEADLINE seconds (default 560: one device call may run 600 s);
# each step gets its own limit or what is left, whichever is less, and a step with under 30 s left
# is skipped (its log line says so), so one that hangs or fails leaves the others' results.
# At most 8 files land in $OUT (what one device call brings back; 7 here and the caller's log).
# JAX_LOG_COMPILES is on and the decode programs' compile times are kept in the log (every program
# compiled in 1-9 s and the whole script ran in 204 s on an H100: bench/results/h100-2026-11-27-8a1f9a5).
# In order, most telling first (a step that does not fit the deadline is skipped; the last full run,
# on an H200: bench/results/h200-2026-11-30-c75e3df):
# 1. SmolLM2-135M shape (64 slots, context 128): bench/sampler.py --decode-only as shipped (on a
#    GPU: a paged cache, the layers unrolled, decode_matmul 'blas', and the kernel launch the
#    engine keeps after timing its stages, rollout.decode_tuning: our paged step kernel
#    (writes=1, dot=1, stages=1, block_pages=2, warps=4), the fused norms, the loop in CUDA
#    graphs, the library's GEMMs autotuned, XLA's GEMMs; "launch kept" in the log, with each
#    one's step and first call, compile included);
# 2. with a legacy checkout's areal_jax (argument 1, e.g. `git archive 955fbb8^ areal_jax`), the
#    same SmolLM2 step as that code ran it (the baseline the decode work is compared with), on the
#    same device (1 and 2 run again after 3);
# 3. the Qwen2.5-1.5B shape (128 slots, context 512) as shipped;
# 4. the SmolLM2 attention alone (bench/paged_kernel.py) against the positions a row reads (8-512),
#    the SmolLM2 step as in 1 with XLA's programmatic dependent launch on (--xla_gpu_enable_pdl),
#    and a long rollout's attention at the 1.5B shape (4,032 positions a slot);
# 5. SmolLM2 shape under several choices (bench/decode_variants.py): our kernel with tensor-core
#    dots (launch=writes=1+dot=1, the launch an H200 keeps; profiled,
#    bench/trace_top.py), it with Triton's loop unpipelined (stages=1), reading two pages a step
#    of its loop (block_pages=2), JAX's paged kernel (the default), the fused norms, top-k /
#    top-p decided in every step by a conditional (branch), the dense read;
#    then a layer's attention alone (bench/paged_kernel.py: JAX's Pallas kernel and ours under
#    their launches, pages of 64 and 32), the RMSNorm + matmul pieces alone
#    (bench/norm_matmul.py), the whole step with the fastest attention launch;
# 6. the same at the 1.5B shape (pages of 64 and 128; warps=4 too, which an H200 keeps there);
# 7. bench/sampler.py --quick (the service's continuous batching over the paged default), the
#    causal attention of whole rows (bench/causal_attention.py: JAX's flash kernel against the
#    dense form, rows of 1k-16k).
set -u
OUT=${OUT:-/tmp/accelerator_check}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench"
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d) JAX_LOG_COMPILES=1
BIG=${ACC_BIG:-qwen2.5-1.5b}
keep() { grep -v -E "Warning|warnings.warn" | grep -E "ms/step|tok/s|read |first call| s |error|Error|bench took|decode at|launch kept|decode launch|Finished XLA compilation of jit\((fn|<lambda>)\)|Compiling jit\((fn|<lambda>)\)" | cut -c1-220; }
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
# the SmolLM2 step as shipped, the launch timed and kept by the engine (10 launches timed), then the
# legacy step: the best of 20 one-step calls and their median (it is host-bound and varies between
# machines of one kind, so it is timed on the same device; its figure in the log only). smollm N:
# the pair, its JSON numbered N; run twice, before and after the 1.5B shape
smollm() {
  log sampler smollm2 as shipped, run "$1"; t=$(limit 110) && timeout "$t" python3 bench/sampler.py \
    --decode-only --model=smollm2-135m --json "$OUT/sampler_smollm2_$1.json" 2>&1 | keep
  [ -n "$LEGACY" ] || return 0
  log legacy smollm2, run "$1"; t=$(limit 60) && PYTHONPATH="$LEGACY:$PYTHONPATH" timeout "$t" \
    python3 bench/decode_variants.py --legacy --no-floor --model=smollm2-135m --variants x:x:1 \
    --reps 20 2>&1 | keep
}
LEGACY=${1:-}
smollm 1
log sampler "$BIG" as shipped; t=$(limit 150) && timeout "$t" python3 bench/sampler.py \
  --decode-only --model="$BIG" --json "$OUT/sampler_big.json" 2>&1 | keep
smollm 2
# (its figures in the log only) the SmolLM2 attention alone against the positions each row reads,
# under the launch kept there (at context 128, 4 pages a row, it is bound by latency): a program's
# fixed cost against each page's
log smollm2-135m attention against the positions read; t=$(limit 45) && timeout "$t" bash -c '
  for c in 8 64 128 256 512; do python3 bench/paged_kernel.py --model=smollm2-135m --context $c \
    --no-dense --reps 10 --tunings "writes=1,dot=1;writes=1,dot=1,block_pages=2" 2>&1 \
    | grep -E "shape:|us a layer" | cut -c1-200; done'
# (its figures in the log only) the same SmolLM2 step with XLA's programmatic dependent launch
# (--xla_gpu_enable_pdl, Hopper and later: a kernel XLA emits waits in its own prologue for the
# one before it, launched before that one ends). The step is bound by ~8 kernels a layer each
# waiting for the last, and CUDA graphs did not shorten it (bench/results/h200-2026-11-30-c75e3df), so
# what is left is each kernel's start on the device, which PDL overlaps. Not yet timed on a GPU; a
# jax without the flag fails at start-up (its error in the log)
log smollm2 as shipped under XLA_FLAGS=--xla_gpu_enable_pdl=true; t=$(limit 70) && \
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_pdl=true" timeout "$t" python3 \
  bench/sampler.py --decode-only --model=smollm2-135m 2>&1 | keep
# (its figures in the log only) a long rollout's attention: our kernel reading a row in one program
# against in parts (auto_parts: 5 at this bound), with dots, and JAX's kernel; 4,032 positions
# a slot (not yet reached on a GPU within the deadline)
log "$BIG" long context, Pallas kernel launches; t=$(limit 60) && timeout "$t" python3 bench/paged_kernel.py \
  --model="$BIG" --context 4032 --no-dense --reps 3 --tunings "default;writes=1,dot=1;writes=1,dot=1,warps=4;writes=1,dot=1,block_pages=2;writes=1,dot=1,parts=1" 2>&1 \
  | grep -v -E "Warning|warnings.warn" | cut -c1-200
# the first variant (traced) is the launch an H200 keeps at both shapes (writes=1,dot=1), then it
# with Triton's loop unpipelined (stages=1)
log variants smollm2; t=$(limit 80) && timeout "$t" python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1+stages=1,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1+block_pages=2,pallas_gpu:unrolled:16:blas:paged,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1:norms,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1:branch,dense:unrolled:16:xla \
  --floor-matmul blas --trace "$OUT/trace" --json "$OUT/variants_smollm2.json" 2>&1 | keep
trace smollm2
# fastest JSON: the fastest Pallas launch over pages of 64 in a paged_kernel.py JSON ("" if none)
KJSON=$(mktemp -d)  # (the kernel sweeps' JSON: their figures in the log; $OUT brings back 8 files)
fastest() { python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['impl']=='pallas_gpu' and x['page_size']==64 and 'us_per_layer' in x]; print(min(r,key=lambda x:x['us_per_layer'])['tuning'] if r else '')" "$1" 2>/dev/null; }
# sweep MODEL PAGES LIMIT: a layer's attention alone under each launch (its JSON written row by
# row: a sweep cut short keeps its rows), the RMSNorm + matmul pieces alone (XLA's against our
# kernel under its launches), then the whole step with the fastest attention launch over pages of
# 64 against the launch the engine keeps (figures in the log only)
sweep() {
  log "$1" Pallas kernel launches; t=$(limit "$3") && timeout "$t" python3 bench/paged_kernel.py --model="$1" \
    --page-sizes "$2" --json "$KJSON/kernel_$1.json" 2>&1 | grep -v -E "Warning|warnings.warn" | cut -c1-200
  log "$1" norm and matmul pieces, XLA against our kernel; t=$(limit 60) && timeout "$t" \
    python3 bench/norm_matmul.py --model="$1" 2>&1 | grep -v -E "Warning|warnings.warn" | cut -c1-200
  local best; best=$(fastest "$KJSON/kernel_$1.json")
  [ -n "$best" ] && [ "$best" != default ] && [ "$best" != writes=1,dot=1 ] || return 0
  log "$1" whole step, writes=1,dot=1 against the fastest: "$best"; t=$(limit 75) && timeout "$t" \
    python3 bench/decode_variants.py --model="$1" --reps 5 --floor-matmul blas --variants \
    "pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1,pallas_gpu:unrolled:16:blas:paged:launch=${best//,/+}" 2>&1 | keep
}
sweep smollm2-135m 64,32 70
log variants "$BIG"; t=$(limit 90) && timeout "$t" python3 bench/decode_variants.py --model="$BIG" --reps 3 \
  --floor-matmul blas --variants pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1+stages=1,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1+block_pages=2,pallas_gpu:unrolled:16:blas:paged,pallas_gpu:unrolled:16:blas:paged:launch=writes=1+dot=1+warps=4,dense:unrolled:16:blas \
  --trace "$OUT/trace" --json "$OUT/variants_big.json" 2>&1 | keep
trace big
sweep "$BIG" 64,128 100
log sampler quick; t=$(limit 150) && timeout "$t" python3 bench/sampler.py --quick 2>&1 | keep
# (its figures in the log only)
log causal attention "$BIG", flash kernel against dense; t=$(limit 90) && timeout "$t" \
  python3 bench/causal_attention.py --model="$BIG" --reps 3 2>&1 | grep -v -E "Warning|warnings.warn" | cut -c1-200
rm -rf "$JAX_COMPILATION_CACHE_DIR"; log done; ls -la "$OUT"
