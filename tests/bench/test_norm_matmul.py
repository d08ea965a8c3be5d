"""``bench/norm_matmul.py`` on CPU (our kernel in interpret mode, the tiny shape): every launch it
sweeps computes what the model's own norm, matmul, bias and SwiGLU compute, and a launch that
computes wrong shows in its ``max_abs_diff``."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import norm_matmul  # noqa: E402

from areal_jax.kernels import pallas_norm_matmul  # noqa: E402


def _run(tmp_path, monkeypatch, tunings, model="tiny"):
  out = tmp_path / "nm.json"
  monkeypatch.setattr(sys, "argv", ["norm_matmul.py", "--model", model, "--tunings", tunings,
                                    "--reps", "1", "--json", str(out)])
  norm_matmul.main()
  return json.loads(out.read_text())


def test_every_launch_computes_the_models_pieces(tmp_path, monkeypatch):
  rows = _run(tmp_path, monkeypatch, "xla;default;block_n=16,warps=2,stages=1")["results"]
  assert [(r["piece"], r["tuning"]) for r in rows] == [
      (p, t) for p in ("norm+qkv", "norm+gate_up+swiglu")
      for t in ("xla", "default", "block_n=16,warps=2,stages=1")]
  assert rows[2]["block_n"] == 16 and rows[2]["warps"] == 2 and rows[2]["stages"] == 1
  assert all(r["max_abs_diff"] < 1e-5 and r["us_per_layer"] > 0 for r in rows), rows
  # the tiny shape: 64 inputs; q/k/v (4 + 2 x 2 heads of 16) and gate/up (2 x 128) float32 weights
  assert [r["weight_bytes_per_layer"] for r in rows[::3]] == [64 * 128 * 4, 64 * 256 * 4]


def test_a_launch_that_computes_wrong_shows(tmp_path, monkeypatch):
  real = pallas_norm_matmul.norm_matmul

  def off(x, scale, w, bias=None, **kwargs):  # the norm's scale read 1% high
    return real(x, scale * 1.01, w, bias, **kwargs)

  monkeypatch.setattr(pallas_norm_matmul, "norm_matmul", off)
  rows = _run(tmp_path, monkeypatch, "xla;default")["results"]
  assert rows[0]["max_abs_diff"] == 0 and rows[1]["max_abs_diff"] > 1e-3
