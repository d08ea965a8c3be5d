# In a venv with jax[cuda12]==0.10.2 (bench/aot_decode.py's docstring), on a 2-core CPU machine, no GPU.
# bench/aot_targets/t4.txtpb describes the GPU (compute capability 7.5).
export PYTHONPATH=$PWD:$PWD/bench
A="--model smollm2-135m --programs ours --layers unrolled --matmul blas"
python bench/aot_decode.py $A --target t4 --attention dense --json smollm2-t4-dense.json > smollm2-t4-dense.txt 2>&1
python bench/aot_decode.py $A --target t4 --attention pallas_gpu > smollm2-t4-pallas_gpu.txt 2>&1
python bench/aot_decode.py $A --target t4 --attention pallas_gpu --page-size 64 > smollm2-t4-paged-pallas_gpu.txt 2>&1
python bench/aot_decode.py $A --target h100 --attention dense --json smollm2-h100-dense.json > smollm2-h100-dense.txt 2>&1
