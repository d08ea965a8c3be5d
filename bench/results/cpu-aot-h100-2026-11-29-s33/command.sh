#!/bin/bash
# H100 AOT of the decode programs, as shipped and with writes=1 + fused norms, both shapes:
#   bash command.sh ROOT PREFIX
# ROOT: the checkout compiled (after: this commit; before: a worktree of 314059c with this commit's
# bench/aot_decode.py copied in, so that conditionals are counted); PREFIX: "" or "before_"
cd "$1"
for m in smollm2-135m qwen2.5-1.5b; do
  for launch in "" "writes=1"; do
    tag=$m${launch:+_w1n}
    echo "=== $(date +%T) $m ${launch:-as shipped}"
    env ${launch:+AREAL_JAX_PALLAS_GPU_PAGED=$launch AREAL_JAX_DECODE_NORM_MATMUL=1} \
      PYTHONPATH=$PWD:$PWD/bench /tmp/cu/bin/python bench/aot_decode.py --model $m --programs ours \
      --layers unrolled --matmul blas --held-layouts default --page-size 64 --attention pallas_gpu \
      --json /tmp/s33/$2$tag.json 2>&1 | grep -v "sort_rewriter\|To avoid this\|CUB scratch"
  done
done
