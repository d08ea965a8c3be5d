"""Decode layers unrolled vs in a ``lax.scan``: compile time by depth and step time, side by side.

  python bench/decode_layers.py [--quick] [--json PATH]

Both rows run the accelerator decode path (dense decode attention, XLA's matmuls, 16 steps per
call, forced with ``$AREAL_JAX_DECODE_ATTENTION`` / ``_MATMUL``) with ``decode_layers`` ``unrolled``
(``Transformer.extend``, one traced body per layer) or ``scan`` (``models/decode_scan``, one body
whatever the depth), random weights, float32 on CPU (bfloat16 elsewhere):
  * ``compile_s``: SmolLM2-135M widths at 2 / 8 / 30 layers, 8 slots: the first ``generate`` call
    (trace + compile + one call) minus a steady call, for one kv bucket and width;
  * ``step_ms``: SmolLM2-135M (30 layers) at 64 slots, context 64 (128 without ``--quick``), best
    of the repetitions (``bench/sampler.py``'s ``roofline``), and the plain-JAX floor loop
    (``bench/decode_floor.py``) in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time

import jax
import numpy as np

from areal_jax.kernels import choice
from areal_jax.sampler import sampling
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
import decode_floor
from common import SMOLLM2, Hardware, finish, machine
from sampler import make_model, roofline

LAYERS = ("unrolled", "scan")


@contextlib.contextmanager
def forced(layers: str):
  """The accelerator decode path with ``layers``, through the kernels' environment overrides."""
  env = {choice.ATTENTION_ENV: "dense", choice.MATMUL_ENV: "xla", choice.LAYERS_ENV: layers}
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in old.items():
      os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def compile_s(cfg, layers: str, slots: int = 8, max_len: int = 64) -> float:
  """Seconds of the first decode call over a steady one (its trace and compile)."""
  with forced(layers):
    dev = DecodeEngine(make_model(cfg), EngineConfig(num_slots=slots, max_len=max_len,
                                                     prefill_buckets=(16,), kv_buckets=(max_len,),
                                                     steps_per_call=16))
  assert dev.layers_impl == layers
  state = dev.init_state()
  keys = np.stack([np.asarray(sampling.slot_key(0, i)) for i in range(slots)])
  state = dev.insert(state, None, list(range(slots)), token=[1] * slots, pos=[0] * slots,
                     end=[max_len] * slots, keys=keys, temperature=1.0, top_k=0, top_p=1.0,
                     greedy=False, stop_ids=[])
  times = []
  for _ in range(2):
    t0 = time.perf_counter()
    state, out = dev.generate(dev.params, state, max_len)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  return times[0] - times[1]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="context 64, 3 repetitions")
  ap.add_argument("--json", default=None, help="write results to this path")
  args = ap.parse_args()
  t_start = time.perf_counter()
  on_cpu = jax.default_backend() == "cpu"
  base = dataclasses.replace(SMOLLM2, dtype="float32" if on_cpu else "bfloat16")
  info = machine()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']} ({info['devices']})")
  compiles = {}
  for n in (2, 8, 30):
    cfg = dataclasses.replace(base, n_layers=n)
    compiles[n] = {layers: compile_s(cfg, layers) for layers in LAYERS}
    print(f"decode call compile, {n:>2} layers: " + ", ".join(
        f"{layers} {s:6.2f} s" for layers, s in compiles[n].items()))
  slots, context, reps = 64, 64 if args.quick else 128, 3 if args.quick else 5
  probe, model, steps = Hardware().probe(1), make_model(base), {}
  for layers in LAYERS:
    with forced(layers):
      steps[layers] = roofline(model, base, slots, context, probe, steps=16, reps=reps)
  floor = decode_floor.step_ms(base, slots, context, base.compute_dtype, reps=reps)
  for layers, r in steps.items():
    print(f"SmolLM2-135M decode at {slots} slots, context {context}, layers {layers} "
          f"({r['decode_attention']} attention, {r['decode_matmul']} matmuls, 16 steps/call): "
          f"{r['step_ms']:.1f} ms/step (floor loop {floor:.1f} ms, "
          f"ratio {r['step_ms'] / floor:.2f})")
  result = {"machine": info, "quick": args.quick, "backend": jax.default_backend(),
            "compile_s": {str(n): c for n, c in compiles.items()},
            "step_ms": {k: r["step_ms"] for k, r in steps.items()}, "floor_step_ms": floor,
            "rows": steps, "load_avg": os.getloadavg(), "bench_s": time.perf_counter() - t_start}
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
