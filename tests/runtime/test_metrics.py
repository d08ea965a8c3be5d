"""metrics.jsonl: required fields, one line per step, resume drops rows past the checkpoint."""

import io
import json
import os
import subprocess
import sys

import pytest

from areal_jax.runtime import metrics as metrics_lib


def row(step):
  r = {k: 0.0 for k in metrics_lib.REQUIRED_FIELDS}
  r.update(step=step, version=step, staleness_max=0)
  return r


def test_writes_jsonl_tensorboard_and_progress(tmp_path):
  out = io.StringIO()
  w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=3, stream=out)
  for s in (1, 2, 3):
    w.write(row(s))
  w.close()
  rows = metrics_lib.read(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert set(metrics_lib.REQUIRED_FIELDS) <= set(rows[0])
  assert os.listdir(tmp_path / "tensorboard")
  assert "step 3/3" in out.getvalue() and "ETA" in out.getvalue()


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  """tensorboardX imports torch when it can (about 180 MB of host memory); the writer keeps it out
  of a run that has not loaded it, and torch still imports afterwards where it is installed."""
  code = f"""
import importlib.util, io, sys
from areal_jax.runtime import metrics
row = {{k: 0.5 for k in metrics.REQUIRED_FIELDS}}
row.update(step=1, version=1, staleness_max=0)
w = metrics.MetricsWriter({str(tmp_path)!r}, total_steps=1, stream=io.StringIO())
w.write(row)
w.close()
assert "torch" not in sys.modules, "torch imported"
if importlib.util.find_spec("torch"):
  import torch
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").iterdir())
  assert b"reward_mean" in events and b"wall_time_s" in events


def test_missing_field_is_an_error(tmp_path):
  w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=1, stream=io.StringIO())
  r = row(1)
  del r["loss"]
  try:
    with pytest.raises(KeyError, match="loss"):
      w.write(r)
  finally:  # (an open TensorBoard writer fails in its atexit hook on Python 3.12)
    w.close()


def test_resume_drops_rows_after_the_checkpoint_and_torn_lines(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(row(s)) + "\n" for s in range(1, 6)) + '{"step": 6, "los')
  w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=9, resume_step=3, stream=io.StringIO())
  w.write(row(4))
  w.close()
  assert [r["step"] for r in metrics_lib.read(str(path))] == [1, 2, 3, 4]


def test_a_long_wait_for_a_batch_prints_its_progress(tmp_path):
  out = io.StringIO()
  w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=20, stream=out)
  w.waiting(1, 31.4, batch_size=8, ready=3, generating=5, tokens=1840)
  w.close()
  assert out.getvalue() == ("step 1/20  waiting 31s for 8 groups: 3 ready, 5 generating, "
                            "1840 tokens generated\n")
  assert metrics_lib.read(os.path.join(tmp_path, "metrics.jsonl")) == []  # (a line, not a row)
