"""``plot_run``: a PNG from metrics.jsonl, whatever fields the rows lack."""

import json

import pytest

from areal_jax.runtime import metrics as metrics_lib
from areal_jax.runtime import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_rows(workdir, rows, torn_tail=""):
  with open(workdir / "metrics.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write(torn_tail)


def full_row(step):
  row = {k: 0.5 for k in metrics_lib.REQUIRED_FIELDS}
  row.update(step=step, version=step, reward_mean=step / 10, staleness_mean=1.5, staleness_max=2,
             gen_tokens_per_s=100.0 + step, train_tokens_per_s=300.0 + step)
  if step % 2 == 0:
    row.update({"eval_accuracy": step / 20, "eval_mean@4": step / 25})
  return row


def png_size(path):
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
  return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_full_run_gives_a_png_in_the_workdir(tmp_path):
  write_rows(tmp_path, [full_row(s) for s in range(1, 9)])
  path = plots.plot_run(str(tmp_path))
  assert path == str(tmp_path / "curves.png")
  width, height = png_size(path)
  assert width >= 800 and height >= 600
  assert not list(tmp_path.glob("*.tmp*"))  # written atomically


def test_missing_and_non_finite_fields_leave_gaps(tmp_path):
  rows = [dict(step=1), dict(step=2, reward_mean=None, staleness_mean=float("nan")),
          dict(step=3, reward_mean=0.25, eval_accuracy=True), dict(version=4, reward_mean="x"),
          dict(step=5, gen_tokens_per_s=12.0)]
  with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as f:
    for r in rows:  # NaN as JSON's non-standard token, as a careless writer might leave it
      f.write(json.dumps(r, allow_nan=True) + "\n")
  png_size(plots.plot_run(str(tmp_path)))
  assert plots._series(rows, "reward_mean") == ([3], [0.25])
  assert plots._series(rows, "staleness_mean") == ([], [])
  assert plots._series(rows, "eval_accuracy") == ([], [])  # a bool is not a measurement
  assert plots._series(rows, "gen_tokens_per_s") == ([5], [12.0])


def test_row_without_step_uses_its_position(tmp_path):
  rows = [dict(reward_mean=0.1), dict(reward_mean=0.2)]
  assert plots._series(rows, "reward_mean") == ([1, 2], [0.1, 0.2])


def test_empty_and_torn_metrics_still_plot(tmp_path):
  write_rows(tmp_path, [], torn_tail='{"step": 1, "rew')
  png_size(plots.plot_run(str(tmp_path)))
  write_rows(tmp_path, [full_row(1)], torn_tail='{"step": 2, "rew')
  png_size(plots.plot_run(str(tmp_path), output=str(tmp_path / "other.png")))
  assert (tmp_path / "other.png").exists()


def test_no_metrics_file_names_the_workdir(tmp_path):
  with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
    plots.plot_run(str(tmp_path / "nowhere"))


def test_eval_mean_keys_are_found_for_any_k():
  rows = [dict(step=1), {"step": 2, "eval_mean@8": 0.5}, {"step": 3, "eval_mean@2": 0.1}]
  assert plots._eval_keys(rows) == ["eval_mean@2", "eval_mean@8"]


def test_pyplot_backend_is_left_alone(tmp_path):
  import matplotlib

  before = matplotlib.get_backend()
  write_rows(tmp_path, [full_row(1), full_row(2)])
  plots.plot_run(str(tmp_path))
  assert matplotlib.get_backend() == before
