"""This process's host memory: its resident set now and at its peak, and what the machine has free.

On CPU the "devices" are the host: their buffers, XLA's executables and compilations, Python and
the data all take resident memory of one process. ``metrics.jsonl`` reports ``host_rss_gib`` and
``host_rss_peak_gib`` from here, and the memory plans take ``available_bytes`` as a CPU run's
budget (``learner.memory.device_budget``). Linux's ``/proc`` is read where it exists; elsewhere
``resource.getrusage`` gives the peak and ``os.sysconf`` the machine's physical memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import sys

GIB = 1024**3


def _status_kib(field: str, path: str = "/proc/self/status") -> int | None:
  """A ``kB`` field of a ``/proc`` status-like file (``VmRSS``, ``MemAvailable``...), or None."""
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def rss_bytes() -> int | None:
  """The resident set of this process now (None where the system does not say)."""
  kib = _status_kib("VmRSS")
  return None if kib is None else kib * 1024


def peak_rss_bytes() -> int:
  """The largest resident set this process has had so far."""
  kib = _status_kib("VmHWM")
  if kib is not None:
    return kib * 1024
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return peak if sys.platform == "darwin" else peak * 1024


def available_bytes() -> int | None:
  """Memory the machine can give a process without swapping: ``MemAvailable`` of
  ``/proc/meminfo`` (free memory and the caches the kernel can drop), else the physical memory
  ``os.sysconf`` reports; None where neither is known."""
  kib = _status_kib("MemAvailable", "/proc/meminfo")
  if kib is not None:
    return kib * 1024
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def live_array_bytes() -> int:
  """Bytes of this process's live JAX arrays (every addressable shard; on CPU, host memory)."""
  import jax  # pylint: disable=import-outside-toplevel (the rest of this module needs none)

  total = 0
  for a in jax.live_arrays():
    if a.is_deleted():
      continue
    try:
      total += sum(s.data.nbytes for s in a.addressable_shards)
    except RuntimeError:  # deleted (donated) between the listing and the read
      continue
  return total


@functools.cache
def _libc():
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name) if name else None
  except OSError:
    return None
  return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release() -> bool:
  """Hands the memory the C allocator holds free back to the system (glibc's ``malloc_trim``;
  False where there is none). XLA:CPU's buffers below glibc's mmap threshold (up to 32 MiB once
  larger ones were freed) come from malloc's heaps, and what a program frees stays resident there
  until trimmed: a train step's temporaries, mapped anew above it, then add to that slack."""
  libc = _libc()
  if libc is None:
    return False
  libc.malloc_trim(0)
  return True


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # (jax/_src/dispatch.py)
_trimming = False


def release_after_compiles() -> None:
  """From now on ``release`` after every XLA compilation (or load from the persistent cache) of
  this process: what the compiler and the loading freed is handed back before the program runs,
  instead of staying beside its first call's buffers (registered once)."""
  global _trimming
  if _trimming or _libc() is None:
    return
  import jax  # pylint: disable=import-outside-toplevel

  def listener(event: str, duration_secs: float, **_) -> None:
    del duration_secs
    if event == _COMPILE_EVENT:
      release()
  jax.monitoring.register_event_duration_secs_listener(listener)
  _trimming = True


M_ARENA_MAX = -8  # glibc's mallopt parameter: the most malloc arenas (heaps) threads may create


def limit_arenas(arenas: int = 2) -> bool:
  """Caps the heaps glibc's malloc gives threads (``mallopt(M_ARENA_MAX)``; False where there is
  none). By default a process may get eight per core, each keeping what its threads freed: XLA's
  threads allocate a program's buffers in theirs, and memory one arena holds free is not reused by
  another's allocations, so a CPU train step grew the resident set from step to step."""
  libc = _libc()
  if libc is None or not hasattr(libc, "mallopt"):
    return False
  return bool(libc.mallopt(M_ARENA_MAX, int(arenas)))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter: allocations this large get their own mapping


def map_large_buffers(threshold_bytes: int = 256 << 10) -> bool:
  """Gives every allocation of at least ``threshold_bytes`` a mapping of its own, unmapped when it
  is freed (``mallopt(M_MMAP_THRESHOLD)``; False where there is none). glibc's default threshold
  rises, up to 32 MiB, each time such a buffer is freed, after which a program's buffers (a
  135M model's per-layer weights are 0.4-3.5 MiB each) come from the heaps, where what is freed
  between live ones stays resident. Fixed low, a train step's temporaries, gradients and a swap's
  incoming weights leave nothing behind when freed."""
  libc = _libc()
  if libc is None or not hasattr(libc, "mallopt"):
    return False
  return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


def metrics() -> dict:
  """``host_rss_gib`` and ``host_rss_peak_gib`` for a ``metrics.jsonl`` row."""
  rss = rss_bytes()
  return {"host_rss_gib": None if rss is None else round(rss / GIB, 3),
          "host_rss_peak_gib": round(peak_rss_bytes() / GIB, 3)}
