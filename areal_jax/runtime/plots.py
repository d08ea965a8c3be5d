"""Training curves of a run: ``plot_run(workdir)`` turns ``metrics.jsonl`` into ``curves.png``.

Four panels over the training step: reward (mean of the trained batch, with the held-out greedy
accuracy and sampled mean@k where the run evaluated), staleness (mean and max policy-version lag of
the trained tokens), throughput (generated and trained tokens per second) and the learner's wait
for a batch. A field missing from some rows (an older run, a step without evaluation) leaves a gap;
a panel with no data at all says so. Rendering uses the Agg canvas directly, never pyplot, so it
works without a display and leaves a notebook's plotting backend untouched.
"""

from __future__ import annotations

import math
import os

from areal_jax.runtime import metrics as metrics_lib

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """``(steps, values)`` of the rows where ``key`` holds a finite number."""
  xs, ys = [], []
  for i, row in enumerate(rows):
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      continue
    step = row.get("step")
    xs.append(step if isinstance(step, int) else i + 1)
    ys.append(float(value))
  return xs, ys


def _panel(ax, rows: list[dict], title: str, lines: list[tuple[str, str, dict]], ylabel: str,
           unit_interval: bool = False) -> None:
  """Draws ``lines`` (metrics key, legend label, line style) on ``ax``; notes when none has data.

  ``unit_interval``: values are fractions, so show the whole [0, 1] range when they all fit in it.
  """
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

  drawn, values = 0, []
  for key, label, style in lines:
    xs, ys = _series(rows, key)
    if xs:
      ax.plot(xs, ys, label=label, **style)
      drawn += 1
      values += ys
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  if unit_interval and values and 0.0 <= min(values) and max(values) <= 1.0:
    ax.set_ylim(-0.03, 1.03)
  ax.set_title(title, fontsize=11)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if drawn:
    ax.legend(fontsize=8, loc="best")
  else:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _eval_keys(rows: list[dict]) -> list[str]:
  """The ``eval_mean@k`` keys present in the run (k may differ between runs)."""
  return sorted({k for row in rows for k in row if k.startswith("eval_mean@")})


def plot_run(workdir: str, output: str | None = None) -> str:
  """Plots ``<workdir>/metrics.jsonl`` into ``output`` (default ``<workdir>/curves.png``).

  Returns the path of the PNG. Raises ``FileNotFoundError`` if the run has no metrics file.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {METRICS_FILE} in {workdir}: is it a run workdir?")
  rows = [r for r in metrics_lib.read(path) if isinstance(r, dict)]
  output = output or os.path.join(workdir, CURVES_FILE)

  fig = Figure(figsize=(11, 7.5), dpi=100, layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, 2)
  reward_lines = [("reward_mean", "train reward (batch mean)", dict(marker=".", color="C0"))]
  reward_lines.append(("eval_accuracy", "eval greedy pass@1", dict(marker="o", color="C3")))
  reward_lines.append(("tool_call_frac", "episodes calling a tool",
                       dict(marker=".", linestyle="--", color="C2")))
  reward_lines += [(k, f"eval {k[len('eval_'):]}", dict(marker="s", color=f"C{4 + i}"))
                   for i, k in enumerate(_eval_keys(rows))]
  _panel(axes[0, 0], rows, "reward", reward_lines, "reward / accuracy",
         unit_interval=True)
  _panel(axes[0, 1], rows, "staleness (policy versions behind)",
         [("staleness_mean", "mean", dict(marker=".", color="C1")),
          ("staleness_max", "max", dict(marker=".", linestyle="--", color="C2"))], "versions")
  axes[0, 1].yaxis.set_major_locator(MaxNLocator(integer=True))
  _panel(axes[1, 0], rows, "throughput",
         [("gen_tokens_per_s", "generated tokens/s", dict(marker=".", color="C0")),
          ("train_tokens_per_s", "trained tokens/s", dict(marker=".", color="C1"))], "tokens / s")
  _panel(axes[1, 1], rows, "time per step",
         [("step_time_s", "step", dict(marker=".", color="C0")),
          ("learner_wait_s", "learner waiting for a batch", dict(marker=".", color="C3"))], "seconds")
  steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
  span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps yet"
  fig.suptitle(f"{os.path.basename(os.path.abspath(workdir))}: {span}", fontsize=12)
  tmp = output + ".tmp.png"
  fig.savefig(tmp, format="png")
  os.replace(tmp, output)
  return output
