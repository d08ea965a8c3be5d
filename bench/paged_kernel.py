"""A decode step's attention over the paged cache alone, at a shape's layers, launched several ways:
JAX's Pallas GPU paged-attention kernel under each launch, our kernel that also writes the step's
keys and values (``writes=1``), and the dense read.

  python bench/paged_kernel.py [--model qwen2.5-1.5b] [--page-sizes 64]
                               [--tunings "default;bound=1;writes=1"] [--json PATH]
                               [--compile-only h100 [--ptx]]

What one decode step's attention costs on a GPU, with nothing else in the program: every layer of
the shape (each its own index into one pool, as the sampler's paged cache holds them) runs
``kernels.paged_attention.decode_step_paged`` (the layer's new keys and values written into their
pages, then the attention; the pools donated and written in place, as in the engine's step) with
``impl="pallas_gpu"`` (the GPU default: two scatters, our query reshape, the
kernel, JAX's combine of its parts), under each launch of ``--tunings``
(``pallas_attention.PagedTuning``, in ``$AREAL_JAX_PALLAS_GPU_PAGED``'s syntax; ``default`` is the
engine's; ``writes=1`` is ``kernels.pallas_paged_step``, the writes and the attention one kernel,
``writes=1,parts=N`` that kernel reading each row in ``N`` parts combined after it, ``dot=1``
with its products as tensor-core dots over the queries padded to 16 rows),
and the dense read of the gathered pages (``impl="dense"``) beside them. Every slot decodes at
position ``--context``; each slot owns ``--max-len`` positions of pages, shuffled over the pool,
and the program's kv bound is the context + 65 (what ``bench/sampler.py``'s roofline row runs).
Per launch: microseconds per layer (best of ``--reps`` calls of all layers), the keys and values
the layer must read (every slot's positions up to its own) over that time, that as a fraction of
the read probe's bandwidth, the time against ``default``'s, and the largest difference of its
outputs from ``default``'s (the same attention: a launch that reads wrong shows here; ``writes=1``
gives its output in the queries' dtype, so on a GPU that difference includes bfloat16's
rounding). ``--compile-only TARGET`` compiles each launch for a GPU this machine does not have
(``bench/aot_decode.py``'s targets) and counts its kernels instead: a launch that would not lower
for the GPU fails here, not on a lent one; with ``--ptx`` also what its kernel's PTX holds and in
what order (``bench/ptx.py``: vector or scalar loads, asynchronous copies, barriers, products).
On CPU the kernels run in Pallas interpret mode (slow; ``--model tiny`` is for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if any(a.startswith("--compile-only") for a in sys.argv):  # as bench/aot_decode.py: no GPU here
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
import ptx  # noqa: E402

PTX_DUMP = ptx.dump_to() if "--ptx" in sys.argv else None  # (before JAX reads XLA_FLAGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from areal_jax.kernels import choice, paged_attention, pallas_attention  # noqa: E402
from common import (QWEN25_1P5B, SMOLLM2, TINY, Hardware, against, best_time,  # noqa: E402
                    finish, machine)

SHAPES = {"qwen2.5-1.5b": (QWEN25_1P5B, 128, 512), "smollm2-135m": (SMOLLM2, 64, 128),
          "tiny": (TINY, 4, 24)}
SWEEP = ("default;writes=1,dot=1;writes=1,dot=1,stages=1;writes=1,dot=1,block_pages=2;"
         "writes=1,dot=1,block_pages=4;writes=1,dot=1,block_pages=2,stages=1;"
         "writes=1,dot=1,stages=3;writes=1,dot=1,stages=1,warps=4;writes=1,dot=1,parts=2;writes=1,dot=1,parts=4;"
         "writes=1,dot=1,warps=4;writes=1;writes=1,parts=2;"
         "bound=1;bound=1,stages=1;bound=1,parts=1;bound=1,parts=4;bound=1,block_pages=2;"
         "bound=1,warps=4;bound=1,stages=1,warps=4;bound=1,stages=1,block_pages=2;warps=4")
# (ours early: a sweep cut short by its limit keeps it; writes=1,warps=2 is left out: 1.4 ms a
# layer at pages of 128 on an H200, bench/results/h200-2026-11-30-2b4ab86)


def tuning(spec: str) -> pallas_attention.PagedTuning:
  """A launch in ``$AREAL_JAX_PALLAS_GPU_PAGED``'s syntax (``default``: the engine's)."""
  return choice.pallas_gpu_tuning("" if spec == "default" else spec)


def inputs(cfg, slots: int, context: int, max_len: int, page: int, dtype, abstract: bool = False):
  """A decode step's inputs at every slot's position ``context``: queries ``[B, K, G, D]`` and new
  keys and values ``[B, K, D]``, the pools ``[K, L, M, P, D]`` (every slot's pages, shuffled, and
  the trash page), page tables ``[B, N]``, positions ``[B]`` and the page and offset each slot
  writes ``[B]`` (``abstract``: their shapes only)."""
  kv, g, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  per_slot = -(-max_len // page)
  pool = (kv, cfg.n_layers, slots * per_slot + 1, page, d)
  shapes = [((slots, kv, g, d), dtype), ((slots, kv, d), dtype), ((slots, kv, d), dtype),
            (pool, dtype), (pool, dtype), ((slots, per_slot), jnp.int32)] + [
            ((slots,), jnp.int32)] * 3
  if abstract:
    return [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
  keys = jax.random.split(jax.random.key(0), 5)
  arrays = [jax.random.normal(key, shape, dt) for key, (shape, dt) in zip(keys, shapes[:5])]
  table_BxN = np.random.default_rng(0).permutation(slots * per_slot).astype(np.int32)
  table_BxN = table_BxN.reshape(slots, per_slot)
  return arrays + [jnp.asarray(table_BxN), jnp.full((slots,), context, jnp.int32),
                   jnp.asarray(table_BxN[:, context // page]),
                   jnp.full((slots,), context % page, jnp.int32)]


def program(impl: str, how: pallas_attention.PagedTuning, n_layers: int, t: int, interpret: bool):
  """Every layer's decode step (``paged_attention.decode_step_paged``: the new keys and values
  written, then the attention), the pools donated and returned (written in place, as the engine's
  step writes them)."""
  def step_all(q, k_new, v_new, k_pool, v_pool, table, pos, page_B, offset_B):
    outs = []
    for i in range(n_layers):
      out, k_pool, v_pool = paged_attention.decode_step_paged(
          q, k_new, v_new, k_pool, v_pool, i, table, page_B, offset_B, pos, t, impl,
          q.shape[-1] ** -0.5, interpret=interpret, tuning=how)
      # the next layer's writes after this layer's read, as in the engine, where the next
      # layer's queries come from this one's output (without it XLA may write every layer
      # first and keep a copy of the pools for each read: the dense read then asked an H200 for
      # ~28 copies, 84 GiB)
      out, k_pool, v_pool = jax.lax.optimization_barrier((out, k_pool, v_pool))
      outs.append(out)
    return tuple(outs), k_pool, v_pool
  return jax.jit(step_all, donate_argnums=(3, 4))


def stepper(fn, args: list):
  """``fn`` called on ``args`` with each call's pools fed to the next; returns the outputs."""
  args = list(args)

  def call():
    outs, args[3], args[4] = fn(*args)
    return outs
  return call


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
  ap.add_argument("--context", type=int, default=0, help="default: the shape's")
  ap.add_argument("--max-len", type=int, default=0,
                  help="positions of pages each slot owns (default: the context + 1280, the "
                       "page table bench/sampler.py's roofline row gives the engine)")
  ap.add_argument("--page-sizes", default="64")
  ap.add_argument("--tunings", default=SWEEP, help="';'-separated launches")
  ap.add_argument("--no-dense", action="store_true", help="skip the dense read of gathered pages")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--compile-only", default=None, metavar="TARGET",
                  help="compile for a GPU under bench/aot_targets (e.g. h100) and count kernels")
  ap.add_argument("--ptx", action="store_true",
                  help="with --compile-only: each kernel's PTX instructions (bench/ptx.py)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  if args.ptx and not args.compile_only:
    ap.error("--ptx reads what --compile-only compiles")
  t_start = time.perf_counter()
  cfg, slots, context = SHAPES[args.model]
  context = args.context or context
  max_len = args.max_len or context + 1280
  t = context + 65
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.float32 if on_cpu and not args.compile_only else jnp.bfloat16
  itemsize = jnp.dtype(dtype).itemsize
  kv_bytes = slots * cfg.n_kv_heads * (context + 1) * cfg.head_dim * 2 * itemsize  # a layer's
  specs = [s.strip() for s in args.tunings.split(";") if s.strip()]
  launches = [(s, "pallas_gpu", tuning(s)) for s in specs]
  if not args.no_dense:
    launches.append(("dense read of the gathered pages", "dense", pallas_attention.PagedTuning()))
  hw = None if args.compile_only else Hardware().probe(3)
  rows, read_GBps = [], None if hw is None else hw.figures()["read_GBps"]
  result = {"bench": "paged_kernel", "machine": machine(), "model": args.model, "slots": slots,
            "context": context, "kv_bound": t, "max_len": max_len, "dtype": jnp.dtype(dtype).name,
            "kv_bytes_per_layer": kv_bytes, "read_GBps": read_GBps, "target": args.compile_only,
            "rows": rows}

  def keep(row):  # the JSON so far after every row: a run cut short keeps what it measured
    rows.append(row)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
  print(f"{args.model} shape: {slots} slots x {cfg.n_kv_heads} K/V heads x {cfg.head_dim}, "
        f"{cfg.n_layers} layers, context {context} (kv bound {t}, {max_len} positions of pages a "
        f"slot), {jnp.dtype(dtype).name}; a layer must read {kv_bytes / 1e6:.1f} MB of keys and "
        f"values" + ("" if hw is None else f"; read probe {read_GBps:.0f} GB/s")
        + ("; Pallas interpret mode (its times are not the kernel's)" if on_cpu and hw else ""))
  for page in [int(p) for p in args.page_sizes.split(",")]:
    args_ = inputs(cfg, slots, context, max_len, page, dtype, abstract=bool(args.compile_only))
    base = None
    for name, impl, how in launches:
      row = {"page_size": page, "tuning": name, "impl": impl, **vars(how)}
      fn = program(impl, how, cfg.n_layers, t, interpret=on_cpu and not args.compile_only)
      if args.compile_only:
        kernel = None if impl != "pallas_gpu" else (
            "paged_decode_step" if how.writes else "paged_attention")
        row.update(compiled(fn, args_, args.compile_only, cfg.n_layers, kernel))
        print(f"  page {page:4d} {name:44s} compile {row['compile_s']:5.1f} s, "
              f"{row['launches_per_layer']:5.1f} kernels a layer{ptx_line(row)}")
        keep(row)
        continue
      try:
        call = stepper(fn, [jnp.copy(a) for a in args_])  # the pools donated: a copy of each
        out = call()
        us = best_time(call, reps=args.reps) / cfg.n_layers * 1e6
      except jax.errors.JaxRuntimeError as e:  # (out of memory, a launch the GPU refuses): noted
        row["error"] = str(e).splitlines()[0][:300]
        print(f"  page {page:4d} {name:44s} failed: {row['error']}")
        keep(row)
        continue
      out = np.stack([np.asarray(o, np.float32) for o in out])
      base = base or (us, out)
      figures, line = against(us, out, base, kv_bytes, read_GBps, "vs_default")
      row.update(figures)
      print(f"  page {page:4d} {name:44s} {line}")
      keep(row)
  best = min((r for r in rows if "us_per_layer" in r and r["impl"] == "pallas_gpu"),
             key=lambda r: r["us_per_layer"], default=None)
  if best:
    print(f"fastest launch: page {best['page_size']}, {best['tuning']} "
          f"({best['us_per_layer']:.1f} us a layer, {best['read_frac']:.2f} of the probe)")
  finish(result, args.json, t_start)


def compiled(fn, fargs, target: str, n_layers: int, kernel: str | None = None) -> dict:
  """Compile ``fn`` for ``target`` (no such device here) and count its kernels; with ``--ptx``,
  ``ptx``: the summary of the PTX of the kernel named ``kernel``, and ``launch``: its grid,
  threads and shared memory as XLA launches it, and the blocks an SM of ``target`` holds
  (``bench/ptx.py``)."""
  import aot_decode  # noqa: PLC0415 (its GPU target descriptions)
  from jax.sharding import SingleDeviceSharding  # noqa: PLC0415

  device = aot_decode.target_device(target)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
            for a in fargs]  # shapes only: nothing is allocated
  if PTX_DUMP:
    ptx.take(PTX_DUMP, "")  # (what earlier compiles dumped)
  t0 = time.perf_counter()
  with choice.lowering_for("gpu"):
    hlo = choice.lower(fn, shapes, "cuda").compile().as_text()
  counts = aot_decode.launches(hlo)
  kernels = aot_decode.launch_total(counts)
  out = {"compile_s": time.perf_counter() - t0, "launches_per_layer": kernels / n_layers,
         "copied_MB": counts["copied_bytes"] / 1e6}
  launch = ptx.geometry(PTX_DUMP, kernel) if PTX_DUMP and kernel else None
  if launch is not None:  # (XLA's thunk sequence: read before take empties the dump)
    out["launch"] = {**launch, "residency": ptx.residency(launch, ptx.gpu(target))}
  text = ptx.take(PTX_DUMP, kernel) if PTX_DUMP and kernel else None
  if text is not None:
    out["ptx"] = ptx.summary(text)
  return out


def ptx_line(row: dict) -> str:
  """A compiled row's launch and PTX counts, for its printed line ("" without them)."""
  out = f"; {ptx.launch_text(row['launch'])}" if "launch" in row else ""
  if "ptx" in row:
    out += "; PTX " + ", ".join(f"{k} {n}" for k, n in row["ptx"]["counts"].items() if n)
  return out


if __name__ == "__main__":
  main()
