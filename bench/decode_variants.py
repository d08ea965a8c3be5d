"""One decode shape, our engine's step under several kernel choices, against the plain-JAX floor.

  python bench/decode_variants.py [--model qwen2.5-1.5b]
                                  [--variants dense:scan:16,dense:unrolled:16,dense:scan:16:separate]
                                  [--json PATH] [--trace DIR] [--legacy]

For finding where an accelerator's decode step goes (``bench/sampler.py`` reports the chosen path
only). Each variant is ``attention:layers:steps[:option...]`` (``choice.ATTENTION``,
``choice.LAYERS``, steps per jitted call; options in any order: a ``choice.PROJECTIONS``, a
``choice.MATMUL``, ``paged``: the paged KV cache, a page table of 64-position pages per slot,
``launch=SPEC``: the Pallas GPU kernel's launch, ``$AREAL_JAX_PALLAS_GPU_PAGED`` with ``+`` for
its commas, e.g. ``launch=bound=1+parts=4``; ``norms`` or ``norms=SPEC``: each RMSNorm in one
kernel with the matmul after it, ``$AREAL_JAX_DECODE_NORM_MATMUL``, e.g. ``norms=block_n=32``;
``branch``: top-k / top-p decided in every step by a conditional rather than once per call on the
host, ``$AREAL_JAX_TRUNCATION_ON_HOST=0``),
forced through ``$AREAL_JAX_DECODE_ATTENTION`` / ``_LAYERS`` / ``_PROJECTIONS`` / ``_MATMUL`` while
its engine is built; the floor's matmuls are compiled as ``--floor-matmul`` says (default: the
platform's choice for our engine, so both run the same GEMMs);
every slot decodes from position ``context`` (random weights, bfloat16 off CPU, float32 on CPU), and
a row is the best of ``--reps`` calls per step. The floor (``bench/decode_floor.py``) runs at the
same shape in the same process. ``--trace DIR`` records a JAX profiler trace (Perfetto JSON) of a few
calls of the first variant. ``--legacy``: only the engine interface older checkouts also have (no
kernel choice; run with an older ``areal_jax`` first on ``PYTHONPATH`` to time it side by side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from areal_jax import sharding
from areal_jax.models import ModelConfig, Transformer
from areal_jax.sampler import engine as engine_lib
from areal_jax.sampler import sampling
from areal_jax.sampler.service import JaxRolloutEngine
import decode_floor

try:
  from areal_jax.kernels import choice
except ImportError:  # an older checkout's areal_jax (--legacy) has no kernel choice
  choice = None

# bench/common.py's two decode shapes, spelled with the fields every checkout's ModelConfig has
# (common.py itself builds configs older checkouts cannot: --legacy)
_SMOLLM2 = dict(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                head_dim=64, d_ff=1536, rope_theta=1e5, norm_eps=1e-5)
_QWEN25_1P5B = dict(arch="qwen2", vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                    n_kv_heads=2, head_dim=128, d_ff=8960, rope_theta=1e6, norm_eps=1e-6,
                    qkv_bias=True, tie_embeddings=True)
SHAPES = {"smollm2-135m": (_SMOLLM2, 64, 128), "qwen2.5-1.5b": (_QWEN25_1P5B, 128, 512)}
PAGE = 64  # positions per page of the paged variants
ENV = {"attention": "AREAL_JAX_DECODE_ATTENTION", "layers": "AREAL_JAX_DECODE_LAYERS",
       "matmul": "AREAL_JAX_DECODE_MATMUL", "projections": "AREAL_JAX_DECODE_PROJECTIONS",
       "launch": "AREAL_JAX_PALLAS_GPU_PAGED",  # (read when the programs are traced: in the run)
       "norms": "AREAL_JAX_DECODE_NORM_MATMUL",  # (read when an engine is built)
       "branch": "AREAL_JAX_TRUNCATION_ON_HOST"}  # (read when an engine is built)


def engine_step_ms(model, slots, context, steps, reps, trace_dir=None, hlo_path=None,
                   paged=False):
  """Best milliseconds per decode step of our engine, every slot decoding from ``context``."""
  kv_len = context + steps * (reps + 2) + 1
  t_start = time.perf_counter()
  stage = lambda what: print(f"    {time.perf_counter() - t_start:7.1f} s {what}", flush=True)  # noqa: E731
  per_slot = -(-(kv_len + steps) // PAGE)
  eng = JaxRolloutEngine(model, num_slots=slots, max_len=kv_len + steps, prefill_buckets=(16,),
                         kv_buckets=(kv_len,), eos_token_ids=(), steps_per_call=steps,
                         **({"kv_pages": slots * per_slot, "page_size": PAGE} if paged else
                            {"kv_pages": 0} if choice is not None else {}))  # (rows: 0, not -1)
  dev = eng.engine
  # paged: every slot holds its own pages for all its positions (a whole pool's worth)
  pages = {"pages": np.arange(slots * per_slot, dtype=np.int32).reshape(slots, per_slot)} \
      if paged else {}
  stage("engine built")
  state = dev.init_state()
  stage("state made")
  keys = np.stack([np.asarray(sampling.slot_key(0, i)) for i in range(slots)])
  state = dev.insert(state, None, list(range(slots)), token=[1] * slots, pos=[context] * slots,
                     end=[kv_len + steps] * slots, keys=keys, temperature=1.0, top_k=0, top_p=1.0,
                     greedy=False, stop_ids=[], **pages)
  jax.block_until_ready(state)
  stage("slots armed")
  t0 = time.perf_counter()
  state, out = dev.generate(dev.params, state, kv_len, **pages)
  jax.block_until_ready(out)
  first_s = time.perf_counter() - t0
  stage("first call")
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    state, out = dev.generate(dev.params, state, kv_len, **pages)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / steps * 1e3)
  if trace_dir:  # a short trace of steady calls
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(2):
        state, out = dev.generate(dev.params, state, kv_len, **pages)
      jax.block_until_ready(out)
  if hlo_path:  # the optimized program of the timed call (compiled again, not run)
    fn = next(f for key, f in dev._generate_fns.items()  # noqa: SLF001 (a benchmark's look inside)
              if key[:2] == (kv_len, slots))
    with open(hlo_path, "w") as f:
      host = getattr(engine_lib, "TRUNCATES", None)  # (the state's host entry; older: none)
      device = {k: v for k, v in state.items() if k != host}
      f.write(fn.lower(dev.params, device, *pages.values()).compile().as_text())
  impl = {k: getattr(dev, f"{k}_impl", "legacy") for k in ("attention", "matmul", "layers")}
  impl["projections"] = getattr(dev, "projections", "legacy")
  impl["cache_layout"] = getattr(dev, "cache_layout", "legacy")
  norms = getattr(dev, "norm_tuning", "legacy")  # (None: as written)
  impl["norms"] = norms if isinstance(norms, str) else norms and dataclasses.asdict(norms)
  impl["truncation_on_host"] = getattr(dev, "truncation_on_host", "legacy")
  return {"step_ms": min(times), "step_ms_all": times, "compile_and_first_s": first_s,
          "kv_len": kv_len, **impl}


def parse_variant(variant: str, on_cpu: bool):
  """``(attention, layers, steps, projections, matmul, paged, launch, norms, branch)`` of a
  variant's spelling (``launch``: the Pallas GPU kernel's, ``$AREAL_JAX_PALLAS_GPU_PAGED``'s
  syntax, "" for the engine's; ``norms``: ``$AREAL_JAX_DECODE_NORM_MATMUL``'s, "" for the
  engine's; ``branch``: "branch" or "")."""
  attention, layers, steps, *options = variant.split(":")
  projections = next((o for o in options if o in choice.PROJECTIONS + ("auto",)), "auto")
  matmul = next((o for o in options if o in choice.MATMUL),
                "xla" if layers == "scan" and on_cpu else "auto")  # scan takes XLA's
  paged = "paged" if "paged" in options else ""
  launch = next((o for o in options if o.startswith("launch=")), "")
  norms = next((o for o in options if o == "norms" or o.startswith("norms=")), "")
  branch = "branch" if "branch" in options else ""
  if unknown := set(options) - {projections, matmul, paged, launch, norms, branch, ""}:
    raise SystemExit(f"variant {variant!r}: unknown option(s) {sorted(unknown)}")
  launch = launch.removeprefix("launch=").replace("+", ",")
  if launch:
    choice.pallas_gpu_tuning(launch)  # a bad one fails here, named
  if norms:  # "norms" alone: the kernel's default launch
    norms = norms.partition("=")[2].replace("+", ",") or "1"
    choice.norm_matmuls("gpu", True, norms)  # a bad one fails here, named
  return attention, layers, steps, projections, matmul, paged, launch, norms, branch


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
  ap.add_argument("--variants", default="dense:scan:16",
                  help="comma-separated attention:layers:steps[:option...], options: a "
                       "projections, a matmul choice, paged, launch=SPEC, norms[=SPEC], branch "
                       "(auto allowed in each field)")
  ap.add_argument("--floor-matmul", choices=("auto", "xla", "blas"), default="auto",
                  help="GEMMs of the floor loop's program: auto = our engine's choice here")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--json", default=None)
  ap.add_argument("--trace", default=None, help="directory for a profiler trace of the first variant")
  ap.add_argument("--legacy", action="store_true", help="older checkouts: no kernel choice")
  ap.add_argument("--hlo", default=None, help="write the first variant's optimized HLO here")
  ap.add_argument("--no-floor", action="store_true")
  ap.add_argument("--fused-floor", action="store_true",
                  help="also time the floor with q/k/v and gate/up fused (floor_fused_step_ms)")
  args = ap.parse_args()
  shape, slots, context = SHAPES[args.model]
  on_cpu = jax.default_backend() == "cpu"
  parsed = {v: parse_variant(v, on_cpu) if not args.legacy else (*v.split(":")[:3], "", "", "", "", "", "")
            for v in args.variants.split(",")}
  cfg = ModelConfig(**shape, dtype="float32" if on_cpu else "bfloat16")
  model = Transformer(cfg, nnx.Rngs(0))
  dev0 = jax.devices()[0]
  info = {"jax": jax.__version__, "devices": f"{len(jax.devices())} x {dev0.platform}",
          "device_kind": dev0.device_kind, "areal_jax": os.path.dirname(__import__("areal_jax").__file__)}
  print(f"{info['jax']} on {info['devices']}: {args.model} shape, {slots} slots, context {context}")
  result = {"machine": info, "model": args.model, "slots": slots, "context": context, "rows": []}
  hw = None
  if not args.legacy:  # bench/common.py builds configs older checkouts lack
    from common import Hardware, decode_step_cost  # noqa: PLC0415
    hw = Hardware().probe(3)
    result["hardware"] = hw.figures()
    result["bytes_per_step"] = decode_step_cost(cfg, slots, context)[0]
    print(f"read {result['hardware']['read_GBps']:.0f} GB/s; a step must read "
          f"{result['bytes_per_step'] / 1e6:.0f} MB")
  floor_options = None
  if not args.legacy:
    floor_matmul = args.floor_matmul if args.floor_matmul != "auto" else \
        choice.matmul(sharding.make_mesh({}, jax.devices()[:1]), cfg.compute_dtype)
    floor_options = choice.compiler_options(floor_matmul)
    result["floor_matmul"] = floor_matmul
  if not args.no_floor:
    result["floor_step_ms"] = decode_floor.step_ms(cfg, slots, context, cfg.compute_dtype,
                                                   reps=args.reps, compiler_options=floor_options)
    if hw is not None:
      result["floor_hbm_roofline_frac"] = (result["bytes_per_step"] / (hw.figures()["read_GBps"] * 1e9)
                                           / (result["floor_step_ms"] / 1e3))
    print(f"{'floor loop':>28}: {result['floor_step_ms']:8.3f} ms/step"
          + (f" ({result['floor_matmul']} matmuls)" if "floor_matmul" in result else ""))
    if args.fused_floor:
      result["floor_fused_step_ms"] = decode_floor.step_ms(
          cfg, slots, context, cfg.compute_dtype, reps=args.reps, fused=True,
          compiler_options=floor_options)
      print(f"{'floor loop, fused weights':>28}: {result['floor_fused_step_ms']:8.3f} ms/step")
  for n, variant in enumerate(args.variants.split(",")):
    attention, layers, steps, projections, matmul, paged, launch, norms, branch = parsed[variant]
    saved = {k: os.environ.get(v) for k, v in ENV.items()}
    try:
      if not args.legacy:
        os.environ[ENV["attention"]], os.environ[ENV["layers"]] = attention, layers
        os.environ[ENV["matmul"]] = matmul
        os.environ[ENV["projections"]] = projections
        if launch:  # (else the process's own, if any)
          os.environ[ENV["launch"]] = launch
        if norms:  # (else the process's own, if any)
          os.environ[ENV["norms"]] = norms
        if branch:  # (else the process's own, if any)
          os.environ[ENV["branch"]] = "0"
      row = engine_step_ms(model, slots, context, int(steps), args.reps,
                           args.trace if n == 0 else None, args.hlo if n == 0 else None,
                           paged=paged == "paged")
    except Exception as e:  # noqa: BLE001 (a variant that cannot run is reported, not fatal)
      row = {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
      for k, v in saved.items():
        os.environ.pop(ENV[k], None) if v is None else os.environ.__setitem__(ENV[k], v)
    row.update(variant=variant, steps_per_call=int(steps))
    if "floor_step_ms" in result and "step_ms" in row:
      row["floor_ratio"] = row["step_ms"] / result["floor_step_ms"]
    if "floor_fused_step_ms" in result and "step_ms" in row:
      row["floor_fused_ratio"] = row["step_ms"] / result["floor_fused_step_ms"]
    if hw is not None and "step_ms" in row:
      row["hbm_roofline_frac"] = (result["bytes_per_step"] / (hw.probe().figures()["read_GBps"] * 1e9)
                                  / (row["step_ms"] / 1e3))
    result["rows"].append(row)
    if "error" in row:
      print(f"{variant:>28}: {row['error']}")
    else:
      print(f"{variant:>28}: {row['step_ms']:8.3f} ms/step (median of {len(row['step_ms_all'])} "
            f"calls {np.median(row['step_ms_all']):.3f}; {row['attention']} attention, "
            f"{row['layers']} layers, {row['matmul']} matmuls; first call "
            f"{row['compile_and_first_s']:.1f} s)"
            + (f", {row['floor_ratio']:.2f}x floor" if "floor_ratio" in row else "")
            + (f", {100 * row['hbm_roofline_frac']:.0f}% of the HBM roofline"
               if "hbm_roofline_frac" in row else ""))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
