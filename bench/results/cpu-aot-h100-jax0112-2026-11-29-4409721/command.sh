#!/bin/bash
# H100 AOT of the decode programs under the GPU machines' JAX (0.11.2, Python 3.12, JAX's CUDA 13
# plugin, flax 0.12.12), as shipped, with writes=1 + fused norms, and the top-k/top-p program:
#   bash command.sh PYTHON OUTDIR   (PYTHON: that venv's python)
for m in smollm2-135m qwen2.5-1.5b; do
  for launch in "" "writes=1" "truncate"; do
    tag=$m${launch:+_$launch}; tag=${tag/writes=1/w1n}
    echo "=== $(date +%T) $m ${launch:-as shipped}"
    env $( [ "$launch" = writes=1 ] && echo AREAL_JAX_PALLAS_GPU_PAGED=writes=1 AREAL_JAX_DECODE_NORM_MATMUL=1 ) \
      PYTHONPATH=$PWD:$PWD/bench "$1" bench/aot_decode.py --model $m --programs ours \
      --layers unrolled --matmul blas --held-layouts default --page-size 64 --attention pallas_gpu \
      $( [ "$launch" = truncate ] && echo --truncate ) --json "$2/$tag.json" 2>&1 \
      | grep -v "sort_rewriter\|To avoid this\|CUB scratch\|Warning\|warn("
  done
done
