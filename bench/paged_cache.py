"""Paged KV cache vs a cache row per slot, at the same KV memory: rollout throughput on a
long-tailed, reasoning-style workload.

  python bench/paged_cache.py [--quick] [--json PATH]

Workload: ``groups`` prompts of 32 tokens x 4 samples (one GRPO group each), every group's length
drawn long-tailed (log-normal, median 48 new tokens, clipped to the cache; EOS off, so a sequence
runs to its length). A row cache must give every slot ``max_len`` positions, so its KV memory caps
the slots at ``rows``; a paged cache of the same positions (``rows x max_len / page_size`` pages)
gives them out as sequences grow (a group's prompt pages shared), so it runs ``4 x rows`` slots,
preempting (and later re-prefilling) the sequences admitted last when the pool runs out.

Rows (same model, weights, layers in a scan, XLA matmuls and the dense attention read: the
accelerator path, run on this backend):
  * ``rows``: ``rows`` slots, a row each (KV memory M);
  * ``paged``: ``4 x rows`` slots over a pool of M (pages gathered for the dense read);
  * ``rows_4x``: ``4 x rows`` slots, a row each (KV memory 4 M): what the paged engine's slots
    would cost without paging;
  * ``paged_half``: ``4 x rows`` slots over a pool of M / 2: memory pressure, so sequences are
    preempted and re-prefilled (what that costs);
  * ``planned``: what the sampler's memory plan (``sampler.memory.fit``) builds when asked for
    ``4 x rows`` slots of a paged cache whose pool follows the slots (``kv_pages=-1``, the GPU's
    choice, forced here) within the memory of that cache at ``rows`` slots: it keeps the slots
    over the pages that fit (rather than lowering the slots to about ``rows``).
Tokens/s counts generated tokens over wall time, prefill included; ``kv_positions`` is the KV
memory in positions (x 2 x layers x kv heads x head dim x 4 bytes); ``preempted`` counts paged
preemptions. SmolLM2-135M shape, random weights, float32.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

from areal_jax.rollout_api import GroupRequest, SamplingParams
from areal_jax.sampler.service import JaxRolloutEngine
import sampler as sampler_bench
from common import SMOLLM2, TINY, finish, machine

PROMPT, N, MEDIAN_NEW, SIGMA_NEW, PAGE = 32, 4, 48, 1.0, 64


def workload(groups: int, vocab: int, max_new: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(groups):
    length = float(np.exp(rng.normal(np.log(MEDIAN_NEW), SIGMA_NEW)))
    out.append((rng.integers(1, vocab, size=PROMPT).tolist(), int(np.clip(round(length), 4,
                                                                             max_new))))
  return out


def engine(model, slots, max_len, kv_pages=0):
  return JaxRolloutEngine(model, num_slots=slots, max_len=max_len, prefill_buckets=(PROMPT,),
                          eos_token_ids=(), decode_layers="scan", decode_matmul="xla",
                          decode_attention="dense", kv_pages=kv_pages, page_size=PAGE)


def planned(model, slots, max_len, budget_bytes):
  """The engine ``sampler.memory.fit`` settles on for ``slots`` slots of a paged cache whose pool
  follows them (kv_pages -1, the GPU's choice, forced here) within ``budget_bytes``."""
  from areal_jax.kernels import choice
  from areal_jax.sampler import memory
  os.environ[choice.PAGED_ENV] = "1"
  try:
    return memory.fit(lambda n, kv_pages=-1: engine(model, n, max_len, kv_pages), slots,
                      min_slots=N, budget_bytes=budget_bytes)
  finally:
    os.environ.pop(choice.PAGED_ENV)


def run(model, work, slots, max_len, kv_pages=0, eng=None):
  eng = eng or engine(model, slots, max_len, kv_pages)
  slots, kv_pages = eng.num_slots, eng.engine.config.kv_pages
  eng.warmup()
  eng.stats.clear()
  eng.start()
  t0 = time.perf_counter()
  for g, (prompt, length) in enumerate(work):
    eng.submit(GroupRequest(g, prompt, n=N, params=SamplingParams(
        temperature=1.0, max_new_tokens=length, seed=g)))
  got = []
  while len(got) < N * len(work):
    got += eng.poll(timeout=1.0)
  wall = time.perf_counter() - t0
  eng.stop()
  assert all(s.finish_reason == "length" for s in got), {s.finish_reason for s in got}
  tokens = sum(len(s.tokens) for s in got)
  return {"slots": slots, "kv_positions": kv_pages * PAGE if kv_pages else slots * max_len,
          "tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
          "decode_calls": eng.stats["calls"], "preempted": eng.stats["preempted"],
          "prefills": eng.stats["prefills"]}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny model, few groups (a smoke run)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  t_start = time.perf_counter()
  cfg = TINY if args.quick else SMOLLM2
  rows, max_len, groups = (4, 128, 8) if args.quick else (16, 512, 24)
  model = sampler_bench.make_model(dataclasses.replace(cfg, dtype="float32"))
  work = workload(groups, cfg.vocab_size, max_len - PROMPT)
  result = {"machine": machine(), "model": "tiny" if args.quick else "smollm2-135m",
            "groups": groups, "samples": groups * N, "max_len": max_len, "page_size": PAGE,
            "new_tokens": sum(length for _, length in work) * N, "rows": {}}
  cases = {"rows": (rows, 0), "paged": (4 * rows, rows * max_len // PAGE),
           "rows_4x": (4 * rows, 0), "paged_half": (4 * rows, rows * max_len // PAGE // 2)}
  print(f"{'engine':>8} {'slots':>6} {'KV positions':>13} {'tok/s':>8} {'wall s':>7} "
        f"{'calls':>6} {'preempted':>9}")
  for name, (slots, kv_pages) in cases.items():
    r = result["rows"][name] = run(model, work, slots, max_len, kv_pages)
    print(f"{name:>8} {slots:>6} {r['kv_positions']:>13} {r['tok_per_s']:>8} {r['wall_s']:>7} "
          f"{r['decode_calls']:>6} {r['preempted']:>9}", flush=True)
  # the memory plan's choice within the KV memory of ``rows`` rows: the budget of a cache whose
  # pool follows ``rows`` slots (a page for each of their positions and one more each), asked
  # for 4 x rows slots (it keeps them over the pool rather than lowering the slots)
  from areal_jax.sampler import memory
  budget = memory.plan(planned(model, rows, max_len, None)[0].engine, None).peak_bytes
  holder, plan = planned(model, 4 * rows, max_len, budget)
  result["planned"] = {"budget_bytes": budget, "slots": plan.num_slots, "kv_pages": plan.kv_pages}
  r = result["rows"]["planned"] = run(model, work, 0, max_len, eng=holder)
  print(f"{'planned':>8} {plan.num_slots:>6} {r['kv_positions']:>13} {r['tok_per_s']:>8} "
        f"{r['wall_s']:>7} {r['decode_calls']:>6} {r['preempted']:>9}", flush=True)
  rr = result["rows"]
  result["planned_over_rows"] = round(rr["planned"]["tok_per_s"] / rr["rows"]["tok_per_s"], 2)
  result["paged_over_rows"] = round(rr["paged"]["tok_per_s"] / rr["rows"]["tok_per_s"], 2)
  result["paged_over_rows_4x"] = round(rr["paged"]["tok_per_s"] / rr["rows_4x"]["tok_per_s"], 2)
  result["paged_half_over_rows"] = round(rr["paged_half"]["tok_per_s"] / rr["rows"]["tok_per_s"],
                                         2)
  print(f"paged / rows at the same KV memory: {result['paged_over_rows']}x; paged / rows with 4x "
        f"the memory: {result['paged_over_rows_4x']}x; paged with half the memory / rows: "
        f"{result['paged_half_over_rows']}x; the memory plan's choice within a budget of "
        f"{rows} rows (+ a page each) / rows: {result['planned_over_rows']}x")
  finish(result, args.json, t_start)


if __name__ == "__main__":
  sys.exit(main())
