# In a Python 3.12 venv with jax 0.11.2, JAX's CUDA 13 plugin and flax 0.12.12 (the GPU machines'
# versions; under jax 0.10 a deviceless Triton lowering assumes compute capability 9.0 whatever the
# target, 0.11 is told the target's GPU: kernels.choice.lower), on a 2-core CPU machine, no GPU.
export PYTHONPATH=$PWD:$PWD/bench
A="--programs ours --layers unrolled --matmul blas --page-size 64 --attention pallas_gpu"
for t in a100 b200; do
  for m in smollm2-135m qwen2.5-1.5b; do
    python bench/aot_decode.py --model $m --target $t $A --json $m-$t.json > $m-$t.txt 2>&1
    AREAL_JAX_PALLAS_GPU_PAGED=writes=1 AREAL_JAX_DECODE_NORM_MATMUL=1 \
      python bench/aot_decode.py --model $m --target $t $A --json $m-$t-w1n.json > $m-$t-w1n.txt 2>&1
  done
done
B="--model smollm2-135m --target t4 --programs ours --layers unrolled --matmul blas"
python bench/aot_decode.py $B --attention pallas_gpu --page-size 64 > smollm2-135m-t4-pallas_gpu-j11.txt 2>&1
python bench/aot_decode.py $B --attention dense > smollm2-135m-t4-dense-j11.txt 2>&1
