"""Causal attention of whole rows, run time: JAX's flash kernel against the dense form, as a train
step and a prefill run them (``actor.attention``, ``rollout.prefill_attention``;
``kernels.causal_attention``, ``models.transformer.row_attention``).

  python bench/causal_attention.py [--model qwen2.5-1.5b] [--lengths 1024,3072,8192,16384]
      [--tokens 12288] [--segment 300] [--impls dense,pallas_gpu] [--reps 5] [--json PATH]

Per row length L: rows of L positions, ``--tokens`` a call (``--tokens // L`` rows, at least one),
packed with sequences of about ``--segment`` tokens (GSM8K's samples are ~300; 0: one sequence a
row, a long rollout), one layer's attention at the model's heads (random q/k/v in bfloat16 off
CPU, float32 on CPU). Two programs per form and length: the forward (a prefill's) and the
forward + backward (a train step's), each timed as the best of ``--reps`` calls after its compile.
Per row: milliseconds a call; the causal FLOPs' rate, counted the same for every form (4 x heads x
head size x L(L+1)/2 a row forward, 3x that forward + backward; packed sequences need fewer, and no
form here skips across them, so the rate compares the forms) and that rate over this run's matmul
probe (bfloat16 8192^3 off CPU: the chip's attainable matmul rate, the physical limit here); the
program's temporaries (XLA's memory analysis); the dense form's time over the kernel's; and the
largest difference of the outputs (forward) or of the query gradients (backward) from the dense
form's, over the positions that belong to a sequence. A form that does not fit (compile or run
out of memory) is reported so and the sweep goes on; the JSON is written after every row.
On CPU the kernels run only in Pallas interpret mode, far too slow to time, so the default there
is the dense form alone (``--model tiny --lengths 64 --impls dense,pallas_gpu`` checks the bench).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.kernels import choice
from areal_jax.models import transformer
from common import (QWEN3_1P7B, QWEN25_1P5B, SMOLLM2, TINY, Hardware, best_time, finish,
                    machine)

SHAPES = {"qwen2.5-1.5b": QWEN25_1P5B, "qwen3-1.7b": QWEN3_1P7B, "smollm2-135m": SMOLLM2,
          "tiny": TINY}
PASSES = ("forward", "forward+backward")
BACKWARD_FLOPS = 3  # forward + backward over forward: 2 products forward, 4 backward


def packed_segments(rng, rows: int, length: int, segment: int) -> np.ndarray:
  """``[rows, length]`` segment ids (1, 2, ...) of sequences of about ``segment`` tokens
  (exponential lengths, at least 16) filling each row, the last one cut at the row's end; one
  sequence a row when ``segment`` is 0."""
  ids = np.ones((rows, length), np.int32)
  if not segment:
    return ids
  for r in range(rows):
    start, seg = 0, 1
    while start < length:
      n = max(16, int(rng.exponential(segment)))
      ids[r, start:start + n] = seg
      start, seg = start + n, seg + 1
  return ids


def causal_flops(cfg, rows: int, length: int) -> float:
  """The forward's causal FLOPs: q k^T and p v over each row's L(L+1)/2 query-key pairs."""
  return 4.0 * cfg.n_heads * cfg.head_dim * rows * length * (length + 1) / 2


def programs(cfg, impl: str, ids_BxL):
  """``{pass: jitted fn(q, k, v, cot) -> array}``: the forward's output, and the query
  gradient of <output, cot> (keys' and values' computed in the same program)."""
  b, length = ids_BxL.shape
  attend_with, seen = transformer.row_attention(jnp.asarray(ids_BxL), b, length, cfg.head_dim,
                                                impl)

  def forward(q, k, v):
    return attend_with(seen)(q, k, v)

  def backward(q, k, v, cot):
    out, vjp = jax.vjp(forward, q, k, v)
    dq, dk, dv = vjp(cot.astype(out.dtype))
    return dq, dk.sum(), dv.sum()  # (dk, dv reduced: kept in the program, not returned whole)

  return {"forward": jax.jit(lambda q, k, v, cot: forward(q, k, v)),
          "forward+backward": jax.jit(lambda q, k, v, cot: backward(q, k, v, cot)[0])}


def _error(e: Exception) -> str:
  text = str(e).strip().splitlines()
  first = text[0] if text else type(e).__name__
  return ("out of memory: " if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
          else "") + first[:300]


def measure(fn, args, reps: int) -> dict:
  """Compile ``fn`` on ``args`` and time it; ``{"error": ...}`` where it does not fit or fails."""
  try:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    out = compiled(*args)
    s = best_time(compiled, *args, reps=reps)
  except Exception as e:  # noqa: BLE001  (out of memory, a kernel this device cannot run)
    return {"error": _error(e)}
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  return {"ms": s * 1e3, "compile_s": compile_s, "out": np.asarray(out.astype(jnp.float32)),
          "temp_gib": None if temp is None else temp / 2**30}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
  ap.add_argument("--lengths", default="1024,3072,8192,16384")
  ap.add_argument("--tokens", type=int, default=12288)
  ap.add_argument("--segment", type=int, default=300)
  ap.add_argument("--impls", default=None,
                  help="comma-separated of dense, pallas_gpu, pallas_tpu (default: dense and the "
                       "platform's kernel; dense alone on CPU)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  t_start = time.perf_counter()
  cfg, platform = SHAPES[args.model], jax.default_backend()
  kernel = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
  impls = args.impls.split(",") if args.impls else ["dense"] + ([kernel] if kernel else [])
  if impls[0] != "dense":
    raise SystemExit(f"--impls must start with dense (the reference the others are compared "
                     f"to), got {args.impls!r}")
  for impl in impls:  # a bad name or a kernel this device cannot run stops here, named
    choice.causal_attention(impl, cfg.head_dim)
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  hw = Hardware().probe(3)
  probe = hw.figures()
  mach = machine()
  print(f"{mach['device_kind']} ({platform}), jax {jax.__version__}: {args.model} heads "
        f"{cfg.n_heads}/{cfg.n_kv_heads} x {cfg.head_dim}, {jnp.dtype(dtype).name}, "
        f"{args.tokens} tokens a call, sequences of ~{args.segment or 'L'}; matmul probe "
        f"{probe['matmul_GFLOPps'] / 1e3:.1f} TFLOP/s ({probe['matmul_dtype']})")
  rng = np.random.default_rng(0)
  result = {"bench": "causal_attention", "machine": mach, "probe": probe, "model": args.model,
            "dtype": jnp.dtype(dtype).name, "tokens": args.tokens, "segment": args.segment,
            "rows": []}
  print(f"{'L':>6} {'rows':>4} {'pass':<17}{'impl':<11}{'ms':>9}{'TFLOP/s':>9}{'of probe':>9}"
        f"{'temp GiB':>9}{'dense/it':>9}{'max diff':>10}")
  for length in (int(x) for x in args.lengths.split(",")):
    b = max(1, args.tokens // length)
    ids = packed_segments(rng, b, length, args.segment)
    keys = jax.random.split(jax.random.key(length), 4)
    q = jax.random.normal(keys[0], (b, length, cfg.n_heads, cfg.head_dim), dtype)
    k, v = (jax.random.normal(kk, (b, length, cfg.n_kv_heads, cfg.head_dim), dtype)
            for kk in keys[1:3])
    cot = jax.random.normal(keys[3], q.shape, dtype)
    inside = ids > 0
    for pass_ in PASSES:
      base = None
      for impl in impls:
        m = measure(programs(cfg, impl, ids)[pass_], (q, k, v, cot), args.reps)
        flops = causal_flops(cfg, b, length) * (BACKWARD_FLOPS if pass_ != "forward" else 1)
        row = {"length": length, "rows": b, "pass": pass_, "impl": impl}
        if "error" in m:
          row["error"] = m["error"]
          print(f"{length:>6} {b:>4} {pass_:<17}{impl:<11} {m['error'][:120]}")
        else:
          out = m.pop("out")
          row.update(m, tflops=flops / m["ms"] / 1e9,
                     frac_of_probe=flops / m["ms"] / 1e6 / probe["matmul_GFLOPps"])
          if impl == "dense":
            base = (row["ms"], out)
          elif base is not None:
            row["dense_over_this"] = base[0] / row["ms"]
            row["max_abs_diff"] = float(np.abs(out - base[1])[inside].max())
          temp = "-" if row["temp_gib"] is None else f"{row['temp_gib']:.2f}"
          print(f"{length:>6} {b:>4} {pass_:<17}{impl:<11}{row['ms']:>9.3f}{row['tflops']:>9.1f}"
                f"{row['frac_of_probe']:>9.2f}{temp:>9}"
                f"{row.get('dense_over_this', 1.0):>9.2f}{row.get('max_abs_diff', 0.0):>10.1e}")
        result["rows"].append(row)
        finish_partial(result, args.json)
  finish(result, args.json, t_start)


def finish_partial(result: dict, path: str | None) -> None:
  """The JSON so far (a sweep cut short by its time limit keeps its rows)."""
  if path:
    import json  # noqa: PLC0415
    with open(path, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
