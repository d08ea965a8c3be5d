"""The sampler's prefill insert writes (sampler.slot_cache) compiled for an H100 here: the kernels
whose PTX loops a compare-and-swap, per cache layout.  PYTHONPATH=.:bench python THIS_FILE"""
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # bench/
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import aot_decode  # noqa: E402
from areal_jax.sampler import slot_cache  # noqa: E402

sh = SingleDeviceSharding(aot_decode.target_device("h100"))
S = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)  # noqa: E731
I = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)  # noqa: E731
# the 1.5B shape's cache (128 slots of 1024 positions), a group of 4, 256 prompt positions
L, R, K, T, D, N, Q, P = 28, 128, 2, 1024, 128, 4, 256, 64
cases = {
    "paged": (lambda c, p, pages, pos: slot_cache.write_prefix_pages(c, p, pages, pos, Q),
              ({n: S((K, L, R * T // P + 1, P, D)) for n in "kv"},
               {n: S((L, 1, K, Q, D)) for n in "kv"}, I((N, T // P)), I((N,)))),
    "heads": (lambda c, p, s: slot_cache.write_prefix(c, p, s, Q, slot_cache.HEADS),
              ([{n: S((R, K, T, D)) for n in "kv"} for _ in range(L)],
               [{n: S((1, K, Q, D)) for n in "kv"} for _ in range(L)], I((N,)))),
    "stacked": (lambda c, p, s: slot_cache.write_prefix(c, p, s, Q, slot_cache.STACKED),
                ({n: S((L, R, K, T, D)) for n in "kv"}, {n: S((L, 1, K, Q, D)) for n in "kv"},
                 I((N,)))),
}
for name, (fn, args) in cases.items():
  dump = tempfile.mkdtemp()
  compiled = jax.jit(fn, donate_argnums=0, compiler_options={"xla_dump_to": dump}).trace(
      *args).lower(lowering_platforms=("cuda",)).compile()
  counts = aot_decode.launches(compiled.as_text())
  launches = sum(v for k, v in counts.items() if k != "copied_bytes")
  cas = aot_decode.cas_kernels(dump)
  print(f"{name:8s} {launches} launches; compiled kernels with a compare-and-swap loop: {len(cas)}")
