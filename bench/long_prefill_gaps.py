"""``bench/long_prefill.py --gaps``: the longest wait of running sequences' decode steps while a
long prompt is admitted, its prefill chunked (``rollout.prefill_chunk``) or in one call; see
that script's docstring."""

from __future__ import annotations

import statistics
import time

import numpy as np

from common import finish, machine

MODEL = dict(arch="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=1, n_kv_heads=1,
             head_dim=64, d_ff=128)
SHORT = 8  # the running sequences' prompt tokens
WARM = 16  # decode steps each running sequence takes before the long prompt comes


def _wait(cond, what: str, timeout: float = 600.0) -> None:
  deadline = time.time() + timeout
  while not cond():
    if time.time() > deadline:
      raise TimeoutError(f"no {what} in {timeout:.0f} s")
    time.sleep(0.002)


def one_prompt(engine, events, gid: int, rng, args) -> dict:
  """Starts ``args.running`` sequences, submits a new long prompt once they decode, and returns
  the longest gap between two decode steps of the first running one (from the submission to the
  long prompt's first token), its steady step before, and the long prompt's time to its first
  token (seconds)."""
  from areal_jax.rollout_api import GroupRequest, SamplingParams  # noqa: PLC0415

  running = [gid + 1 + i for i in range(args.running)]
  for i, g in enumerate(running):
    engine.submit(GroupRequest(g, [int(t) for t in rng.integers(1, 512, SHORT)], 1,
                               SamplingParams(temperature=1.0, seed=g,
                                              max_new_tokens=engine.max_len - SHORT)))
  _wait(lambda: all(len(events.get(g, ())) >= WARM for g in running), "running decode steps")
  t0 = time.perf_counter()
  engine.submit(GroupRequest(gid, [int(t) for t in rng.integers(1, 512, args.prompt)], 1,
                             SamplingParams(greedy=True, max_new_tokens=2)))
  _wait(lambda: gid in events, "first token of the long prompt")
  first = events[gid][0]
  steps = events[running[0]]
  _wait(lambda: len(steps) and steps[-1] > first + 0.05, "decode steps after it")
  for g in running:
    engine.abort(g)
  samples = []
  _wait(lambda: samples.extend(engine.poll(timeout=0.1)) or len(samples) == args.running + 1,
        "the samples")
  assert all(s.finish_reason in ("abort", "length") for s in samples), samples
  t = np.asarray(steps)
  before, gaps = np.diff(t[t < t0]), np.diff(t)
  window = (t[1:] > t0) & (t[:-1] < first)  # gaps overlapping [submission, first token]
  return dict(longest_gap_s=float(gaps[window].max()), steady_step_s=float(np.median(before)),
              first_token_s=first - t0)


def run(args) -> None:
  from flax import nnx  # noqa: PLC0415

  from areal_jax.models import ModelConfig, Transformer  # noqa: PLC0415
  from areal_jax.sampler.service import JaxRolloutEngine  # noqa: PLC0415

  t_start = time.perf_counter()
  model = Transformer(ModelConfig(**MODEL), nnx.Rngs(0))
  max_len = args.prompt + 128
  chunks = [int(c) for c in args.chunks.split(",")]
  rows = []
  print(f"{args.running} sequences decoding, a {args.prompt}-token prompt admitted; model "
        f"{MODEL}; CPU, {machine()['cores']} cores", flush=True)
  for chunk in chunks:
    events: dict[int, list[float]] = {}
    engine = JaxRolloutEngine(model, num_slots=8, max_len=max_len,
                              prefill_buckets=(SHORT, args.prompt), prefill_chunk=chunk,
                              eos_token_ids=())
    engine.set_token_listener(
        lambda g, i, tokens: events.setdefault(g, []).extend([time.perf_counter()] * len(tokens)))
    engine.start()
    rng = np.random.default_rng(chunk)
    reps = []
    try:
      for rep in range(args.reps + 1):  # (the first compiles the long prompt's programs)
        t = time.perf_counter()
        got = one_prompt(engine, events, 1000 * (rep + 1), rng, args)
        print(f"  prefill_chunk {chunk:>5} {'(compiling)' if not rep else f'rep {rep}':>11}: "
              f"longest gap {1e3 * got['longest_gap_s']:8.1f} ms, steady step "
              f"{1e3 * got['steady_step_s']:5.1f} ms, first token {got['first_token_s']:6.2f} s "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        if rep:
          reps.append(got)
    finally:
      engine.stop()
    rows.append(dict(prefill_chunk=chunk, chunks_per_prompt=engine.stats["prefill_chunks"] //
                     (args.reps + 1), reps=reps,
                     **{k: statistics.median(r[k] for r in reps) for k in reps[0]}))
  base = rows[0]
  print(f"{'prefill_chunk':>14}{'longest gap ms':>16}{'x base':>8}{'step ms':>9}"
        f"{'first token s':>15}{'x base':>8}")
  for r in rows:
    r["gap_vs_base"] = r["longest_gap_s"] / base["longest_gap_s"]
    r["first_token_vs_base"] = r["first_token_s"] / base["first_token_s"]
    print(f"{r['prefill_chunk']:>14}{1e3 * r['longest_gap_s']:>16.1f}{r['gap_vs_base']:>8.3f}"
          f"{1e3 * r['steady_step_s']:>9.1f}{r['first_token_s']:>15.2f}"
          f"{r['first_token_vs_base']:>8.2f}")
  finish(dict(machine=machine(), model=MODEL, prompt=args.prompt, running=args.running,
              max_len=max_len, reps=args.reps, rows=rows), args.json, t_start)
