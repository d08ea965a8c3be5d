"""How long the server takes to refuse what it must not work on: a body over ``serve.max_body_bytes``,
a prompt far over the context length, JSON nested too deeply, a request without a valid API key.

  python bench/serve_limits.py [--json PATH] [--reps N] [--big-mb MB] [--model tiny|smollm2]

The server (``areal_jax.serve``, configs/serve_arithmetic.py; ``--model tiny`` (the default): its
``:tiny`` preset, the random tiny model and its byte-level tokenizer) runs in this process on a
loopback port with one API key, serving only (no judge, no trainer). Each case is sent ``--reps``
times over a fresh ``http.client`` connection; per case the status it got and the seconds from
sending the request to the whole response read (``refuse_s``: median and max). Cases:
  * ``big_body``: a chat body of ``--big-mb`` MB (default 20), one user message of "7 + 1? "
    repeated (413 unread by its Content-Length);
  * ``long_prompt``: the same message at 1,000,000 bytes, under the body limit (1 MiB) and far
    over ``rollout.max_prompt_len`` (400 ``context_length_exceeded``);
  * ``nested``: 100,000 nested brackets (400);
  * ``bad_key``: a short valid request with a wrong key (401);
  * ``short``: a valid request of 1 completion token, for scale.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from common import finish, machine  # noqa: E402

from areal_jax import config as config_lib  # noqa: E402
from areal_jax.serve.runtime import ServeRuntime  # noqa: E402

KEY = "sk-bench-serve-limits"


def _send(port: int, body: bytes, key: str) -> tuple[int, float]:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  t0 = time.perf_counter()
  try:
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    resp.read()
    return resp.status, time.perf_counter() - t0
  finally:
    conn.close()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", default=None, help="write the result here")
  p.add_argument("--reps", type=int, default=3, help="requests per case")
  p.add_argument("--big-mb", type=float, default=20.0, help="size of the big_body case, in MB")
  p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
  args = p.parse_args()
  t_start = time.perf_counter()
  workdir = tempfile.mkdtemp(prefix="serve_limits_")
  with open(os.path.join(workdir, "keys.txt"), "w", encoding="utf-8") as f:
    f.write(KEY + "\n")
  config = config_lib.load("configs/serve_arithmetic.py" + (":tiny" if args.model == "tiny" else ""))
  config.unlock()
  config.serve.port, config.serve.train, config.serve.judge = 0, False, "none"
  config.serve.trainer_process, config.serve.warmup, config.serve.status_every_s = False, False, 0.0
  config.serve.api_keys = f"file:{os.path.join(workdir, 'keys.txt')}"
  config.lock()

  def chat(content: str, **extra) -> bytes:
    return json.dumps({"model": config.serve.model_name,
                       "messages": [{"role": "user", "content": content}], **extra}).encode()

  unit = "7 + 1? "
  cases = {
      "big_body": (chat(unit * int(args.big_mb * 1e6 / len(unit))), KEY),
      "long_prompt": (chat(unit * (1_000_000 // len(unit))), KEY),
      "nested": (b"[" * 100_000 + b"]" * 100_000, KEY),
      "bad_key": (chat("What is 2 + 3?", max_tokens=1), "sk-wrong"),
      "short": (chat("What is 2 + 3?", max_tokens=1), KEY),
  }
  rt = ServeRuntime(config, workdir)
  rt.start()
  result = {"machine": machine(), "model": args.model, "reps": args.reps,
            "max_body_bytes": config.serve.max_body_bytes,
            "max_prompt_len": config.rollout.max_prompt_len, "cases": {}}
  try:
    _send(rt.port, cases["short"][0], KEY)  # (the first request's compilation, not timed)
    for name, (body, key) in cases.items():
      runs = [_send(rt.port, body, key) for _ in range(args.reps)]
      times = [t for _, t in runs]
      result["cases"][name] = {"bytes": len(body), "status": sorted({s for s, _ in runs}),
                               "refuse_s_median": statistics.median(times),
                               "refuse_s_max": max(times)}
  finally:
    rt.stop()
  m = result["machine"]
  print(f"serve limits, {args.model} model, {m['cpu']} ({m['cores']} cores), {args.reps} reps")
  print(f"{'case':<12} {'bytes':>11} {'status':>8} {'median s':>9} {'max s':>9}")
  for name, c in result["cases"].items():
    print(f"{name:<12} {c['bytes']:>11} {','.join(map(str, c['status'])):>8} "
          f"{c['refuse_s_median']:>9.3f} {c['refuse_s_max']:>9.3f}")
  finish(result, args.json, t_start)


if __name__ == "__main__":
  main()
