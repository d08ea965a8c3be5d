"""A multi-turn continuation's extend against the prefill of the same row, compiled for a target
(default an H100) on a machine without one: bytes the continuing turn holds (its row and the
extend's temporaries) for chunks of new tokens of several sizes, beside what the planned prefill
call of that bucket holds (its temporaries and returned prefix).

  PYTHONPATH=$PWD:$PWD/bench JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/cuda/bin/python \
      bench/results/cpu-aot-h100-continuation-2026-11-30-s46/continuation_memory.py [--target h100] \
      --json bench/results/cpu-aot-h100-continuation-2026-11-30-s46/extend_vs_prefill.json
"""

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
from flax import nnx

import aot_decode
from areal_jax import program_memory
from areal_jax.kernels import choice
from areal_jax.models import Transformer
from areal_jax.sampler import continuation, slot_cache
from areal_jax.sampler.engine import EngineConfig
from common import QWEN25_1P5B

MIB = 2**20


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--target", default="h100")
  ap.add_argument("--rows", default="4096,8191")
  ap.add_argument("--chunks", default="64,256,1024,2048")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  device = aot_decode.target_device(args.target)
  platform = aot_decode._platform(device)  # noqa: SLF001
  cfg = dataclasses.replace(QWEN25_1P5B, dtype="bfloat16")
  model = Transformer(cfg, nnx.Rngs(0))
  lengths = [int(x) for x in args.rows.split(",")]
  eng = aot_decode.target_engine(device, model, EngineConfig(
      num_slots=8, max_len=max(lengths) + 1, prefill_buckets=tuple(lengths), max_prefill_tokens=0))
  params = aot_decode.abstract(eng.params, device)
  kept = continuation.Continuations(eng, 1)

  def compiled(fn, *fargs):
    with choice.lowering_for(platform):
      return program_memory.cost(choice.lower(fn, fargs, platform, device.device_kind), fargs)

  out = []
  for length in lengths:
    with choice.lowering_for(platform):
      prefill = eng._make_prefill(length, 1).__wrapped__  # noqa: SLF001
      extend = kept._make_extend(length).__wrapped__  # noqa: SLF001
    pre = compiled(jax.jit(prefill, compiler_options=eng.compiler_options), params,
                   aot_decode.abstract(jax.ShapeDtypeStruct((1, length), jnp.int32), device))
    row = aot_decode.abstract(jax.eval_shape(lambda n=length: slot_cache.make(
        eng.model_cfg, 1, n, eng._cache_dtype, eng.cache_layout)), device)  # noqa: SLF001
    row_mib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(row)) / MIB
    pre_mib = (pre["temp"] + pre["out"]) / MIB
    print(f"{device.device_kind}: prefill of one row of {length}: temp {pre['temp'] / MIB:.1f} MiB"
          f" + prefix {pre['out'] / MIB:.1f} MiB = {pre_mib:.1f} MiB", flush=True)
    for chunk in (int(x) for x in args.chunks.split(",")):
      m = compiled(jax.jit(extend, donate_argnums=1, compiler_options=eng.compiler_options),
                   params, row, aot_decode.abstract(jax.ShapeDtypeStruct((1, chunk), jnp.int32),
                                                    device),
                   aot_decode.abstract(jax.ShapeDtypeStruct((1,), jnp.int32), device))
      held = row_mib + m["temp"] / MIB
      print(f"  continuation chunk {chunk:>5} over it: row {row_mib:.1f} MiB + temp "
            f"{m['temp'] / MIB:.1f} MiB = {held:.1f} MiB ({held / pre_mib:.2f}x the prefill's)"
            + (" REFUSED" if m.get("refused") else ""), flush=True)
      out.append(dict(row=length, chunk=chunk, prefill_temp=pre["temp"], prefill_out=pre["out"],
                      extend_temp=m["temp"], row_bytes=int(row_mib * MIB)))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(target=device.device_kind, jax=jax.__version__, argv=sys.argv, rows=out), fh,
                indent=2)


if __name__ == "__main__":
  main()
