"""What an environment call costs by the way it runs: in process, in a worker pool, over HTTP.

  python bench/env_calls.py [--steps 200] [--concurrency 1,16] [--json PATH]

``--concurrency`` episodes at once each play ``--steps`` steps of ``SyntheticEnv`` with no latency
of its own (``areal_jax/envs/synthetic.py``), so a step's wall time is the machinery's: the
thread hop (``inprocess``, 2 threads), the pipe round trip to a worker process (``pool``: 2
workers, enough places for every episode), or an HTTP request on loopback to the reference server
``python -m areal_jax.envs.serve`` started here (``remote``: its environments in process). Per
kind and concurrency: the step's p50 and p99 wall time and the steps per second of all episodes
together. One event loop drives every episode, as a run's does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from areal_jax.envs.base import InProcessEnvs
from areal_jax.envs.pool import EnvPool
from areal_jax.envs.remote import RemoteEnvs

SYNTHETIC = "areal_jax.envs.synthetic:SyntheticEnv"


async def episodes(envs, concurrency: int, steps: int) -> tuple[list[float], float]:
  async def one(times):
    env = envs.env()
    await env.acquire()
    await env.reset({})
    for _ in range(steps):
      t0 = time.perf_counter()
      await env.step("a")
      times.append(time.perf_counter() - t0)
    await env.close()

  times: list[float] = []
  await asyncio.gather(*(one(times) for _ in range(1)))  # warm: workers and connections up
  times.clear()
  t0 = time.perf_counter()
  await asyncio.gather(*(one(times) for _ in range(concurrency)))
  return times, time.perf_counter() - t0


def quantile(xs: list[float], q: float) -> float:
  return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


def server() -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen([sys.executable, "-m", "areal_jax.envs.serve", f"--env={SYNTHETIC}",
                           "--port=0", f'--args={{"turns": 1000000}}', "--threads=2"],
                          stderr=subprocess.PIPE, text=True)
  line = proc.stderr.readline()
  return proc, line.split(" on ")[1].strip()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--concurrency", default="1,16")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  levels = [int(c) for c in args.concurrency.split(",")]
  turns = {"turns": 10**6}
  rows, out = [], {"steps": args.steps, "p50_ms": {}, "p99_ms": {}, "steps_per_s": {}}
  proc, url = server()
  try:
    for kind in ("inprocess", "pool", "remote"):
      for c in levels:
        if kind == "inprocess":
          envs = InProcessEnvs(SYNTHETIC, turns, threads=2)
        elif kind == "pool":
          envs = EnvPool(SYNTHETIC, turns, workers=2, episodes_per_worker=max(1, (c + 1) // 2))
        else:
          envs = RemoteEnvs(url)

        async def measure():
          try:
            return await episodes(envs, c, args.steps)
          finally:
            if kind == "remote":
              await envs.aclose()
        times, wall = asyncio.run(measure())
        envs.close()
        p50, p99 = quantile(times, 0.5) * 1e3, quantile(times, 0.99) * 1e3
        rate = len(times) / wall
        for key, v in (("p50_ms", p50), ("p99_ms", p99), ("steps_per_s", rate)):
          out[key].setdefault(kind, {})[str(c)] = round(v, 3)
        rows.append(f"| {kind} | {c} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")
  finally:
    proc.terminate()
    proc.wait(30)
  print("| kind | episodes at once | step p50 ms | step p99 ms | steps/s |")
  print("| --- | --- | --- | --- | --- |")
  print("\n".join(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
