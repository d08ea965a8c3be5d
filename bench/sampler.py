"""Rollout sampler throughput: continuous batching vs a static-batch baseline, and the decode roofline.

  python bench/sampler.py [--quick] [--json PATH] [--peer vllm] [--model qwen2.5-1.5b]

Workload: GRPO-style prompts with n samples each, every *sample* with its own long-tailed length
(log-normal, EOS disabled so every sequence runs to its drawn length), many more sequences than
slots. Each sample is submitted as its own ``n=1`` request (the public interface has one
``max_new_tokens`` per request); samples of a prompt are submitted together and share one prefill
in both engines. Both engines use the same jitted prefill / insert / generate at the same slot count:
  * ``continuous``: ``JaxRolloutEngine`` admits waiting requests as soon as slots free up.
  * ``static``: fills all slots, decodes until the longest sequence of the batch ends, then takes
    the next batch.
Tokens/s counts generated tokens (each sequence its own length) over wall time, prefill included.

Roofline (SmolLM2-135M shapes, all 64 slots decoding): per step the weights (including the tied
embedding read by the LM head) and each slot's KV up to its position must be read, and
2 * matmul params * slots + attention FLOPs computed. Ideal step time is
max(bytes / read bandwidth, FLOPs / matmul throughput); ``roofline_frac`` is ideal over measured
step time. The same decode is then measured with XLA's attention in place of the CPU decode-attention
kernel (``roofline_xla_attention``; ``cpu_attention_kernel`` says whether the kernel ran), and with
XLA's matmuls in place of the packed-weight kernel (``roofline_xla_matmul``; ``cpu_matmul_kernel``). The
hardware figures (a 128 MiB sum, a 2048^3 float32 matmul) are the best seen in the whole run,
probed at the start and again between the decode steps, and the step time is the best repetition:
a probe slowed by machine load (the bench machines are shared) cannot lengthen the ideal step and
so inflate the fraction.

Floor: the same decode (same shapes, slots and context) as a plain-JAX dense decode loop
(``bench/decode_floor.py``: weights stacked and read once per step, layers in a ``lax.scan``, dense
KV cache, argmax, 16 steps per call; bfloat16 on accelerators, float32 on CPU): ``floor_step_ms``
and ``floor_ratio`` (our step over the floor's). On CPU also with the CPU kernels switched off
(``floor_ratio_kernels_off``: XLA's attention and matmuls, what an accelerator runs). On
accelerators, ``hbm_roofline_frac``: (weight bytes in the compute dtype + KV bytes read) / the
measured read bandwidth, over our step. ``--model`` picks the decode shape (random weights):
``smollm2-135m`` (default: 64 slots, context 128) or ``qwen2.5-1.5b`` (128 slots, context 512; an
accelerator's size). Off CPU the model computes in bfloat16 and the decode runs the engine's
per-platform steps per call.

``--peer vllm``: the same workloads, at the same slot count (vLLM ``max_num_seqs``), through vLLM on
this CPU (``areal_jax.vllm_rollout.VllmInProcessEngine``, float32, all cores), with the same weights
(written with ``save_hf``). vLLM runs in a subprocess under ``--vllm-python`` (default: this
interpreter if it has vLLM, else ``.venv-vllm/bin/python`` from ``make install-vllm``), one model at
a time, never concurrently with a JAX measurement. vLLM's CPU attention needs head_dim in {32, 64,
...}, so the tiny comparison uses the tiny config with head_dim 32 (rows ``tiny-hd32``, JAX re-run
on it). Adds top-level ``speedup_vs_vllm`` (JAX continuous tok/s over vLLM tok/s, SmolLM2-135M) and
``speedup_vs_vllm_tiny``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from areal_jax.kernels import choice, cpu_attention, cpu_matmul
from areal_jax.models import ModelConfig, Transformer, save_hf
from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler import launch_tuning, sampling
from areal_jax.sampler.service import JaxRolloutEngine
import decode_floor
from common import (QWEN25_1P5B, SMOLLM2, TINY, Hardware, decode_step_cost, finish, machine,
                    own_pages)

TINY_HD32 = dataclasses.replace(TINY, head_dim=32)  # vLLM's CPU attention needs head_dim >= 32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(cfg: ModelConfig) -> Transformer:
  return Transformer(cfg, nnx.Rngs(0))  # random weights: throughput does not depend on values


MEDIAN_NEW, SIGMA_NEW = 24, 1.0  # log-normal generation lengths
MAX_LEN = 256  # cache positions per slot (prompts are 8 to 24 tokens)


def workload(num_prompts, n, vocab, max_new, seed=0):
  """``n`` samples per prompt, each its own log-normal length, as ``n=1`` groups
  ``(prompt, [length])``; the samples of a prompt are adjacent and share the prompt list."""
  rng = np.random.default_rng(seed)
  groups = []
  for _ in range(num_prompts):
    prompt = rng.integers(1, vocab, size=int(rng.integers(8, 25))).tolist()
    lengths = np.exp(rng.normal(np.log(MEDIAN_NEW), SIGMA_NEW, size=n))
    groups += [(prompt, [int(m)]) for m in np.clip(np.round(lengths), 2, max_new)]
  return groups


def _requests(groups):
  for g, (prompt, lengths) in enumerate(groups):
    yield GroupRequest(g, prompt, n=len(lengths),
                       params=SamplingParams(temperature=1.0, max_new_tokens=lengths[0], seed=g))


def run_continuous(model, groups, slots, max_len, kv_buckets, steps):
  eng = JaxRolloutEngine(model, num_slots=slots, max_len=max_len, prefill_buckets=(32,),
                         kv_buckets=kv_buckets, eos_token_ids=(), steps_per_call=steps)
  eng.warmup()
  eng.stats.clear()
  reqs = list(_requests(groups))
  eng.start()
  t0 = time.perf_counter()
  for r in reqs:
    eng.submit(r)
  got, expected = [], sum(r.n for r in reqs)
  while len(got) < expected:
    got += eng.poll(timeout=1.0)
  wall = time.perf_counter() - t0
  eng.stop()
  assert all(s.finish_reason == "length" for s in got), {s.finish_reason for s in got}
  tokens = sum(len(s.tokens) for s in got)
  return {"engine": "continuous", "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
          "decode_calls": eng.stats["calls"], "slot_steps": eng.stats["slot_steps"],
          "moves": eng.stats["moves"], "prefills": eng.stats["prefills"],
          "prefix_hits": eng.stats["prefix_hits"]}


def run_static(model, groups, slots, max_len, kv_buckets, steps):
  eng = JaxRolloutEngine(model, num_slots=slots, max_len=max_len, prefill_buckets=(32,),
                         kv_buckets=kv_buckets, eos_token_ids=(), steps_per_call=steps,
                         kv_pages=0)  # a row per slot: this loop drives the engine itself
  dev = eng.engine
  steps = dev.config.steps_per_call
  state = dev.warmup(dev.init_state())
  t0, tokens, calls, prefills = time.perf_counter(), 0, 0, 0
  samples = [(p, m) for p, lengths in groups for m in lengths]
  for b in range(0, len(samples), slots):
    batch = samples[b:b + slots]
    for s, (prompt, m) in enumerate(batch):
      if s == 0 or prompt is not batch[s - 1][0]:  # one prefill per group
        prefix = dev.prefill(dev.params, prompt[:-1])
        prefills += 1
      state = dev.insert(state, prefix, [s], token=[prompt[-1]], pos=[len(prompt) - 1],
                         end=[len(prompt) + m], keys=np.asarray(sampling.slot_key(b + s, 0))[None],
                         temperature=1.0, top_k=0, top_p=1.0, greedy=False, stop_ids=[])
    longest = max(len(p) + m for p, m in batch)
    pos = min(len(p) for p, _ in batch) - 1
    done = 0
    while pos < longest - 1:  # the whole batch runs until its longest sequence ends
      state, (t, lp, valid) = dev.generate(dev.params, state, dev.kv_bucket(longest - 1))
      done += int(np.asarray(valid).sum())
      pos += steps
      calls += 1
    tokens += done
  wall = time.perf_counter() - t0
  assert tokens == sum(m for _, m in samples), (tokens, sum(m for _, m in samples))
  return {"engine": "static", "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
          "decode_calls": calls, "slot_steps": calls * slots * steps, "prefills": prefills}


def roofline(model, cfg, slots, context, hw: Hardware, steps=0, reps=3, page_size=64):
  """Steady decode of ``slots`` slots at ``context`` positions: measured vs ideal step time, the
  hardware probed between the steps (``hw`` keeps the best figures seen). ``steps`` per call, 0:
  the engine's choice for the platform; ``page_size``: positions a page where the cache is paged
  (``rollout.page_size``)."""
  steps = steps or choice.steps_per_call(choice.platform_of(None))
  # the read bound: the positions these calls reach (the dense path reads all of it, as the floor)
  kv_len = context + steps * (reps + 1) + 1
  eng = JaxRolloutEngine(model, num_slots=slots, max_len=context + 16 * steps * (reps + 2),
                         prefill_buckets=(16,), kv_buckets=(kv_len,), eos_token_ids=(),
                         steps_per_call=steps, page_size=page_size)
  dev = eng.engine
  pages = own_pages(dev)  # a paged cache (the platform's choice): each slot its own pages
  # the kernel launch a run would keep (timed on this device where there is a choice: a GPU)
  state, tuned = launch_tuning.tune(dev, dev.init_state(), position=context)
  keys = np.stack([np.asarray(sampling.slot_key(0, i)) for i in range(slots)])
  state = dev.insert(state, None, list(range(slots)), token=[1] * slots, pos=[context] * slots,
                     end=[context + 16 * steps * (reps + 2)] * slots, keys=keys, temperature=1.0, top_k=0,
                     top_p=1.0, greedy=False, stop_ids=[], **pages)
  state, out = dev.generate(dev.params, state, kv_len, **pages)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    hw.probe()
    t0 = time.perf_counter()
    state, out = dev.generate(dev.params, state, kv_len, **pages)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / steps)
  hw.probe()
  step_s = min(times)
  figures = hw.figures()
  bytes_step, flops_step = decode_step_cost(cfg, slots, context)
  t_mem = bytes_step / (figures["read_GBps"] * 1e9)
  t_flop = flops_step / (figures["matmul_GFLOPps"] * 1e9)
  ideal = max(t_mem, t_flop)
  return {"slots": slots, "context": context, "step_ms": step_s * 1e3, "tok_per_s": slots / step_s,
          "ideal_step_ms": ideal * 1e3, "bound": "compute" if t_flop > t_mem else "memory",
          "bytes_per_step_MB": bytes_step / 1e6, "gflop_per_step": flops_step / 1e9,
          "roofline_frac": ideal / step_s, "roofline_tok_per_s": slots / ideal,
          "hbm_roofline_frac": t_mem / step_s, "steps_per_call": steps,
          "decode_attention": dev.attention_impl, "decode_matmul": dev.decode_matmul,
          "decode_layers": dev.layers_impl, "decode_projections": dev.projections,
          "cache_layout": dev.cache_layout, "kv_pages": dev.config.kv_pages,
          "page_size": dev.config.page_size if dev.paged else None, "launch": dev.launch.name,
          "launch_step_ms": tuned and tuned["step_ms"],
          "launch_compile_s": tuned and tuned["compile_s"],
          "launch_failed": tuned and tuned["failed"],
          "hardware": figures, "step_ms_all": [t * 1e3 for t in times]}


def launch_line(r: dict) -> str:
  """The launch a roofline row's engine kept, each one's step and first call (its compile)."""
  return (f"{'':>13} launch kept: {r['launch']} (timed, ms a step: "
          + ", ".join(f"{k} {v:.3f}" for k, v in r["launch_step_ms"].items())
          + "; first call, compile included, s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in (r.get("launch_compile_s") or {}).items()) + ")"
          + "".join(f"; not used: {k}: {v}" for k, v in (r.get("launch_failed") or {}).items()))


DECODE_SHAPES = {"smollm2-135m": (SMOLLM2, 64, 128), "qwen2.5-1.5b": (QWEN25_1P5B, 128, 512)}


def decode_rows(name, quick, probe, page_size=64):
  """Our decode step against the roofline and the floor loop, for the ``--model`` shape (a paged
  cache in pages of ``page_size`` positions)."""
  cfg, slots, context = DECODE_SHAPES[name]
  on_cpu = jax.default_backend() == "cpu"
  if name == "smollm2-135m" and quick:
    context = 64
  cfg = dataclasses.replace(cfg, dtype="float32" if on_cpu else "bfloat16")
  reps = 3 if quick else 5
  row = functools.partial(roofline, make_model(cfg), cfg, slots, context, probe, reps=reps,
                          page_size=page_size)  # the same decode, each row under its kernels
  out = {"roof": row()}
  if on_cpu:
    with cpu_attention.disabled():  # the same decode with XLA's attention instead of the CPU kernel
      out["roof_xla"] = row()
    with cpu_matmul.disabled():  # ... and with XLA's matmuls instead of the packed-weight kernel
      out["roof_xla_mm"] = row()
    with cpu_attention.disabled(), cpu_matmul.disabled():  # both: the accelerators' XLA path
      out["roof_off"] = row()
  # the floor's program gets the GEMMs our engine's programs get (compiler options, per program)
  matmul = out["roof"]["decode_matmul"]
  floor = decode_floor.step_ms(cfg, slots, context, cfg.compute_dtype, reps=reps,
                               compiler_options=choice.compiler_options(matmul))
  for r in out.values():
    r.update(floor_step_ms=floor, floor_ratio=r["step_ms"] / floor, floor_matmul=matmul)
  return out


def vllm_python(arg: str | None) -> str:
  if arg:
    return arg
  if importlib.util.find_spec("vllm") is not None:
    return sys.executable
  candidate = os.path.join(ROOT, ".venv-vllm", "bin", "python")
  if not os.path.exists(candidate):
    raise SystemExit("--peer vllm needs vLLM: run `make install-vllm` (creates .venv-vllm) or pass "
                     "--vllm-python")
  return candidate


def run_vllm(python, model, groups, slots, max_len):
  """The same workload through vLLM in a subprocess (see bench/vllm_peer.py)."""
  with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
    model_dir = save_hf(model, None, os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "workload.json"), "w") as f:
      json.dump(groups, f)
    out = os.path.join(tmp, "row.json")
    cmd = [python, os.path.join(ROOT, "bench", "vllm_peer.py"), "--model-dir", model_dir,
           "--workload", os.path.join(tmp, "workload.json"), "--slots", str(slots),
           "--max-len", str(max_len), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      raise SystemExit(f"vLLM peer failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out) as f:
      return json.load(f)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="reduced run (under two minutes)")
  ap.add_argument("--json", default=None, help="write results to this path")
  ap.add_argument("--peer", choices=["vllm"], default=None,
                  help="also run the same workloads through this peer engine")
  ap.add_argument("--vllm-python", default=None, help="interpreter with vLLM (for --peer vllm)")
  ap.add_argument("--model", choices=sorted(DECODE_SHAPES), default="smollm2-135m",
                  help="shape of the decode roofline and floor measurement (random weights)")
  ap.add_argument("--decode-only", action="store_true",
                  help="only the decode rows (roofline, floor): no continuous / static workloads")
  ap.add_argument("--page-size", type=int, default=64,
                  help="positions a page of the decode rows' paged cache (rollout.page_size), "
                       "where the platform pages it")
  args = ap.parse_args()
  if args.decode_only and args.peer:
    ap.error("--peer compares the workloads, which --decode-only skips")
  peer_python = vllm_python(args.vllm_python) if args.peer == "vllm" else None
  quick = args.quick
  t_start = time.perf_counter()
  info, probe = machine(), Hardware().probe(3)
  hw = probe.figures()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']} ({info['devices']}); "
        f"read {hw['read_GBps']:.1f} GB/s, matmul {hw['matmul_GFLOPps']:.0f} GFLOP/s "
        f"({hw['matmul_dtype']})")
  rows, on_cpu = [], jax.default_backend() == "cpu"
  plans = [  # model, config, slots, prompts, samples per prompt, max_new, kv buckets, steps/call
      ("tiny", TINY, 16, 32 if quick else 128, 4, 200, None, 8),
      ("smollm2-135m", SMOLLM2, 16 if quick else 64, 16 if quick else 96, 4, 96 if quick else 200,
       None, 1),
  ]
  if not on_cpu:  # accelerators: bfloat16 compute, the engine's steps per call
    plans = [(n, dataclasses.replace(c, dtype="bfloat16"), *rest[:-1], 0) for n, c, *rest in plans]
  if args.decode_only:
    plans = []
  for name, cfg, slots, num_groups, n, max_new, kv_buckets, steps in plans:
    model = make_model(cfg)
    groups = workload(num_groups, n, cfg.vocab_size, max_new)
    for runner in (run_continuous, run_static):
      r = runner(model, groups, slots, MAX_LEN, kv_buckets, steps)
      r.update(model=name, slots=slots, sequences=num_groups * n, steps_per_call=steps, workload=
               f"{num_groups} prompts x {n} samples, n=1 requests, log-normal length per sample "
               f"(median {MEDIAN_NEW}, sigma {SIGMA_NEW}, clipped to [2, {max_new}])")
      rows.append(r)
      print(f"{name:>13} {r['engine']:>10} slots={slots:<3} seqs={r['sequences']:<4} "
            f"tokens={r['tokens']:<6} wall={r['wall_s']:7.2f}s  {r['tok_per_s']:8.1f} tok/s")
  speed = {"tiny": None, "smollm2-135m": None}
  for name in ("tiny", "smollm2-135m") if plans else ():
    c = next(r for r in rows if r["model"] == name and r["engine"] == "continuous")
    s = next(r for r in rows if r["model"] == name and r["engine"] == "static")
    speed[name] = c["tok_per_s"] / s["tok_per_s"]
    print(f"{name:>13} speedup continuous / static: {speed[name]:.2f}x")
  dec = decode_rows(args.model, quick, probe, args.page_size)
  roof = dec["roof"]
  kernel, mm_kernel = cpu_attention.available() and on_cpu, cpu_matmul.available() and on_cpu
  labels = (("as shipped", "roof"), ("XLA attention", "roof_xla"), ("XLA matmuls", "roof_xla_mm"),
            ("CPU kernels off", "roof_off"))
  for label, r in ((label, dec[key]) for label, key in labels if key in dec):
    paged = f", pages of {r['page_size']}" if r.get("kv_pages") else ""
    print(f"{args.model:>13} decode at {r['slots']} slots, context {r['context']}, {label} "
          f"({r['decode_attention']} attention{paged}, "
          f"{r['decode_matmul']} matmuls, {r['steps_per_call']} steps/call): "
          f"{r['step_ms']:.2f} ms/step = {r['tok_per_s']:.0f} tok/s; ideal "
          f"{r['ideal_step_ms']:.2f} ms ({r['bound']}-bound: {r['gflop_per_step']:.1f} GFLOP, "
          f"{r['bytes_per_step_MB']:.0f} MB) -> {100 * r['roofline_frac']:.0f}% of roofline; "
          f"floor loop {r['floor_step_ms']:.2f} ms/step, ratio {r['floor_ratio']:.2f}"
          + ("" if on_cpu else f", {100 * r['hbm_roofline_frac']:.0f}% of the HBM roofline"))
    if r.get("launch_step_ms"):  # the kernel launches timed before it (launch_tuning)
      print(launch_line(r))
  roof_xla, roof_xla_mm = dec.get("roof_xla"), dec.get("roof_xla_mm")
  result = {"machine": info, "hardware": hw, "quick": quick,
            "speedup_vs_static": speed["smollm2-135m"], "speedup_vs_static_tiny": speed["tiny"],
            "roofline_frac": roof["roofline_frac"], "roofline": roof, "rows": rows,
            "cpu_attention_kernel": kernel, "roofline_xla_attention": roof_xla,
            "cpu_matmul_kernel": mm_kernel, "roofline_xla_matmul": roof_xla_mm,
            "decode_model": args.model, "floor_step_ms": roof["floor_step_ms"],
            "floor_ratio": roof["floor_ratio"],
            "load_avg": os.getloadavg(), "bench_s": time.perf_counter() - t_start}
  if on_cpu:
    result.update(roofline_kernels_off=dec["roof_off"],
                  floor_ratio_kernels_off=dec["roof_off"]["floor_ratio"])
  else:
    result["hbm_roofline_frac"] = roof["hbm_roofline_frac"]
  if args.peer == "vllm":
    vs = {}
    for name, cfg, slots, num_groups, n, max_new, kv_buckets, steps in plans:
      groups = workload(num_groups, n, cfg.vocab_size, max_new)
      label = name
      if cfg.head_dim < 32:  # same workload on a vLLM-compatible tiny model, both engines
        cfg, label = TINY_HD32, f"{name}-hd32"
      model = make_model(cfg)
      if label == name:
        ours = next(r for r in rows if r["model"] == name and r["engine"] == "continuous")
      else:
        ours = run_continuous(model, groups, slots, MAX_LEN, kv_buckets, steps)
        ours.update(model=label, slots=slots, sequences=num_groups * n)
        rows.append(ours)
      theirs = run_vllm(peer_python, model, groups, slots, MAX_LEN)
      theirs.update(model=label, slots=slots, sequences=num_groups * n)
      rows.append(theirs)
      vs[name] = ours["tok_per_s"] / theirs["tok_per_s"]
      for r in (ours, theirs):
        print(f"{label:>13} {r['engine']:>10} slots={slots:<3} seqs={r['sequences']:<4} "
              f"tokens={r['tokens']:<6} wall={r['wall_s']:7.2f}s  {r['tok_per_s']:8.1f} tok/s")
      print(f"{label:>13} speedup JAX continuous / vLLM {theirs['vllm']}: {vs[name]:.2f}x")
    result.update(speedup_vs_vllm=vs["smollm2-135m"], speedup_vs_vllm_tiny=vs["tiny"],
                  rows=rows)
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
