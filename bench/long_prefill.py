"""Long prefills: the decode steps a long prompt holds up, chunked or not, run on CPU (``--gaps``);
a prefill at long buckets, dense attention against the flash kernel, compiled for a GPU or a TPU
on a machine without one (``rollout.prefill_attention``; ``kernels.causal_attention``).

  python bench/long_prefill.py --gaps [--prompt 16384] [--chunks 0,512] [--reps 3] [--json PATH]
  /tmp/tpu/bin/python bench/long_prefill.py --target v5e:2x2 [--model qwen3-1.7b]
      [--buckets 2048,8192,16384,32768] [--json PATH]       # in a venv with jax[tpu] (libtpu)
  # a GPU: a venv with jax[cuda12] and --target h100

``--gaps``: ``--running`` sequences decode (``JaxRolloutEngine`` on CPU, a 2-layer Llama of
d_model 64 with one attention head of 64, random float32 weights, max_len past the prompt) when a
``--prompt``-token prompt is submitted; the longest wall time between two of their decode steps
from then until the long prompt's first token is the longest any running sequence waited. Per
``rollout.prefill_chunk`` of ``--chunks`` (0: the prompt prefilled in one call; the first is the
baseline of the ratios), ``--reps`` prompts (each new: no prefix memo hit) after an untimed one
that compiles the programs; also the steady decode step (median gap before the prompt) and the
long prompt's time to its first token. Timestamps are the token listener's (the host hearing each
decode call's tokens), so a gap includes the loop's host work.

A reasoning rollout of 16k-32k tokens is prefilled whole when it continues under new weights
(``rollout.continuation="reprefill"``) or after preemption; one row of such a bucket is what
``rollout.max_prefill_tokens`` leaves a call. Per bucket and attention, the sampler's memory plan
of a one-slot engine of the model's shape (random bfloat16 weights built on this CPU), its
programs compiled by the target's compiler in the layouts the engine holds there
(``aot_decode.sampler_plan``): the prefill call's temporaries and returned prefix, and the plan's
peak (two weight versions, the KV cache, the larger call). Where the compiler refuses a program
for want of memory (a TPU's does) the figure is what it said it needed (``program_memory``; the
table does not mark which). Compiles only: no run time. A few minutes a bucket on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

import aot_decode  # noqa: E402
from common import QWEN3_1P7B, QWEN25_1P5B, finish, machine  # noqa: E402

MODELS = {"qwen3-1.7b": QWEN3_1P7B, "qwen2.5-1.5b": QWEN25_1P5B}
GIB = 2**30


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--target", default="v5e:2x2")
  ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-1.7b")
  ap.add_argument("--buckets", default="2048,8192,16384,32768")
  ap.add_argument("--json", default=None)
  ap.add_argument("--gaps", action="store_true", help="decode gaps on CPU, chunked or not")
  ap.add_argument("--prompt", type=int, default=16384, help="--gaps: the long prompt's tokens")
  ap.add_argument("--chunks", default="0,512", help="--gaps: rollout.prefill_chunk values")
  ap.add_argument("--running", type=int, default=4, help="--gaps: sequences decoding")
  ap.add_argument("--reps", type=int, default=3, help="--gaps: long prompts timed per chunk")
  args = ap.parse_args()
  if args.gaps:
    import long_prefill_gaps  # noqa: PLC0415

    long_prefill_gaps.run(args)
    return
  t_start = time.perf_counter()
  from flax import nnx

  from areal_jax.models import Transformer
  from areal_jax.sampler.engine import EngineConfig
  device = aot_decode.target_device(args.target)
  flash = "pallas_tpu" if aot_decode._platform(device) == "tpu" else "pallas_gpu"  # noqa: SLF001
  cfg = dataclasses.replace(MODELS[args.model], dtype="bfloat16")
  model = Transformer(cfg, nnx.Rngs(0))  # random weights, once
  print(f"compiling for {device.device_kind} on this CPU ({os.cpu_count()} cores), jax "
        f"{jax.__version__}: {args.model} shape, one slot, one prompt a prefill call")
  rows = []
  for bucket in (int(b) for b in args.buckets.split(",")):
    for impl in ("dense", flash):
      t = time.perf_counter()
      plan = aot_decode.sampler_plan(device, model, EngineConfig(
          num_slots=1, max_len=bucket + 1, prefill_buckets=(bucket,), max_prefill_batch=1,
          prefill_attention=impl, kv_pages=0))
      rows.append(dict(bucket=bucket, prefill_attention=impl, prefill_gib=plan.prefill / GIB,
                       peak_gib=plan.peak_bytes / GIB, kv_cache_gib=plan.state / GIB,
                       weights_gib=plan.weights / GIB, compile_s=time.perf_counter() - t))
      print(f"  bucket {bucket:>6} {impl:<11} prefill call {plan.prefill / GIB:8.2f} GiB, plan "
            f"peak {plan.peak_bytes / GIB:7.2f} GiB ({time.perf_counter() - t:.0f} s)", flush=True)
  print(f"{'bucket':>8}{'dense GiB':>12}{flash + ' GiB':>18}{'ratio':>8}")
  for bucket in sorted({r['bucket'] for r in rows}):
    d, f = (next(r for r in rows if r["bucket"] == bucket and r["prefill_attention"] == a)
            for a in ("dense", flash))
    print(f"{bucket:>8}{d['prefill_gib']:>12.2f}{f['prefill_gib']:>18.2f}"
          f"{d['prefill_gib'] / f['prefill_gib']:>8.1f}")
  finish(dict(machine=machine(), target=args.target, device_kind=device.device_kind,
              model=args.model, rows=rows), args.json, t_start)


if __name__ == "__main__":
  main()
