"""What a Pallas GPU kernel compiled for a GPU this machine does not have does, read off its PTX.

``--compile-only TARGET --ptx`` (``bench/paged_kernel.py``, ``bench/norm_matmul.py``) has XLA dump
what it compiles (``dump_to``, before JAX is imported) and summarizes the named kernel's PTX per
launch (``summary``): how many of each memory instruction, barrier and tensor-core product it
holds, and their order. Without a GPU this is how a launch's memory behaviour shows: strided reads
become scalar 16-bit loads (``ld.global.b16``) instead of vector loads or asynchronous copies
(``cp.async``, Triton's pipelined loops), and whether a loop's loads are issued together or each
behind a barrier after the product before it (e.g. ``bench/results/cpu-aot-h100-2026-11-30-762b89e``).
Also from the dump, XLA's thunk sequence: how the kernel is launched (``geometry``: its grid, a
block's threads and shared memory) and so, for the target GPU's figures (``gpu``), how many of its
blocks an SM holds at once and the waves its grid takes (``residency``; e.g.
``bench/results/cpu-aot-h100-2026-11-30-6a4f00c``).
"""

from __future__ import annotations

import collections
import math
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


# a launch in XLA's thunk sequence (``*.thunk_sequence.txt`` in the dump): kernel, grid, threads
_LAUNCH = re.compile(r"\s(?P<name>[\w.$-]+) grid: \[(?P<grid>[\d, ]+)\] threads: \[(?P<threads>"
                     r"[\d, ]+)\]\s+shared_memory: (?P<shared>\d+) bytes")
TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_targets")
BLOCKS_PER_SM = 32  # resident blocks an SM holds at most (compute capability 8.0 to 10.0)
RESERVED_SHARED = 1024  # shared memory CUDA keeps per block (compute capability 8.0 and up)


def geometry(dump_dir: str, kernel: str) -> dict | None:
  """How the first launch of the kernel named ``kernel`` in XLA's thunk sequences in ``dump_dir``
  is launched: ``grid`` and ``threads`` (a block's), ``shared_bytes`` (a block's shared memory),
  ``programs`` (blocks in the grid); None if none is there. Read before ``take`` empties it."""
  for name in sorted(os.listdir(dump_dir)):
    if name.endswith(".thunk_sequence.txt"):
      with open(os.path.join(dump_dir, name), encoding="utf-8", errors="replace") as f:
        for m in _LAUNCH.finditer(f.read()):
          if m["name"].startswith(kernel):
            grid, threads = ([int(x) for x in m[k].split(",")] for k in ("grid", "threads"))
            return {"grid": grid, "threads": math.prod(threads),
                    "shared_bytes": int(m["shared"]), "programs": math.prod(grid)}
  return None


def gpu(target: str) -> dict:
  """The figures of ``bench/aot_targets/<target>*.txtpb`` (XLA's description of the GPU) that
  bound how many blocks an SM holds and that this reads (registers aside): ``core_count`` (SMs),
  ``shared_memory_per_core``, ``threads_per_core_limit``."""
  names = sorted(n for n in os.listdir(TARGETS) if n.startswith(target) and n.endswith(".txtpb"))
  if not names:
    raise ValueError(f"no GPU description {target}*.txtpb in {TARGETS}")
  with open(os.path.join(TARGETS, names[0]), encoding="utf-8") as f:
    text = f.read()
  keys = ("core_count", "shared_memory_per_core", "threads_per_core_limit")
  return {k: int(re.search(rf"\b{k}: (\d+)", text).group(1)) for k in keys}


def residency(launch: dict, limits: dict) -> dict:
  """Blocks of ``launch`` (``geometry``) an SM can hold at once by its threads, its shared memory
  and the blocks an SM holds at most (``per_sm``, and ``bound``: which of them binds), and the
  ``waves`` its grid then takes on the GPU's ``limits`` (``gpu``). Registers are not counted (the
  PTX does not say how many ``ptxas`` gives a thread), so ``per_sm`` is an upper bound and
  ``waves`` a lower one."""
  by = {"threads": limits["threads_per_core_limit"] // launch["threads"],
        "shared memory": limits["shared_memory_per_core"] // (launch["shared_bytes"]
                                                              + RESERVED_SHARED),
        "blocks": BLOCKS_PER_SM}
  bound = min(by, key=by.get)
  per_sm = by[bound]
  waves = -(-launch["programs"] // (per_sm * limits["core_count"])) if per_sm else None
  return {"per_sm": per_sm, "bound": bound, "waves": waves, "sms": limits["core_count"]}


def launch_text(launch: dict) -> str:
  """A launch's geometry and residency, for a printed line."""
  r = launch.get("residency") or {}
  return (f"grid {'x'.join(map(str, launch['grid']))} of {launch['threads']} threads, "
          f"{launch['shared_bytes'] / 1024:.1f} KiB shared"
          + (f": <= {r['per_sm']} a SM ({r['bound']}), >= {r['waves']} wave(s) on {r['sms']} SMs"
             if r else ""))


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
