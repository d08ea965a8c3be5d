# Session 43, AMD machine (2 cores), jax 0.10.2 + jax[cuda12] 0.10.2 in /tmp/cuda (bench/aot_decode.py's
# docstring); no GPU. Kernels a SmolLM2 decode step runs under the launches the engine now times on a GPU,
# with XLA's autotuned GEMMs (the new last stage, Launch.matmul) beside the library's, compiled for an H100
# here (session 42's counting script; its caveats hold: no CUDA driver here, so XLA drops the command types
# that need CUDA >= 12.3 from its command buffers, and what is a host launch on a GPU may differ).
S=bench/results/cpu-aot-h100-graphs-2026-11-30-s42/graphs_thunks.py
for mm in blas xla; do
  for launch in writes=1 writes=1,dot=1; do
    AREAL_JAX_PALLAS_GPU_PAGED=$launch AREAL_JAX_DECODE_NORM_MATMUL=1 /tmp/cuda/bin/python $S --matmul $mm --graphs none
  done
done
AREAL_JAX_PALLAS_GPU_PAGED=writes=1 /tmp/cuda/bin/python $S --matmul xla --graphs none
