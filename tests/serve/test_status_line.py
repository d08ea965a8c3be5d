"""What serving prints: a status line per window (the server's numbers, the same as /health's
``serving`` field) and, in the serve demo, no line per HTTP request."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from areal_jax.serve import status

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_status_line_counts_windows_and_totals():
  counters = dict(version=0, requests=0, tokens=0, train_steps=None,
                  turns={"turns": 0})
  now = [100.0]
  lines = []
  st = status.ServeStatus(lambda: dict(counters), every_s=0, clock=lambda: now[0], out=lines.append)
  st.start()  # every_s=0: no thread, lines only on tick
  counters.update(requests=12, tokens=600, version=2, train_steps=3,
                  turns={"turns": 10, "judge_status.judged": 6, "judge_status.pending": 4,
                         "train_status.trained": 4, "train_status.stale": 1})
  now[0] += 10.0
  first = st.numbers()  # before the first line: the time since the start
  assert first["window_s"] == 10.0 and first["tokens_per_s"] == 60.0
  assert st.tick() == ("status: serving version 2; 12 requests, 60 tokens/s over the last 10 s; "
                       "turns 10 recorded, 6 judged, 4 trained, 1 stale; 3 train steps")
  counters.update(requests=15, tokens=900)
  now[0] += 30.0
  st.tick()
  n = st.numbers()
  assert (n["window_requests"], n["tokens_per_s"], n["window_s"]) == (3, 10.0, 30.0)
  assert (n["requests"], n["tokens"], n["turns_recorded"]) == (15, 900, 10)
  assert len(lines) == 2 and status.describe(n) in lines[-1]
  counters.update(train_steps=None)
  assert "train steps" not in status.describe(st.numbers())  # serving only (serve.train=False)


@pytest.mark.slow
def test_serve_demo_prints_status_lines_not_requests(tmp_path):
  """15 s of simulated users, a status line every 5 s: two or more lines from the demo and in the
  server's log, none per HTTP request. The held-out size comes as a config override, which the
  demo hands to its evaluator."""
  workdir = tmp_path / "demo"
  cmd = [sys.executable, "-m", "areal_jax.serve.demo", "--config=configs/serve_arithmetic.py:tiny",
         f"--workdir={workdir}", "--duration_s=15", "--status_every_s=5",
         "--config.train.eval_size=2", "--curve_points=0"]
  out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  text = out.stdout + out.stderr
  assert "HTTP Request" not in text and "HTTP/1.1" not in text, text[-3000:]
  lines = [line for line in out.stdout.splitlines() if line.startswith("status ")]
  assert len(lines) >= 2, out.stdout
  assert all("left): users " in line and "; serving version " in line and " tokens/s over the "
             "last 5 s; turns " in line for line in lines), lines
  server = (workdir / "server.log").read_text()
  assert "HTTP Request" not in server and server.count("status: serving version ") >= 2, server
  assert len(out.stdout.splitlines()) + len(out.stderr.splitlines()) <= 30, text
  assert json.loads((workdir / "eval_before.json").read_text())["n"] == 2
