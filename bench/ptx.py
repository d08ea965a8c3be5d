"""What a Pallas GPU kernel compiled for a GPU this machine does not have does, read off its PTX.

``--compile-only TARGET --ptx`` (``bench/paged_kernel.py``, ``bench/norm_matmul.py``) has XLA dump
what it compiles (``dump_to``, before JAX is imported) and summarizes the named kernel's PTX per
launch (``summary``): how many of each memory instruction, barrier and tensor-core product it
holds, and their order. Without a GPU this is how a launch's memory behaviour shows: strided reads
become scalar 16-bit loads (``ld.global.b16``) instead of vector loads or asynchronous copies
(``cp.async``, Triton's pipelined loops), and whether a loop's loads are issued together or each
behind a barrier after the product before it (session 49: ``bench/results/cpu-aot-h100-2026-11-30-s49``).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import tempfile

# the instructions counted, by kind (a PTX line may hold several: Triton's inline assembly)
KINDS = {
    "ld.global.v": r"ld\.global(?:\.[A-Za-z0-9_:]+)*\.v[248]\.[a-z0-9]+",
    "ld.global.b16": r"ld\.global(?:\.[A-Za-z0-9_:]+)*\.[bu]16\b",
    "ld.global.b32": r"ld\.global(?:\.[A-Za-z0-9_:]+)*\.[bu]32\b",
    "cp.async": r"cp\.async\.c[ag]\.shared\.global",
    "cp.async.wait": r"cp\.async\.wait_group",
    "bar.sync": r"bar\.sync",
    "mma": r"mma\.sync",
    "wgmma": r"wgmma\.mma_async",  # (Hopper's warpgroup products)
    "st.global": r"st\.global",
}
_ANY = re.compile("|".join(f"(?P<k{i}>{p})" for i, p in enumerate(KINDS.values())))
_NAMES = list(KINDS)


def dump_to() -> str:
  """A new directory XLA dumps every compiled module into (PTX included); call before JAX is
  imported (it reads ``XLA_FLAGS`` once)."""
  path = tempfile.mkdtemp(prefix="ptx_dump_")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={path}".strip()
  return path


def take(dump_dir: str, kernel: str) -> str | None:
  """The PTX of the last kernel in ``dump_dir`` whose name starts with ``kernel`` (XLA writes each
  kernel's PTX to a file of its own), or None; empties the directory, so that the next compile's
  kernels are the only ones there."""
  found, entry = None, re.compile(r"\.entry " + re.escape(kernel))
  for name in sorted(os.listdir(dump_dir)):
    if name.endswith(".ptx"):
      with open(os.path.join(dump_dir, name), encoding="utf-8", errors="replace") as f:
        text = f.read()
      if entry.search(text):
        found = text
  for name in os.listdir(dump_dir):
    path = os.path.join(dump_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
  return found


def summary(ptx: str) -> dict:
  """``counts``: each kind of ``KINDS`` in ``ptx`` (kinds absent: 0); ``order``: the kinds in the
  order they appear, runs of one kind as ``kind xN``."""
  seq = [_NAMES[int(m.lastgroup[1:])] for m in _ANY.finditer(ptx)]
  counts = collections.Counter(seq)
  runs = []
  for kind in seq:
    if runs and runs[-1][0] == kind:
      runs[-1][1] += 1
    else:
      runs.append([kind, 1])
  return {"counts": {k: counts.get(k, 0) for k in _NAMES},
          "order": ", ".join(f"{k} x{n}" for k, n in runs)}
