"""The vLLM side of ``bench/sampler.py --peer vllm`` (runs under the interpreter that has vLLM).

  .venv-vllm/bin/python bench/vllm_peer.py --model-dir DIR --workload W.json --slots 16 \
      --max-len 128 --out R.json

Loads the Hugging Face directory the main bench wrote (the same weights its JAX sampler used),
serves the same workload through ``VllmInProcessEngine`` (vLLM's in-process engine, max_num_seqs =
slots) and writes one result row. The workload JSON is a list of ``[prompt_ids, [length] * n]``
groups; every sequence runs to its drawn length (no EOS). Timing starts after a warm-up batch and
covers submit -> last sample polled, prefill included, like the JAX rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model-dir", required=True)
  ap.add_argument("--workload", required=True)
  ap.add_argument("--slots", type=int, required=True)
  ap.add_argument("--max-len", type=int, required=True)
  ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  from areal_jax.models import load_hf
  from areal_jax.rollout_api import GroupRequest, SamplingParams
  from areal_jax.vllm_rollout import VllmInProcessEngine

  with open(args.workload) as f:
    groups = json.load(f)
  model, _ = load_hf(args.model_dir)
  workdir = tempfile.mkdtemp(prefix="bench_vllm_")
  try:
    eng = VllmInProcessEngine(model, None, workdir=workdir, num_slots=args.slots,
                              max_model_len=args.max_len, num_threads=args.threads or None)
    del model
    eng.start()

    def serve(reqs):
      t0 = time.perf_counter()
      for r in reqs:
        eng.submit(r)
      got, expected = [], sum(r.n for r in reqs)
      while len(got) < expected:
        got += eng.poll(timeout=1.0)
      return got, time.perf_counter() - t0

    warm = [GroupRequest(10**6 + i, groups[i % len(groups)][0], n=2,
                         params=SamplingParams(max_new_tokens=8, seed=i)) for i in range(4)]
    serve(warm)
    reqs = [GroupRequest(g, prompt, n=len(lengths),
                         params=SamplingParams(temperature=1.0, max_new_tokens=lengths[0], seed=g))
            for g, (prompt, lengths) in enumerate(groups)]
    got, wall = serve(reqs)
    bad = {s.finish_reason for s in got} - {"length"}
    if bad:
      raise SystemExit(f"unexpected finish reasons {bad}: {[s.error for s in got if s.error][:3]}")
    tokens = sum(len(s.tokens) for s in got)
    import vllm
    row = {"engine": "vllm", "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
           "vllm": vllm.__version__, "startup_s": eng.stats["startup_s"],
           "threads": int(os.environ.get("OMP_NUM_THREADS", "0"))}
    eng.close()
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  with open(args.out, "w") as f:
    json.dump(row, f)


if __name__ == "__main__":
  main()
