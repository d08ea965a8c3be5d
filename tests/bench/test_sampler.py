"""``bench/sampler.py``'s decode roofline row as a GPU makes it, on CPU: the engine times the
launches it is offered before the row's steps (here the loop in CUDA graphs, options XLA:CPU
ignores) and the row names the one kept, each one's step and first call, and the matmuls the
decode program kept runs."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import sampler  # noqa: E402

from areal_jax.kernels import choice  # noqa: E402
from areal_jax.sampler.engine import DecodeEngine  # noqa: E402


class _Hardware:
  """Stands in for the bandwidth and matmul probes (their figures are not under test)."""

  def probe(self, reps=1):
    return self

  def figures(self):
    return {"read_GBps": 10.0, "matmul_GFLOPps": 100.0}


def test_the_roofline_row_names_the_launch_its_engine_timed_and_kept(monkeypatch, capsys):
  monkeypatch.setattr(DecodeEngine, "launch_stages",
                      lambda self: [choice.graphs_to_time])  # (as a GPU's last stage)
  cfg = sampler.TINY
  row = sampler.roofline(sampler.make_model(cfg), cfg, slots=4, context=16, hw=_Hardware(),
                         steps=4, reps=1)
  names = ["default", "graphs", "graphs:unrolled"]
  assert row["launch"] in names
  assert list(row["launch_step_ms"]) == list(row["launch_compile_s"]) == names
  assert all(v > 0 for v in row["launch_step_ms"].values())
  assert row["decode_matmul"] in choice.MATMUL and row["step_ms"] > 0
  line = sampler.launch_line(row)
  assert line.strip().startswith(f"launch kept: {row['launch']} (timed, ms a step: default ")
  assert "first call, compile included, s: default " in line
  assert row["launch_failed"] == {} and "not used" not in line
  line = sampler.launch_line({**row, "launch_failed": {"graphs": "computes NaN"}})
  assert line.endswith("; not used: graphs: computes NaN")


def test_the_roofline_row_decodes_over_pages_of_the_size_asked(monkeypatch):
  """``--page-size``: the row's engine pages its cache in pages of that size (the GPU's paged
  cache, forced on CPU) and the row says so; a cache of rows says none."""
  monkeypatch.setattr(DecodeEngine, "launch_stages", lambda self: [])
  monkeypatch.setenv(choice.PAGED_ENV, "1")
  cfg = sampler.TINY
  model = sampler.make_model(cfg)
  rows = {size: sampler.roofline(model, cfg, slots=2, context=16, hw=_Hardware(), steps=2, reps=1,
                                 page_size=size) for size in (16, 32)}
  for size, row in rows.items():
    assert row["page_size"] == size and row["kv_pages"] > 0 and row["step_ms"] > 0
  # the same pool of positions: half the pages of twice the size (a page of headroom a slot)
  assert rows[16]["kv_pages"] > rows[32]["kv_pages"]
  monkeypatch.setenv(choice.PAGED_ENV, "0")
  row = sampler.roofline(model, cfg, slots=2, context=16, hw=_Hardware(), steps=2, reps=1,
                         page_size=32)
  assert row["kv_pages"] == 0 and row["page_size"] is None
