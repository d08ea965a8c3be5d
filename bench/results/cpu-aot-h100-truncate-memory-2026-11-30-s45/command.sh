# Session 45, AMD machine (2 cores), jax 0.10.2 + jax[cuda12] 0.10.2 in /tmp/cuda (bench/aot_decode.py's
# docstring); no GPU. The decode call the sampler's memory plan counts (every slot, the largest kv bucket,
# 16 steps a call, paged cache read by the Pallas kernel, layers unrolled, bf16), in its two programs on a
# GPU: without the top-k / top-p sort and with it, under the library's GEMMs and XLA's, compiled for an
# H100 here: their temporaries.
S=bench/results/cpu-aot-h100-truncate-memory-2026-11-30-s45/truncate_memory.py
/tmp/cuda/bin/python $S --model smollm2-135m --out bench/results/cpu-aot-h100-truncate-memory-2026-11-30-s45/smollm2-135m.json
/tmp/cuda/bin/python $S --model qwen2.5-1.5b --out bench/results/cpu-aot-h100-truncate-memory-2026-11-30-s45/qwen2.5-1.5b.json
