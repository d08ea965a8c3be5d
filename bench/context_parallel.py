"""The learner's context parallelism on this machine's CPU devices: one minibatch's gradient with
each row's positions split over ``context`` devices, by each form of attention across them
(``ulysses``, ``ring``: kernels/context_attention.py), against the same gradient on one device.

  python bench/context_parallel.py [--row 1024] [--contexts 2,4] [--reps 3] [--json PATH]

For each layout: the first call's seconds (compilation and run), the best of ``--reps`` later
calls (host packing included), and the largest absolute difference of the loss and of any gradient
element from the one-device step's (float32). Fake CPU devices share the host's cores, so the
times show what the layouts cost in work and collectives on a CPU, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import TINY, finish, machine  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax import sharding  # noqa: E402
from areal_jax.learner import Learner  # noqa: E402
from areal_jax.models import Transformer  # noqa: E402
from areal_jax.rollout_api import Sample  # noqa: E402


def make_batch(row: int, seed: int = 0):
  """4 groups of 4 samples whose lengths (a quarter to a half of a row) pack 2 or 3 to a row, so
  sequences cross the blocks' boundaries."""
  rng = np.random.default_rng(seed)
  groups, rewards = [], []
  for g in range(4):
    prompt = rng.integers(0, TINY.vocab_size, row // 16).tolist()
    samples = []
    for i in range(4):
      toks = rng.integers(0, TINY.vocab_size, int(rng.integers(row // 4, row // 2))).tolist()
      samples.append(Sample(g, i, prompt, toks, rng.normal(-6.0, 0.3, len(toks)).tolist(),
                            [0] * len(toks), "eos"))
    groups.append(samples)
    rewards.append(rng.integers(0, 2, 4).astype(float).tolist())
  return groups, rewards


def run(axes: dict, impl: str, row: int, batch, reps: int):
  opts = config_lib.base_config().actor
  opts.micro_batch_tokens = 1 << 20
  opts.context_attention = impl
  n = int(np.prod(list(axes.values()))) if axes else 1
  mesh = sharding.make_mesh(axes, jax.devices()[:n])
  learner = Learner(Transformer(TINY, nnx.Rngs(0)), opts, mesh, max_seq_len=row)
  t = time.perf_counter()
  grads, metrics = learner.gradients(*batch)
  first = time.perf_counter() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(learner.gradients(*batch)[0])
    times.append(time.perf_counter() - t)
  return jax.device_get(grads), metrics, first, min(times)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--row", type=int, default=1024, help="row length (positions)")
  ap.add_argument("--contexts", default="2,4", help="context axis sizes, comma-separated")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  t_start = time.perf_counter()
  batch = make_batch(args.row)
  ref_grads, ref_m, first, best = run({}, "auto", args.row, batch, args.reps)
  rows = [dict(layout="1 device", impl="-", first_s=first, step_s=best, max_grad_diff=0.0,
               loss_diff=0.0)]
  for c in (int(x) for x in args.contexts.split(",")):
    for impl in ("ulysses", "ring"):
      g, m, first, best = run({"context": c}, impl, args.row, batch, args.reps)
      diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                 for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)))
      rows.append(dict(layout=f"context={c}", impl=impl, first_s=first, step_s=best,
                       max_grad_diff=diff, loss_diff=abs(m["loss"] - ref_m["loss"])))
  print(f"rows of {args.row} positions, {TINY.n_heads} heads; gradient of one minibatch "
        f"(loss {ref_m['loss']:.6f})")
  print(f"{'layout':<12}{'impl':<9}{'first s':>9}{'step s':>9}{'max |dgrad|':>13}{'|dloss|':>10}")
  for r in rows:
    print(f"{r['layout']:<12}{r['impl']:<9}{r['first_s']:>9.2f}{r['step_s']:>9.3f}"
          f"{r['max_grad_diff']:>13.2e}{r['loss_diff']:>10.2e}")
  finish(dict(machine=machine(), row=args.row, model="tiny", rows=rows), args.json, t_start)


if __name__ == "__main__":
  main()
