set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/bench" JAX_LOG_COMPILES=1
CB="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
filt() { grep -v -E "Warning|warnings.warn|Compiling|Persistent" | grep -E "Finished XLA|Finished tracing|Finished jaxpr|  [0-9.]+ s |ms/step|read |floor|Error|error|Killed" | grep -v -E "Finished (tracing|jaxpr)" ; }
echo "=== $(date +%T) A qwen default flags"
XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_as_text" timeout 170 python3 bench/decode_variants.py --model=qwen2.5-1.5b --reps 2 \
  --variants dense:scan:16 --trace /tmp/tr --json $OUT/A_qwen.json 2>&1 | filt
f=$(ls -S /tmp/xd/*after_optimizations.txt 2>/dev/null | head -1); [ -n "$f" ] && cp "$f" $OUT/A_qwen_hlo.txt && echo "hlo $f"
t=$(ls /tmp/tr/plugins/profile/*/perfetto_trace.json.gz 2>/dev/null | head -1); [ -n "$t" ] && cp "$t" $OUT/A_qwen_trace.json.gz
echo "=== $(date +%T) B qwen autotune 0 + command buffers"
XLA_FLAGS="--xla_gpu_autotune_level=0 $CB" timeout 130 python3 bench/decode_variants.py --model=qwen2.5-1.5b --reps 2 \
  --no-floor --variants dense:scan:16 --json $OUT/B_qwen.json 2>&1 | filt
echo "=== $(date +%T) C smollm2 command buffers"
XLA_FLAGS="$CB" timeout 70 python3 bench/decode_variants.py --model=smollm2-135m --reps 5 \
  --variants dense:unrolled:16,dense:scan:16 --json $OUT/C_smol.json 2>&1 | filt
echo "=== $(date +%T) done"; ls -la $OUT
