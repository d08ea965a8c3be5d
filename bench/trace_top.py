"""The kernels that take a decode call's time, from a JAX profiler trace (Perfetto JSON).

  python bench/trace_top.py TRACE.json.gz [--top 25] [--steps 32]

``bench/decode_variants.py --trace DIR`` records one (``DIR/plugins/profile/*/perfetto_trace.json.gz``;
``bench/accelerator_check.sh`` copies it out). Prints, per device track (the GPU's streams, or
XLA:CPU's thunk executor), the events grouped by name: total milliseconds, count, and per decode
step (``--steps``: the decode steps the trace covers, 2 calls x 16 steps by default), so a step
that is many small kernels shows as a long list of short, frequent names.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], top: int):
  """``{track: [(name, total_us, count), ...]}``, longest first, for complete ("X") events."""
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      names[e["pid"]] = e["args"]["name"]
  total, count = collections.defaultdict(float), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      key = (names.get(e["pid"], str(e["pid"])), e["name"])
      total[key] += e["dur"]
      count[key] += 1
  tracks = collections.defaultdict(list)
  for (track, name), us in total.items():
    tracks[track].append((name, us, count[(track, name)]))
  return {t: sorted(rows, key=lambda r: -r[1])[:top] for t, rows in tracks.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("trace")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--steps", type=int, default=32)
  args = ap.parse_args()
  for track, rows in summarize(load(args.trace), args.top).items():
    print(f"== {track}")
    print(f"{'ms total':>10} {'count':>7} {'us/step':>9}  name")
    for name, us, n in rows:
      print(f"{us / 1e3:10.2f} {n:7d} {us / args.steps:9.1f}  {name[:90]}")


if __name__ == "__main__":
  main()
