# Temporaries of bench/paged_kernel.py's program compiled for an H100 on a CPU machine (the /tmp/cuda venv of
# bench/aot_decode.py's docstring): PYTHONPATH=.:bench /tmp/cuda/bin/python dense_copies.py MODEL PAGE [IMPL [LAUNCH]]
# Output (session 48, AMD machine, jax 0.10.2), before / after the optimization barrier between layers:
#   qwen2.5-1.5b 128 dense: temp 90.064 GB (the 83.88 GiB the H200 could not allocate) / 0.088 GB
#   smollm2-135m 64 dense: temp 30.32 GB / 0.013 GB; pallas_gpu default 1.27 / 1.28 MB; writes=1,dot=1 0.13 / 0.14 MB
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu"); os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.argv.insert(1, "--compile-only")
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
import paged_kernel as pk, aot_decode
from jax.sharding import SingleDeviceSharding
from areal_jax.kernels import pallas_attention, choice
name, page = sys.argv[2], int(sys.argv[3]); sys.argv = sys.argv[1:]
cfg, slots, context = pk.SHAPES[name]
max_len = context + 1280; t = context + 1 + 64
args = pk.inputs(cfg, slots, context, max_len, page, jnp.bfloat16, abstract=True)
dev = aot_decode.target_device("h100")
shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(dev)) for a in args]
impl = sys.argv[3] if len(sys.argv) > 3 else "dense"; tun = choice.pallas_gpu_tuning(sys.argv[4] if len(sys.argv) > 4 else "")
fn = pk.program(impl, tun, cfg.n_layers, t, interpret=False)
with choice.lowering_for("gpu"):
  c = choice.lower(fn, shapes, "cuda").compile()
m = c.memory_analysis()
print(name, page, "pool GB", args[3].size * 2 / 1e9, "temp GB", m.temp_size_in_bytes / 1e9)
