"""``bench/paged_kernel.py`` on CPU (the Pallas GPU kernels in interpret mode, the tiny shape):
every launch it sweeps (our writing kernel's too) reads the same attention as the engine's
default, and a launch that reads wrong shows in its ``max_abs_diff``."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import paged_kernel  # noqa: E402

from areal_jax.kernels import pallas_attention  # noqa: E402


def _run(tmp_path, monkeypatch, tunings, page_sizes="16,32"):
  out = tmp_path / "pk.json"
  monkeypatch.setattr(sys, "argv", ["paged_kernel.py", "--model", "tiny",
                                    "--page-sizes", page_sizes,
                                    "--tunings", tunings, "--reps", "1", "--json", str(out)])
  paged_kernel.main()
  return json.loads(out.read_text())


@pytest.mark.slow
def test_every_launch_reads_the_defaults_attention(tmp_path, monkeypatch):
  result = _run(tmp_path, monkeypatch,
                "default;bound=1,parts=3,block_pages=2;warps=4,stages=1;writes=1,warps=2")
  rows = result["rows"]
  assert [(r["page_size"], r["tuning"]) for r in rows] == [
      (p, t) for p in (16, 32) for t in ("default", "bound=1,parts=3,block_pages=2",
                                         "warps=4,stages=1", "writes=1,warps=2",
                                         "dense read of the gathered pages")]
  assert rows[1]["parts"] == 3 and rows[1]["bound"] and rows[2]["warps"] == 4
  assert rows[3]["writes"] and rows[3]["warps"] == 2
  assert all(r["max_abs_diff"] < 1e-5 for r in rows), rows
  assert all(r["us_per_layer"] > 0 and r["read_frac"] > 0 for r in rows)
  # the tiny shape: 4 slots x 2 K/V heads x 16 features, positions 0..24, float32, K and V
  assert result["kv_bytes_per_layer"] == 4 * 2 * 25 * 16 * 2 * 4


def test_a_launch_that_reads_too_few_pages_shows(tmp_path, monkeypatch):
  """Pages of 16 only, where the short launch reads a row's first page alone."""
  real = pallas_attention.paged

  def short(q, k, v, lengths, pages, page, interpret=False, tuning=None, bound=None):
    if tuning.bound:  # at pages of 16, the first page only (positions 16..24 lost)
      pages = pages[:, :-(-bound // page) - 5]
      tuning = pallas_attention.PagedTuning(parts=1)
    return real(q, k, v, lengths, pages, page, interpret=interpret, tuning=tuning)

  monkeypatch.setattr(pallas_attention, "paged", short)
  rows = _run(tmp_path, monkeypatch, "default;bound=1", "16")["rows"]
  diffs = {(r["page_size"], r["tuning"]): r["max_abs_diff"] for r in rows}
  assert diffs[(16, "bound=1")] > 1e-2 and np.isclose(diffs[(16, "default")], 0)


def test_a_launch_that_fails_is_noted_and_the_sweep_goes_on(tmp_path, monkeypatch):
  """A launch the device cannot run (as when the dense read asked 84 GiB of an H200) is a row
  with its error, and the launches after it are still timed (pages of 16 only: the sweep over
  page sizes is the first test's)."""
  import jax

  real = paged_kernel.program

  def program(impl, how, *a, **kw):
    fn = real(impl, how, *a, **kw)
    if how.warps == 2:
      def refused(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 83.88GiB")
      return refused
    return fn

  monkeypatch.setattr(paged_kernel, "program", program)
  rows = _run(tmp_path, monkeypatch, "default;writes=1,warps=2;bound=1", "16")["rows"]
  assert [(r["tuning"], "error" in r) for r in rows[:4]] == [
      ("default", False), ("writes=1,warps=2", True), ("bound=1", False),
      ("dense read of the gathered pages", False)]
  assert rows[1]["error"].startswith("RESOURCE_EXHAUSTED") and "us_per_layer" not in rows[1]
  assert all(r["max_abs_diff"] < 1e-5 for r in rows if "error" not in r)
