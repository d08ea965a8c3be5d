"""Learner throughput: trained tokens/s, model-FLOPs utilization, and packing efficiency.

  python bench/learner.py [--quick] [--json PATH]

Workload: GRPO batches with GSM8K-like lengths (prompt 60..200 tokens, completion log-normal with
median ~180, capped at 512), random tokens, random rewards and behaviour logprobs. One timed
``Learner.train_step`` = recompute the proximal logprobs (one forward) + ``ppo_n_minibatches``
updates over packed micro-batches. A first, untimed step compiles (for the 30-layer model on a
2-prompt batch of the same micro-batch shape); compilations in timed steps are counted
(``compiles_timed``) and their seconds taken out of the timed wall time (steady state: a shape
compiles once).
The full run trains SmolLM2-135M on 64 sequences a step (16 prompts x 4 samples), a small RL batch
(packing 32 sequences into rows of 768 leaves ~12% padding, 64 ~7%: see ``packing_efficiency``).

  tokens/s  = real (non-padding) tokens of the batch / train_step wall time
  mfu       = 6 x params x tokens / time / measured float32 matmul FLOP/s
  (with ppo_n_minibatches = 1 there is no separate proximal forward: the update's own forward
  provides the proximal logprobs; with more minibatches the extra forward is not credited).
The full run adds ``smollm2-135m-short``: the CPU demo's lengths (prompt ~80, answers 16-48
tokens, 32 sequences per step; JSON ``mfu_short``). Attention is causal-blocked over each packed
row (``transformer.causal_attention``), so long rows (GSM8K-like, 768) still spend uncredited time on
attention masked between segments; short rows hardly do.
``--quick`` uses SmolLM2-135M layer shapes with 6 of the 30 layers (the 30-layer compile alone
takes minutes on 2 cores) and a single timed step.

The matmul throughput is measured on the spot (best of several square float32 matmuls on the same
device), so MFU is relative to what this machine actually does, not a datasheet figure. Packing
efficiency = real tokens / (rows used x row length) over many GSM8K-like batches; the step's
padding efficiency also counts the padding rows that round micro-batches up to a bucketed shape.
Runs on one device (all cores); set XLA_FLAGS as you like, only ``jax.devices()[0]`` is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np
from flax import nnx
from jax._src import monitoring  # unregistering a listener is not public API

from areal_jax import config as config_lib
from areal_jax import sharding
from areal_jax.learner import Learner, packing
from areal_jax.models import ModelConfig, Transformer
from areal_jax.rollout_api import Sample
from common import SMOLLM2, TINY, Hardware, machine

def gsm8k_lengths(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
  prompt = rng.integers(60, 200, n)
  completion = np.minimum(rng.lognormal(np.log(180), 0.5, n).astype(int) + 1, 512)
  return prompt, completion


def short_lengths(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The CPU demo's lengths (configs/arithmetic.py): chat prompt ~80 tokens, one-sentence answers."""
  return rng.integers(70, 90, n), rng.integers(16, 49, n)


LENGTHS = {"gsm8k": gsm8k_lengths, "short": short_lengths}


def make_batch(rng, groups: int, n: int, vocab: int, lengths: str = "gsm8k"):
  prompts, completions = LENGTHS[lengths](rng, groups * n)
  out, rewards = [], []
  for g in range(groups):
    prompt = rng.integers(0, vocab, prompts[g * n]).tolist()
    samples = []
    for i in range(n):
      c = int(completions[g * n + i])
      samples.append(Sample(g, i, prompt, rng.integers(0, vocab, c).tolist(),
                            rng.normal(-3.0, 0.3, c).tolist(), [0] * c, "eos"))
    out.append(samples)
    rewards.append(rng.integers(0, 2, n).astype(float).tolist())
  return out, rewards


def packing_efficiency(batches: int, groups: int, n: int, row_len: int) -> float:
  rng = np.random.default_rng(1)
  real = slots = 0
  for _ in range(batches):
    prompts, completions = gsm8k_lengths(rng, groups * n)
    lengths = (prompts + completions).tolist()
    layout = packing.plan(lengths, 1, 1 << 30, min_row_len=row_len)
    real += sum(lengths)
    slots += layout.used_rows * layout.row_len
  return real / slots


def bench_model(name: str, cfg: ModelConfig, groups: int, n: int, steps: int, peak: float,
                micro_batch_tokens: int, max_seq_len: int = 768, lengths: str = "gsm8k",
                warmup_groups: int | None = None) -> dict:
  """``warmup_groups``: prompt groups of the untimed compile step (default ``groups``); fewer
  save minutes on big models when they give the same micro-batch shape (checked: a compilation in a
  timed step is counted and reported)."""
  opts = config_lib.base_config().actor
  opts.micro_batch_tokens = micro_batch_tokens
  mesh = sharding.make_mesh({}, jax.devices()[:1])
  model = Transformer(cfg, nnx.Rngs(0))
  learner = Learner(model, opts, mesh, temperature=1.0, max_seq_len=max_seq_len)
  del model
  rng = np.random.default_rng(0)
  t = time.perf_counter()
  learner.train_step(*make_batch(rng, warmup_groups or groups, n, cfg.vocab_size, lengths))  # compile
  compile_s = time.perf_counter() - t
  times, tokens, metrics, compiles = [], [], {}, []
  count = lambda event, duration, **_: compiles.append(duration) if "backend_compile" in event else None
  monitoring.register_event_duration_secs_listener(count)
  for _ in range(steps):
    groups_, rewards = make_batch(rng, groups, n, cfg.vocab_size, lengths)
    t = time.perf_counter()
    metrics = learner.train_step(groups_, rewards)
    jax.block_until_ready(learner.params())
    times.append(time.perf_counter() - t)
    tokens.append(metrics["tokens"])
  monitoring.unregister_event_duration_listener(count)
  if compiles:
    print(f"{name}: {len(compiles)} compilations ({sum(compiles):.1f} s) inside timed steps, "
          f"not counted")
  busy_s = sum(times) - sum(compiles)
  tok_s = sum(tokens) / busy_s
  p = learner.num_params
  return dict(model=name, lengths=lengths, params=p, sequences=groups * n, tokens_per_step=float(np.mean(tokens)),
              step_s=busy_s / len(times), compile_s=compile_s, tokens_per_s=tok_s,
              mfu=6 * p * tok_s / peak,
              padding_efficiency=metrics["padding_efficiency"],
              packing_efficiency=metrics["packing_efficiency"], row_len=metrics["row_len"],
              micro_rows=metrics["micro_rows"], micro_batches=metrics["micro_batches"],
              compiles_timed=len(compiles), compile_s_timed=float(sum(compiles)))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="reduced run (< 2 minutes)")
  ap.add_argument("--json", default=None, help="write results to this path")
  args = ap.parse_args()
  info, hw = machine(), Hardware()
  peak = hw.probe(5).figures()["matmul_GFLOPps"] * 1e9
  print(f"machine: {info['cpu']}, {info['cores']} cores, {info['devices']}, jax {info['jax']}, "
        f"load avg {info['load_avg']:.1f}")
  print(f"measured float32 matmul: {peak / 1e9:.1f} GFLOP/s")
  if args.quick:  # SmolLM2-135M layer shapes, 6 of its 30 layers (compiles in a fraction)
    smol = ("smollm2-135m-6L", dataclasses.replace(SMOLLM2, n_layers=6), 2, 2, 1, 1536)
    runs = [("tiny", TINY, 4, 4, 1, 8192), smol]
  else:
    runs = [("tiny", TINY, 16, 4, 3, 8192), ("smollm2-135m", SMOLLM2, 16, 4, 1, 1536, 768, "gsm8k", 2),
            ("smollm2-135m-short", SMOLLM2, 4, 8, 2, 2048, 176, "short")]
  rows = [bench_model(*r[:5], peak, *r[5:]) for r in runs]
  # The machine is shared: keep the best matmul figure seen (MFU is then conservative).
  peak = hw.probe(5).figures()["matmul_GFLOPps"] * 1e9
  for r in rows:
    r["mfu"] = 6 * r["params"] * r["tokens_per_s"] / peak
  pack = packing_efficiency(20 if args.quick else 100, 64, 4, 768)
  print(f"best measured float32 matmul: {peak / 1e9:.1f} GFLOP/s")
  print(f"\n{'model':<16}{'params':>12}{'tokens/step':>13}{'step s':>9}{'tokens/s':>11}{'MFU':>8}"
        f"{'pad eff':>9}{'compile s':>11}")
  for r in rows:
    print(f"{r['model']:<16}{r['params']:>12,}{r['tokens_per_step']:>13.0f}{r['step_s']:>9.2f}"
          f"{r['tokens_per_s']:>11.0f}{r['mfu']:>8.1%}"
          f"{r['padding_efficiency']:>9.1%}{r['compile_s']:>11.1f}")
  print(f"\npacking efficiency (GSM8K-like lengths, 64 x 4 sequences per batch, rows of 768): "
        f"{pack:.1%}")
  smol = next(r for r in rows if r["model"].startswith("smollm2"))
  short = next((r for r in rows if r["model"] == "smollm2-135m-short"), None)
  result = dict(machine=info, matmul_flops=peak, mfu=smol["mfu"], packing_efficiency=pack,
                mfu_short=short["mfu"] if short else None,
                quick=args.quick, models=rows)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
