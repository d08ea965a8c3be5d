#!/bin/bash
cd "${1:-.}"
for m in smollm2-135m qwen2.5-1.5b; do
  echo "=== $(date +%T) $m as shipped, the program for top-k/top-p slots"
  PYTHONPATH=$PWD:$PWD/bench /tmp/cu/bin/python bench/aot_decode.py --model $m --programs ours \
    --layers unrolled --matmul blas --held-layouts default --page-size 64 --attention pallas_gpu \
    --truncate --json /tmp/s33/${m}_truncate.json 2>&1 | grep -v "To avoid this\|CUB scratch"
done
