"""Where a run reports: ``metrics.jsonl``, TensorBoard events and one progress line per step."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from areal_jax import host_memory

# The fields every line of metrics.jsonl carries (a stable interface; more may follow them).
REQUIRED_FIELDS = (
    "step", "version", "reward_mean", "groups_accepted", "groups_rejected", "staleness_mean",
    "staleness_max", "behav_weight_max", "clip_frac", "loss", "grad_norm", "gen_tokens_per_s",
    "train_tokens_per_s", "learner_wait_s", "sampler_idle_frac", "weight_publish_s", "step_time_s",
    "wall_time_s",
)


def _plain(value):
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _summary_writer():
  """tensorboardX's ``SummaryWriter``, imported without torch where torch is not loaded yet.
  tensorboardX imports torch whenever it is installed (the lock installs it, for the tests'
  comparisons with ``transformers``), only to accept torch tensors, which the metrics never are:
  that would cost every run about 180 MB of host memory and most of a second of CPU. For the
  import's duration ``import torch`` fails (a ``None`` in ``sys.modules``), as it would without
  torch, and tensorboardX takes numpy arrays alone; torch imports as usual afterwards."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  finally:
    if blocked and sys.modules.get("torch", 0) is None:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  """Appends one JSON object per training step; mirrors scalars to TensorBoard; prints the
  progress lines to ``stream`` (None: ``sys.stdout`` as it is when each line is printed)."""

  def __init__(self, workdir: str, total_steps: int, resume_step: int = 0, stream=None):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    _truncate_after(self.path, resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    self._total = total_steps
    self._stream = stream
    self._t0 = time.time()
    self._first_step = None
    try:
      self._tb = _summary_writer()(os.path.join(workdir, "tensorboard"))
    except ImportError:  # TensorBoard events are optional; metrics.jsonl is not
      self._tb = None

  def write(self, metrics: dict) -> None:
    """Writes one step's row; adds this process's resident memory (``host_rss_gib``, now, and
    ``host_rss_peak_gib``, the most so far: ``host_memory.metrics``) unless the row has them."""
    row = {k: _plain(v) for k, v in metrics.items()}
    for k, v in host_memory.metrics().items():
      row.setdefault(k, v)
    missing = [k for k in REQUIRED_FIELDS if k not in row]
    if missing:
      raise KeyError(f"metrics for step {row.get('step')} lack required fields {missing}")
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
          self._tb.add_scalar(k, v, row["step"])
      self._tb.flush()
    self._progress(row)

  def _progress(self, row: dict) -> None:
    step = row["step"]
    if self._first_step is None:
      self._first_step, self._t0 = step - 1, time.time() - (row.get("step_time_s") or 0.0)
    done = step - self._first_step
    rate = done / max(time.time() - self._t0, 1e-9)
    eta_s = (self._total - step) / rate if rate > 0 else float("nan")
    fmt = lambda k, spec: format(row[k], spec) if isinstance(row.get(k), (int, float)) else "-"
    line = (f"step {step}/{self._total}  v{row['version']}  reward {fmt('reward_mean', '.3f')}"
            f"  stale {fmt('staleness_mean', '.2f')}/{fmt('staleness_max', 'd')}"
            f"  gen {fmt('gen_tokens_per_s', '.0f')} tok/s  train {fmt('train_tokens_per_s', '.0f')} tok/s"
            f"  wait {fmt('learner_wait_s', '.1f')}s  rss {fmt('host_rss_gib', '.1f')} GiB"
            f"  {rate * 60:.1f} steps/min  ETA {_hms(eta_s)}")
    if row.get("episodes_in_flight_mean"):  # episodic workflows: episodes, the sampler's share
      line += (f"  episodes {row['episodes_in_flight_mean']:.0f}"
               f"  sampler busy {fmt('sampler_busy_frac', '.2f')}")
    if row.get("env_steps"):
      line += f"  env p50/p99 {fmt('env_step_p50_s', '.2f')}/{fmt('env_step_p99_s', '.2f')}s"
    if row.get("env_failures"):
      line += f"  env failures {row['env_failures']}"
    if row.get("eval_accuracy") is not None:
      line += f"  eval {row['eval_accuracy']:.3f}"
    print(line, file=self._stream, flush=True)

  def waiting(self, step: int, waited_s: float, batch_size: int, ready: int, generating: int,
              tokens: int) -> None:
    """A progress line while step ``step`` waits for its batch (a first batch can take minutes
    on a CPU, compiling and generating): groups ``ready`` of the ``batch_size`` it needs, groups
    ``generating``, ``tokens`` generated since the last step."""
    print(f"step {step}/{self._total}  waiting {waited_s:.0f}s for {batch_size} groups: "
          f"{ready} ready, {generating} generating, {tokens} tokens generated",
          file=self._stream, flush=True)

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def _truncate_after(path: str, step: int) -> None:
  """Drops rows a crashed run wrote after the checkpoint it resumes from (atomically)."""
  if not os.path.exists(path):
    return
  rows = [r for r in read(path) if r.get("step", 0) <= step]
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, path)


def _hms(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def read(path: str) -> list[dict]:
  """Reads a metrics.jsonl (skips a torn last line left by a crash)."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows
