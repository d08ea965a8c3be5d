# Session 42, AMD machine (2 cores), jax 0.10.2 + jax[cuda12] 0.10.2 in /tmp/cuda (bench/aot_decode.py's docstring); no GPU.
R=bench/results/cpu-aot-h100-graphs-2026-11-30-s42
for mm in blas xla; do /tmp/cuda/bin/python $R/graphs_thunks.py --matmul $mm; done
AREAL_JAX_PALLAS_GPU_PAGED=writes=1 AREAL_JAX_DECODE_NORM_MATMUL=1 /tmp/cuda/bin/python $R/graphs_thunks.py --matmul blas
/tmp/cuda/bin/python $R/graphs_thunks.py --model qwen2.5-1.5b --matmul blas --graphs none,while
# What these counts are NOT: a real GPU's. Compiled without a GPU, XLA's command-buffer conversion pass
# sees no CUDA driver (version 0) and drops every command type that needs CUDA >= 12.3 (cuBLAS, cuBLASLt,
# custom calls, WHILE, CONDITIONAL; XLA's command_buffer_conversion_pass.cc). Adding
# `runtime_version { major: 12 minor: 9 }` to the target config changed nothing (the driver's stays 0).
# So the graphs options compile but show nothing here; on a GPU with a 12.3+ driver the cuBLASLt GEMMs
# join the graphs by default, and the loop can only be captured unrolled (its body writes each step's
# outputs by a loop-dependent dynamic-slice fusion, which needs unrolling, and CUDA 12.9 for the child
# commands): choice.Launch.graphs "unrolled". Run time: not measured (no GPU).
