"""A decode step's RMSNorm + matmul pieces alone, at a shape's layers: XLA's (a norm kernel, the
GEMM as the engine compiles it, the bias or SwiGLU) against our one-kernel Pallas form under
several launches.

  python bench/norm_matmul.py [--model qwen2.5-1.5b] [--tunings "default;block_n=32"]
                              [--json PATH] [--compile-only h100 [--ptx]]

The two pieces ``kernels/pallas_norm_matmul.py`` fuses (``$AREAL_JAX_DECODE_NORM_MATMUL``): the
norm and the fused q/k/v projection (with its bias where the model has one), and the norm, the
fused gate/up projection and SwiGLU. Every layer of the shape runs the piece with its own weights
(so the weights come from memory, not from a cache warm with one layer's), on the decode step's
rows (one per slot), in one program. ``xla`` is the model's own code compiled with the engine's
GEMM options on this platform (cuBLAS on a GPU: ``choice.compiler_options("blas")``); the others
are our kernel under ``pallas_norm_matmul.NormTuning`` launches (``default``: the engine's).
Per launch: microseconds per layer (best of ``--reps`` calls of all layers), the weight bytes a
layer reads over that time, that as a fraction of the read probe's bandwidth, the time against
``xla``'s, and the largest difference of the outputs from ``xla``'s. ``--compile-only TARGET``
compiles each for a GPU this machine lacks (``bench/aot_decode.py``'s targets) and counts its
kernels instead (``--ptx``: and what our kernel's PTX holds, ``bench/ptx.py``). On CPU the
kernel runs in Pallas interpret mode (``--model tiny`` is for tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

if any(a.startswith("--compile-only") for a in sys.argv):  # as bench/aot_decode.py: no GPU here
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from areal_jax.kernels import choice, pallas_norm_matmul  # noqa: E402
from areal_jax.models import transformer  # noqa: E402
from common import (QWEN25_1P5B, SMOLLM2, TINY, Hardware, against, best_time,  # noqa: E402
                    finish, machine)
from paged_kernel import compiled, ptx_line  # noqa: E402

SHAPES = {"qwen2.5-1.5b": (QWEN25_1P5B, 128), "smollm2-135m": (SMOLLM2, 64), "tiny": (TINY, 4)}
SWEEP = "xla;default;block_n=32;block_n=16;warps=8;stages=2;stages=4;block_n=32,warps=8"


def pieces(cfg) -> dict:
  """``{name: (inputs, outputs of the weight, glu, bias)}`` of the two fused pieces."""
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  return {"norm+qkv": (cfg.d_model, qkv, False, cfg.qkv_bias),
          "norm+gate_up+swiglu": (cfg.d_model, 2 * cfg.d_ff, True, False)}


def reference(x_NxE, scale_E, w_ExO, bias_O, eps: float, glu: bool):
  """The model's own form (``transformer.rms_norm``, ``linear``, ``MLP``'s SwiGLU)."""
  y = transformer.linear(transformer.rms_norm(x_NxE, scale_E, eps), w_ExO)
  if glu:
    y = y.reshape(y.shape[0], -1, 2)
    y = jax.nn.silu(y[..., 0]) * y[..., 1]
  return y if bias_O is None else y + bias_O


def tuning(spec: str) -> pallas_norm_matmul.NormTuning:
  """A launch in ``$AREAL_JAX_DECODE_NORM_MATMUL``'s syntax (``default``: the engine's)."""
  return choice.norm_matmuls("gpu", True, "1" if spec == "default" else spec)


def program(spec: str, n_layers: int, eps: float, glu: bool, bias: bool, gpu: bool):
  """Every layer's piece (its own weights), one program, compiled as the engine compiles its
  decode step on a GPU (``gpu``; else XLA's GEMMs and the kernel in interpret mode); ``spec``:
  ``xla``, or our kernel's launch (``tuning``)."""
  if spec == "xla":
    one = functools.partial(reference, eps=eps, glu=glu)
  else:
    one = functools.partial(pallas_norm_matmul.norm_matmul, eps=eps, glu=glu,
                            tuning=tuning(spec), interpret=not gpu)

  def all_layers(x, *layers):  # (each layer's arrays its own, as the engine holds them unrolled)
    per = 3 if bias else 2
    return tuple(one(x, *layers[i * per:i * per + 2], layers[i * per + 2] if bias else None)
                 for i in range(n_layers))
  return jax.jit(all_layers, compiler_options=choice.compiler_options("blas" if gpu else "xla"))


def inputs(cfg, rows: int, d_in: int, d_w: int, bias: bool, dtype, abstract: bool):
  """The rows ``[N, E]``, then per layer its norm scale ``[E]`` (float32, as held), weight
  ``[E, O]`` and, with ``bias``, bias ``[O]``."""
  # (shape, dtype, scale of a standard normal, offset) of the rows, then of each layer's arrays
  layer = [((d_in,), jnp.float32, 0.1, 1.0), ((d_in, d_w), dtype, d_in ** -0.5, 0.0)]
  layer += [((d_w,), dtype, 1.0, 0.0)] if bias else []
  specs = [((rows, d_in), dtype, 1.0, 0.0)] + layer * cfg.n_layers
  if abstract:
    return [jax.ShapeDtypeStruct(shape, dt) for shape, dt, _, _ in specs]
  keys = jax.random.split(jax.random.key(0), len(specs))
  return [(offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dt)
          for key, (shape, dt, scale, offset) in zip(keys, specs)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
  ap.add_argument("--tunings", default=SWEEP, help="';'-separated: xla, default, or launches")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--compile-only", default=None, metavar="TARGET",
                  help="compile for a GPU under bench/aot_targets (e.g. h100) and count kernels")
  ap.add_argument("--ptx", action="store_true",
                  help="with --compile-only: our kernel's PTX instructions (bench/ptx.py)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  if args.ptx and not args.compile_only:
    ap.error("--ptx reads what --compile-only compiles")
  t_start = time.perf_counter()
  cfg, rows = SHAPES[args.model]
  on_cpu = jax.default_backend() == "cpu"
  interpret = on_cpu and not args.compile_only
  dtype = jnp.float32 if interpret else jnp.bfloat16
  specs = [s.strip() for s in args.tunings.split(";") if s.strip()]
  for spec in specs:  # a bad launch fails here, named, before anything runs
    if spec != "xla":
      tuning(spec)
  hw = None if args.compile_only else Hardware().probe(3)
  read_GBps = None if hw is None else hw.figures()["read_GBps"]
  result = {"bench": "norm_matmul", "machine": machine(), "model": args.model, "rows": rows,
            "dtype": jnp.dtype(dtype).name, "read_GBps": read_GBps, "target": args.compile_only,
            "results": []}
  print(f"{args.model} shape: {rows} rows, {cfg.n_layers} layers, {jnp.dtype(dtype).name}"
        + ("" if hw is None else f"; read probe {read_GBps:.0f} GB/s")
        + ("; Pallas interpret mode (its times are not the kernel's)" if interpret else ""))
  for piece, (d_in, d_w, glu, bias) in pieces(cfg).items():
    args_ = inputs(cfg, rows, d_in, d_w, bias, dtype, abstract=bool(args.compile_only))
    w_bytes = d_in * d_w * jnp.dtype(dtype).itemsize  # a layer's weight
    base = None
    for spec in specs:
      row = {"piece": piece, "tuning": spec, "weight_bytes_per_layer": w_bytes}
      if spec != "xla":
        row.update(dataclasses.asdict(tuning(spec)))
      fn = program(spec, cfg.n_layers, cfg.norm_eps, glu, bias, gpu=not interpret)
      if args.compile_only:
        row.update(compiled(fn, args_, args.compile_only, cfg.n_layers,
                            None if spec == "xla" else "norm_matmul"))
        print(f"  {piece:20s} {spec:24s} compile {row['compile_s']:5.1f} s, "
              f"{row['launches_per_layer']:4.1f} kernels a layer{ptx_line(row)}")
      else:
        out = fn(*args_)
        us = best_time(fn, *args_, reps=args.reps) / cfg.n_layers * 1e6
        out = np.stack([np.asarray(o, np.float32) for o in out])
        base = base or (us, out)
        figures, line = against(us, out, base, w_bytes, read_GBps, "vs_first")
        row.update(figures)
        print(f"  {piece:20s} {spec:24s} {line}")
      result["results"].append(row)
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
