"""A pytest plugin that measures where the suite's time goes: per test its wall time (setup, call
and teardown), its CPU time (the suite keeps both cores of a 2-core machine busy, so it is bound
by the sum of these, not of the wall times), the XLA compile time and number of compilations, the
persistent-cache hits and the time spent tracing and lowering to MLIR; written as a Markdown table
per module, sorted by CPU time.

Enabled by ``--compile-table=PATH`` (tests/conftest.py registers it; ``make test-table`` runs the
whole suite with it into test-table.md). Under pytest-xdist each worker sends its records to the
controller through ``workeroutput``, and the controller writes the table.

The figures come from ``jax.monitoring`` events in the test process: ``backend_compile_duration``
wraps one compile request, answered either by XLA (a compilation) or by the persistent cache (a
hit, which tests/conftest.py's session-wide cache makes of every repeated program). A hit is told
apart by the ``cache_hits`` event that comes before the duration event in the same thread.
Programs that jit's in-memory cache already holds make no request and are not counted; neither are
compilations in the subprocesses, Ray actors or servers that tests start.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pathlib
import platform
import resource
import subprocess
import threading
import time

import pytest

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_FIELDS = ("compile_s", "compiles", "hit_s", "hits", "trace_s")


class _Counters:
  """Running totals of this process's JAX compile events (all threads)."""

  def __init__(self):
    self.totals = dict.fromkeys(_FIELDS, 0.0)
    self._lock = threading.Lock()
    self._local = threading.local()

  def snapshot(self) -> dict:
    with self._lock:
      return dict(self.totals)

  def on_event(self, event: str, **_):
    if event == _CACHE_HIT:
      self._local.hit = True

  def on_duration(self, event: str, secs: float, **_):
    with self._lock:
      if event == _BACKEND_COMPILE:
        if getattr(self._local, "hit", False):
          self.totals["hit_s"] += secs
          self.totals["hits"] += 1
        else:
          self.totals["compile_s"] += secs
          self.totals["compiles"] += 1
        self._local.hit = False
      elif event in (_TRACE, _LOWER):
        self.totals["trace_s"] += secs


class CompileTable:
  """The plugin object: records per test, merges the workers' records, writes the table."""

  def __init__(self, config, path: str | None):
    self.config = config
    self.path = path  # None in an xdist worker: the controller writes
    self.records: list[dict] = []
    self.t0 = time.time()
    self.counters = None
    self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if hasattr(config, "workerinput") or not _uses_xdist(config):
      self._listen()  # (an xdist controller runs no tests: nothing to listen to)

  def _listen(self):
    import jax.monitoring  # noqa: PLC0415 (only where the table is asked for)
    self.counters = _Counters()
    jax.monitoring.register_event_listener(self.counters.on_event)
    jax.monitoring.register_event_duration_secs_listener(self.counters.on_duration)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):
    before = self.counters.snapshot() if self.counters else None
    start, cpu = time.time(), _cpu_s()
    yield
    end = time.time()
    record = {"nodeid": item.nodeid, "module": item.nodeid.split("::")[0],
              "worker": self.worker, "start": start, "wall_s": end - start,
              "cpu_s": _cpu_s() - cpu,
              "slow": item.get_closest_marker("slow") is not None}
    if before is not None:
      after = self.counters.snapshot()
      record.update({k: after[k] - before[k] for k in _FIELDS})
    self.records.append(record)

  def pytest_sessionfinish(self, session):
    if hasattr(self.config, "workeroutput"):
      self.config.workeroutput["compile_table"] = json.dumps(self.records)
    elif self.path:
      pathlib.Path(self.path).write_text(render(self.records, self.t0, time.time(), self.config))

  @pytest.hookimpl(optionalhook=True)
  def pytest_testnodedown(self, node, error):
    """(xdist controller) A worker finished: its records join the controller's."""
    self.records.extend(json.loads(getattr(node, "workeroutput", {}).get("compile_table", "[]")))

  def pytest_terminal_summary(self, terminalreporter):
    if self.path:
      terminalreporter.write_line(f"compile table: {self.path}")


def _cpu_s() -> float:
  """CPU seconds (user + system) of this process's threads and of the child processes it has
  waited for: a subprocess or server a test starts and stops counts in that test; one still
  running at the test's end (a module's Ray cluster) counts in the test during which it ends."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def _uses_xdist(config) -> bool:
  numprocesses = getattr(config.option, "numprocesses", None)
  return bool(numprocesses) and getattr(config.option, "dist", "no") != "no"


def _machine() -> str:
  """lscpu's model name, and whether the CPU has AVX-512 (the CI machines differ in it)."""
  model, avx512 = platform.processor() or platform.machine(), False
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
    for line in info.splitlines():
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip()
        break
    avx512 = " avx512f" in info
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} cores, {'with' if avx512 else 'without'} AVX-512"


def _commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parent, timeout=10)
    return out.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _sum(records, key):
  return sum(r.get(key, 0.0) for r in records)


def render(records: list[dict], t0: float, t1: float, config=None) -> str:
  """The Markdown table: header, totals, per module (sorted by wall time), the slowest tests and
  each worker's share of the session."""
  by_module = collections.defaultdict(list)
  for r in records:
    by_module[r["module"]].append(r)
  workers = collections.defaultdict(list)
  for r in records:
    workers[r["worker"]].append(r)
  args = " ".join(config.invocation_params.args) if config is not None else ""
  when = datetime.datetime.fromtimestamp(t0, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  lines = [
      "# Test time and XLA compilations",
      "",
      f"{when}, commit {_commit()}, {_machine()}; `pytest {args}`; session wall "
      f"{t1 - t0:.0f} s.",
      "",
      "Wall s: per test, setup + call + teardown (a module-scoped fixture counts in its first "
      "test), summed over the tests, which xdist workers run side by side. CPU s: the CPU time "
      "of the test's process and of the child processes it started and waited for (a Ray "
      "cluster's counts when it stops). Compile s and "
      "compilations: XLA compilations in the test processes; cache hits: programs served by the "
      "session's persistent compilation cache instead (hit s: their load time); trace s: tracing "
      "and lowering to MLIR. Not seen: compilations in the subprocesses, Ray actors and servers "
      "the tests start.",
      "",
      "| | tests | wall s | CPU s | compile s | compilations | cache hits | hit s | trace s |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
      _row("**total**", records, bold=True),
      "",
      "## Per module",
      "",
      "Workers: how many xdist workers ran some of the module's tests (each one builds the "
      "module's module-scoped fixtures).",
      "",
      "| module | tests | wall s | CPU s | compile s | compilations | cache hits | hit s | "
      "trace s | workers |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for module, rs in sorted(by_module.items(), key=lambda kv: -_sum(kv[1], "cpu_s")):
    lines.append(_row(f"`{module}`", rs) + f" {len({r['worker'] for r in rs})} |")
  lines += ["", "## Tests that took the most CPU time", "",
            "| test | wall s | CPU s | compile s | compilations | cache hits |",
            "|---|---:|---:|---:|---:|---:|"]
  for r in sorted(records, key=lambda r: -r.get("cpu_s", 0.0))[:30]:
    lines.append(f"| `{r['nodeid']}`{' (slow)' if r.get('slow') else ''} | {r['wall_s']:.1f} | "
                 f"{r.get('cpu_s', 0):.1f} | {r.get('compile_s', 0):.1f} | "
                 f"{int(r.get('compiles', 0))} | {int(r.get('hits', 0))} |")
  lines += ["", "## Workers", "",
            "Busy s: the sum of the worker's test times; last end: when its last test ended, "
            "from the session's start (a worker that ends early idles until the other is done).",
            "", "| worker | tests | busy s | last end s | last test |", "|---|---:|---:|---:|---|"]
  for worker, rs in sorted(workers.items()):
    last = max(rs, key=lambda r: r["start"] + r["wall_s"])
    lines.append(f"| {worker} | {len(rs)} | {_sum(rs, 'wall_s'):.0f} | "
                 f"{last['start'] + last['wall_s'] - t0:.0f} | `{last['nodeid']}` |")
  return "\n".join(lines) + "\n"


def _row(name, rs, bold=False):
  cells = [str(len(rs)), f"{_sum(rs, 'wall_s'):.1f}", f"{_sum(rs, 'cpu_s'):.1f}",
           f"{_sum(rs, 'compile_s'):.1f}",
           str(int(_sum(rs, "compiles"))), str(int(_sum(rs, "hits"))), f"{_sum(rs, 'hit_s'):.1f}",
           f"{_sum(rs, 'trace_s'):.1f}"]
  if bold:
    cells = [f"**{c}**" for c in cells]
  return f"| {name} | " + " | ".join(cells) + " |"
