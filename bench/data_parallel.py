"""What a decode call moves between devices when the sampler is data-parallel, one engine with its
slots split over the data axis ("sharded") against an engine per data index ("replicas"),
at every decode width, read off the compiled programs (no device time needed: the bytes are the
same on any backend; XLA:CPU's SPMD partitioner is the one GPUs and TPUs use).

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/data_parallel.py [--json PATH]

Per row: the bytes the call's collectives produce on each device (all-gather / all-reduce /
collective-permute / all-to-all results, times the trip counts of the loops they sit in: decode
steps and layers), against the bytes the call must read from memory on a device (its weights once
per step, its slots' KV cache up to the kv bound, ``common.decode_step_cost``). The accelerator
path is forced (dense attention, layers in a scan, 16 steps per call, bfloat16); weights random.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import jax
from flax import nnx

import common
from areal_jax import sharding
from areal_jax.models import Transformer
from areal_jax.sampler.engine import DecodeEngine, EngineConfig

_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-gather|all-reduce|collective-permute|"
                         r"all-to-all)(?:-start)?\(")
_WHILE = re.compile(r" while\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'known_trip_count[\\"]*:\{[\\"]*n[\\"]*:[\\"]*(\d+)')
_CALLS = re.compile(r"(?:to_apply|calls|branch_computations)=\{?%?([\w.\-, %]+)\}?")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_bytes(hlo: str) -> int:
  """Bytes the collectives of an optimized HLO module produce per device per run, each counted as
  often as the loops around it run (a loop without a known trip count counts once)."""
  comps: dict[str, list] = {}
  name, entry = None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name = head.group(2)
      entry = name if head.group(1) else entry
      comps[name] = []
      continue
    if name is None:
      continue
    m = _COLLECTIVE.search(line)
    if m:
      n = 1
      for d in filter(None, m.group(2).split(",")):
        n *= int(d)
      comps[name].append(("bytes", n * _BYTES.get(m.group(1), 4)))
    w = _WHILE.search(line)
    if w:
      trip = _TRIP.search(line)
      comps[name].append(("call", w.group(1), int(trip.group(1)) if trip else 1))
    elif "fusion(" not in line:
      for c in _CALLS.findall(line):
        for callee in c.replace("%", "").split(","):
          comps[name].append(("call", callee.strip(), 1))

  def total(comp: str, seen=()) -> int:
    if comp in seen or comp not in comps:
      return 0
    out = 0
    for item in comps[comp]:
      out += item[1] if item[0] == "bytes" else item[2] * total(item[1], seen + (comp,))
    return out

  return total(entry)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--slots", type=int, default=64)
  p.add_argument("--max-len", type=int, default=512)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--data", type=int, default=4)
  p.add_argument("--json", default=None)
  args = p.parse_args()
  t0 = time.perf_counter()
  cfg = dataclasses.replace(common.SMOLLM2, dtype="bfloat16")
  model = Transformer(cfg, nnx.Rngs(0))
  d, s = args.data, args.slots
  mesh = sharding.make_mesh({"data": d}, jax.devices()[:d])
  config = dict(max_len=args.max_len, steps_per_call=args.steps, decode_attention="dense",
                decode_matmul="xla", decode_layers="scan", decode_projections="fused")
  widths = [w for w in (s // 8, s // 4, s // 2, s) if w % d == 0]
  engines = {
      "sharded": DecodeEngine(model, EngineConfig(num_slots=s, width_buckets=tuple(widths),
                                                  **config), mesh),
      "replicas": DecodeEngine(model, EngineConfig(num_slots=s // d, **config),
                               sharding.split_mesh(mesh, "data")[0]),
  }
  rows = []
  print(f"SmolLM2-135M shape, bfloat16, {s} slots over data={d} ({s // d} per device), "
        f"max_len {args.max_len}, {args.steps} steps per call, kv bound {args.max_len}")
  print(f"{'mode':>9} {'width':>6} {'slots/dev':>9} {'moved/dev MB':>13} {'must read/dev MB':>17} "
        f"{'moved/read':>10}")
  for mode, eng in engines.items():
    for w in widths if mode == "sharded" else [w // d for w in widths]:
      text = eng._make_generate(args.max_len, w).lower(  # noqa: SLF001
          eng.params, eng.state_shapes()).compile().as_text()
      moved = collective_bytes(text)
      per_dev = w // d if mode == "sharded" else w  # the slots a device should decode
      need, _ = common.decode_step_cost(cfg, per_dev, args.max_len - 1)
      need *= args.steps
      rows.append(dict(mode=mode, width=w, slots_per_device=per_dev, moved_bytes_per_call=moved,
                       must_read_bytes_per_call=need, moved_over_read=moved / need))
      print(f"{mode:>9} {w:>6} {per_dev:>9} {moved / 1e6:>13.1f} {need / 1e6:>17.1f} "
            f"{moved / need:>10.3f}")
  common.finish({"machine": common.machine(), "rows": rows, "args": vars(args)}, args.json, t0)


if __name__ == "__main__":
  main()
