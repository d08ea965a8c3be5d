"""A LoRA version merged (lora.merge), converted (fused, cast), and both in one program (what
HeldWeights.put runs since session 38), Qwen3-1.7B shape, rank 16: each program's temporaries and
outputs as TARGET's compiler assigns them (argv[1]: a TPU topology of aot_decode, h100, or cpu)."""
import os, sys, dataclasses
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
import jax, jax.numpy as jnp, aot_decode
from flax import nnx
from common import QWEN3_1P7B
from areal_jax.models import Transformer, lora
from areal_jax.models.transformer import cast_weights, fuse_projections
from areal_jax.kernels import choice
target = sys.argv[1] if len(sys.argv) > 1 else "v5e:2x2"
dev = aot_decode.target_device(target) if target != "cpu" else jax.devices()[0]
cfg = dataclasses.replace(QWEN3_1P7B, dtype="bfloat16")
params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param))
lcfg = lora.LoraConfig(rank=16, alpha=32.0)
sh = jax.sharding.SingleDeviceSharding(dev)
absd = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), t)
base = absd(jax.eval_shape(lambda p: cast_weights(p, jnp.bfloat16), params))
ad = lora.abstract_adapters(params, lcfg, sh)
conv = lambda p: cast_weights(fuse_projections(p, cfg), jnp.bfloat16)
GB = 2**30
size = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t)) / GB
print("base", size(base), "adapters", size(ad))
for name, fn, args in (("merge", lambda b, a: lora.merge(b, a, lcfg), (base, ad)),
                       ("convert", conv, (base,)),
                       ("merge+convert", lambda b, a: conv(lora.merge(b, a, lcfg)), (base, ad))):
  with choice.lowering_for("tpu" if target != "cpu" else "cpu"):
    c = jax.jit(fn).lower(*args).compile()
  m = c.memory_analysis()
  print(f"{name:14s} temp {m.temp_size_in_bytes/GB:.2f} out {m.output_size_in_bytes/GB:.2f} GiB", flush=True)
