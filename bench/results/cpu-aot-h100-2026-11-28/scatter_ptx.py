import os, sys
os.environ.setdefault("JAX_PLATFORMS","cpu"); os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK","1")
import jax, jax.numpy as jnp
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # bench/
import aot_decode as a
from jax.sharding import SingleDeviceSharding
dev=a.target_device('h100'); sh=SingleDeviceSharding(dev)
uniq=sys.argv[1]=='1'
S=lambda s,d: jax.ShapeDtypeStruct(s,d,sharding=sh)
def f(pool,new,page,off):
  return pool.at[:,1,page,off].set(new, unique_indices=uniq)
c=jax.jit(f,donate_argnums=0).trace(S((3,30,385,64,64),jnp.bfloat16),S((3,64,64),jnp.bfloat16),S((64,),jnp.int32),S((64,),jnp.int32)).lower(lowering_platforms=('cuda',)).compile()
print(a.launches(c.as_text()))
print([l for l in c.as_text().splitlines() if 'scatter(' in l][0][:300])
