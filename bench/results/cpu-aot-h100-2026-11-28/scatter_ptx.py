"""One layer's paged KV cache write at the SmolLM2 shape, compiled for an H100 here, without and
with ``unique_indices`` (argument 0 or 1); its PTX lands in ``$XLA_FLAGS``'s dump directory.

  XLA_FLAGS=--xla_dump_to=DIR PYTHONPATH=.:bench python THIS_FILE {0,1}
"""
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # bench/
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import aot_decode  # noqa: E402

sh = SingleDeviceSharding(aot_decode.target_device("h100"))
unique = sys.argv[1] == "1"


def write(pool, new, page, offset):  # pool [K, L, M, P, D], new [K, B, D]: layer 1, B rows
  return pool.at[:, 1, page, offset].set(new, unique_indices=unique)


args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for shape, dtype in (
    ((3, 30, 385, 64, 64), jnp.bfloat16), ((3, 64, 64), jnp.bfloat16), ((64,), jnp.int32),
    ((64,), jnp.int32))]
compiled = jax.jit(write, donate_argnums=0).trace(*args).lower(
    lowering_platforms=("cuda",)).compile()
print(aot_decode.launches(compiled.as_text()))
