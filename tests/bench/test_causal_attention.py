"""``bench/causal_attention.py`` on CPU (the GPU kernel in interpret mode, the tiny shape): the
kernel computes what the dense form computes, forward and backward; a kernel that computes wrong
shows in ``max_abs_diff``; the FLOPs it rates every form by are the rows' causal pairs."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import causal_attention  # noqa: E402

from areal_jax.kernels import causal_attention as causal_kernels  # noqa: E402


def _run(tmp_path, monkeypatch, *extra):
  out = tmp_path / "ca.json"
  monkeypatch.setattr(sys, "argv", ["causal_attention.py", "--model", "tiny", "--lengths", "48,96",
                                    "--tokens", "96", "--segment", "20", "--impls",
                                    "dense,pallas_gpu", "--reps", "1", "--json", str(out), *extra])
  causal_attention.main()
  return json.loads(out.read_text())


@pytest.mark.slow
def test_the_kernel_matches_the_dense_form_in_both_passes(tmp_path, monkeypatch):
  rows = _run(tmp_path, monkeypatch)["rows"]
  assert [(r["length"], r["rows"], r["pass"], r["impl"]) for r in rows] == [
      (length, 96 // length, p, impl) for length in (48, 96)
      for p in ("forward", "forward+backward") for impl in ("dense", "pallas_gpu")]
  kernel = [r for r in rows if r["impl"] == "pallas_gpu"]
  assert all(r["max_abs_diff"] < 1e-5 and r["ms"] > 0 and r["dense_over_this"] > 0
             for r in kernel), kernel
  # the same FLOPs for both forms; forward + backward counts 3x the forward
  f = {(r["length"], r["pass"], r["impl"]): r["tflops"] * r["ms"] for r in rows}
  assert np.isclose(f[(48, "forward", "dense")], 2 * 4 * 4 * 16 * 48 * 49 / 2 / 1e9)
  assert np.isclose(f[(48, "forward+backward", "pallas_gpu")], 3 * f[(48, "forward", "dense")])


def test_a_kernel_that_computes_wrong_shows(tmp_path, monkeypatch):
  real = causal_kernels.attend
  monkeypatch.setattr(causal_kernels, "attend", lambda *a, **kw: real(*a, **kw) * 1.01)
  rows = _run(tmp_path, monkeypatch, "--lengths", "48")["rows"]
  assert all(r["max_abs_diff"] > 1e-4 for r in rows if r["impl"] == "pallas_gpu"), rows


def test_packed_segments_fill_rows_with_sequences_of_about_the_length():
  ids = causal_attention.packed_segments(np.random.default_rng(0), 3, 4096, 300)
  assert ids.shape == (3, 4096) and ids.min() == 1
  for row in ids:
    assert np.all(np.diff(row) >= 0)  # consecutive sequences, numbered from 1
    lengths = np.bincount(row)[1:-1]  # (the last one cut at the row's end)
    assert lengths.min() >= 16 and 150 < lengths.mean() < 600
  assert np.all(causal_attention.packed_segments(None, 2, 64, 0) == 1)
