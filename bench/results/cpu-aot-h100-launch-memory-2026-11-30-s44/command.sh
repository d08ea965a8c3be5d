# Session 44, AMD machine (2 cores), jax 0.10.2 + jax[cuda12] 0.10.2 in /tmp/cuda (bench/aot_decode.py's
# docstring); no GPU. The decode call the sampler's memory plan counts (every slot, the largest kv bucket,
# 16 steps a call, paged cache read by the Pallas kernel, layers unrolled, bf16, the library's GEMMs as the
# engine's own), under each launch the engine times on a GPU, compiled for an H100 here: its temporaries,
# which launch_tuning.within_plan compares with the plan's.
S=bench/results/cpu-aot-h100-launch-memory-2026-11-30-s44/launch_memory.py
/tmp/cuda/bin/python $S --model smollm2-135m --out bench/results/cpu-aot-h100-launch-memory-2026-11-30-s44/smollm2-135m.json
/tmp/cuda/bin/python $S --model qwen2.5-1.5b --out bench/results/cpu-aot-h100-launch-memory-2026-11-30-s44/qwen2.5-1.5b.json
