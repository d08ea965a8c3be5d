"""Host memory on CPU: metrics.jsonl reports the process's resident set, and the memory plans take
the machine's available memory as a CPU run's budget (a run that cannot fit stops before step 1)."""

import io
import os
import pathlib

import jax
import pytest

from areal_jax import config as config_lib
from areal_jax import host_memory
from areal_jax.learner import memory as learner_memory
from areal_jax.runtime import metrics as metrics_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 1024**3


def test_every_metrics_row_carries_the_resident_set_and_its_peak(tmp_path):
  out = io.StringIO()
  w = metrics_lib.MetricsWriter(str(tmp_path), total_steps=2, stream=out)
  for step in (1, 2):
    row = {k: 0.0 for k in metrics_lib.REQUIRED_FIELDS}
    row.update(step=step, version=step, staleness_max=0)
    w.write(row)
  w.close()
  rows = metrics_lib.read(os.path.join(tmp_path, "metrics.jsonl"))
  assert len(rows) == 2
  for r in rows:
    assert 0 < r["host_rss_gib"] <= r["host_rss_peak_gib"]
  assert rows[0]["host_rss_peak_gib"] <= rows[1]["host_rss_peak_gib"]  # a peak never falls
  assert " rss " in out.getvalue() and " GiB" in out.getvalue()


def test_the_resident_set_follows_what_this_process_allocates():
  before = host_memory.rss_bytes()
  block = b"\x01" * (256 * 2**20)  # written: resident
  assert host_memory.rss_bytes() - before >= 200 * 2**20
  assert host_memory.peak_rss_bytes() >= host_memory.rss_bytes()
  del block
  assert host_memory.available_bytes() > 0


def test_a_cpu_budget_is_each_devices_share_of_the_hosts_available_memory(monkeypatch):
  monkeypatch.setattr(host_memory, "available_bytes", lambda: 8 * GIB)
  monkeypatch.setattr(host_memory, "live_array_bytes", lambda: 0)
  m = config_lib.base_config().mesh
  m.memory_fraction = 0.5
  m.colocated, m.learner_devices = True, 1  # one device for both: all of it
  assert learner_memory.device_budget(m, jax.devices()[:1]) == 4 * GIB
  m.colocated, m.learner_devices, m.sampler_devices = False, 2, 2  # four devices share the host
  assert learner_memory.device_budget(m, jax.devices()[:2]) == 1 * GIB
  m.device_memory_gib = 3.0  # configured: as configured
  assert learner_memory.device_budget(m, jax.devices()[:2]) == int(1.5 * GIB)
  m.device_memory_gib = 0.0
  monkeypatch.setattr(host_memory, "available_bytes", lambda: None)  # a system that does not say
  assert learner_memory.device_budget(m, jax.devices()[:2]) is None


def test_a_run_that_cannot_fit_a_small_machine_stops_before_the_first_step(tmp_path, monkeypatch):
  """On CPU the learner's plan counts the host's memory (here a machine with 1 MiB free): the
  run stops naming the keys to change, nothing trained, nothing in metrics.jsonl."""
  from areal_jax.runtime import trainer

  monkeypatch.setattr(host_memory, "available_bytes", lambda: 2**20)
  monkeypatch.setattr(host_memory, "live_array_bytes", lambda: 0)
  c = config_lib.load(f"{ROOT}/configs/gsm8k.py:tiny")
  config_lib.override(c, "actor.micro_batch_tokens", 1024)  # (one halving to the smallest row)
  with pytest.raises(MemoryError, match="memory plan"):
    trainer.run(c, str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


_FRAGMENT = r"""
import ctypes, sys
from areal_jax import host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
  assert host_memory.map_large_buffers()
MIB = 2**20
libc.free(libc.malloc(16 * MIB))  # glibc's default threshold now rises to 16 MiB
blocks = [libc.malloc(MIB) for _ in range(200)]
for b in blocks:
  ctypes.memset(b, 1, MIB)
full = host_memory.rss_bytes()
for b in blocks[::2]:  # every other one: holes between live blocks
  libc.free(b)
print((full - host_memory.rss_bytes()) // MIB)
"""


@pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc's malloc")
def test_with_a_fixed_mmap_threshold_freed_buffers_leave_the_resident_set():
  import subprocess
  import sys

  def freed_mib(mode):
    out = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return int(out.stdout.split()[-1])
  assert freed_mib("default") < 20  # the holes stay resident in the heap
  assert freed_mib("fixed") >= 90  # each block had its own mapping: 100 MiB given back
