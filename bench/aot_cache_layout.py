"""Per-layer KV cache layouts of an unrolled decode step, compiled for a GPU or TPU on this machine.

  python bench/aot_cache_layout.py [--target h100 | --target v5e:2x2]   (see bench/aot_decode.py)

A decode step reduced to its cache traffic (28 layers, 128 rows, 2 K/V heads of 128, 768
positions read to 577, bfloat16, 16 steps per call): each layer writes one position per row and
runs the dense attention over its own cache, laid out positions-first ``[rows, T, kv_heads, D]``
(``Transformer.extend``'s, the unrolled sampler's) or heads-major ``[rows, kv_heads, T, D]``
(the scan's, per layer), the write a per-row ``dynamic_update_slice`` (``transformer._write_rows``)
or one scatter. Prints the operations launched and the bytes copied per step, read off each
compiled program (``aot_decode.launches``). What it shows: whether the compiler keeps the cache in
the layout the engine holds it in between calls, or copies it into another on entering and
leaving each call.
"""

from __future__ import annotations

import argparse

import aot_decode  # sets the platform flags before jax is imported  # noqa: I001
import jax
import jax.numpy as jnp

from areal_jax.kernels import xla_attention

LAYERS, ROWS, KV, GROUP, T, D, READ, STEPS = 28, 128, 2, 6, 768, 128, 577, 16


def compiled(device, heads_major: bool, scatter: bool) -> str:
  def step(_, state):
    q_BxKxGxD, caches, pos_B = state
    out = []
    for k, v in caches:
      new_BxKxD = (q_BxKxGxD[:, :, 0] * 0.5).astype(k.dtype)  # the layer's new key and value
      if scatter:
        rows = jnp.arange(ROWS)
        at = (rows, slice(None), pos_B) if heads_major else (rows, pos_B)
        k, v = k.at[at].set(new_BxKxD), v.at[at].set(new_BxKxD)
      else:
        start = (lambda p: (0, p, 0)) if heads_major else (lambda p: (p, 0, 0))
        put = jax.vmap(lambda c, n, p: jax.lax.dynamic_update_slice(
            c, n[:, None] if heads_major else n[None], start(p)))
        k, v = put(k, new_BxKxD, pos_B), put(v, new_BxKxD, pos_B)
      attend = xla_attention.dense_heads_major if heads_major else xla_attention.dense
      q_BxKxGxD = q_BxKxGxD + attend(q_BxKxGxD, k, v, pos_B, READ)
      out.append((k, v))
    return q_BxKxGxD, out, pos_B + 1

  on = jax.sharding.SingleDeviceSharding(device)
  shape = (ROWS, KV, T, D) if heads_major else (ROWS, T, KV, D)
  cache = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on)
  args = (jax.ShapeDtypeStruct((ROWS, KV, GROUP, D), jnp.float32, sharding=on),
          [(cache, cache)] * LAYERS, jax.ShapeDtypeStruct((ROWS,), jnp.int32, sharding=on))
  fn = jax.jit(lambda *a: jax.lax.fori_loop(0, STEPS, step, a), donate_argnums=1)
  platform = aot_decode._platform(device)  # noqa: SLF001
  return fn.trace(*args).lower(lowering_platforms=(platform,)).compile().as_text()


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--target", default="h100")
  args = ap.parse_args()
  device = aot_decode.target_device(args.target)
  print(f"{device.device_kind}: {LAYERS} layers, {ROWS} rows, cache {T} positions read to {READ}")
  for heads_major, scatter in ((False, False), (True, False), (False, True), (True, True)):
    n = {k: v / STEPS for k, v in aot_decode.launches(compiled(device, heads_major, scatter)).items()}
    copied = n.get("copied_bytes", 0.0)
    print(f"  {'heads-major' if heads_major else 'positions-first':>15} cache, "
          f"{'scatter' if scatter else 'per-row update':>14}: {aot_decode.launch_total(n):8.0f} "
          f"operations, "
          f"{copied / 1e6:7.1f} MB copied per step", flush=True)


if __name__ == "__main__":
  main()
