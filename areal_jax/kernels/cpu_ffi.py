"""Builds and registers the small C++ kernels XLA:CPU calls through the FFI (``cpu_attention``,
``cpu_matmul``).

A kernel is compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``) against
``jax.ffi.include_dir()`` into ``$XDG_CACHE_HOME/areal_jax`` (``~/.cache/areal_jax``), keyed by the
source, the flags, the jaxlib version and the CPU, then registered as an FFI target. It compiles
with ``-march=native``, so a cached build is only reused on the same kind of CPU.

``AREAL_JAX_CPU_KERNELS=0`` turns every kernel off; a kernel that cannot be built is skipped with a
warning that names the reason, and the caller uses XLA's form.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jaxlib

_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC", "-w")


def _cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "areal_jax")


def _cpu_id() -> str:
  """The CPU's model and features (x86 and Arm field names), what ``-march=native`` depends on."""
  fields = {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        name = line.split(":", 1)[0].strip()
        if name in ("model name", "flags", "Features", "CPU implementer", "CPU part"):
          fields.setdefault(name, line)
  except OSError:
    pass
  return platform.machine() + "".join(sorted(fields.values()))


def build(source_path: str) -> str:
  """Compiles ``source_path`` (once per source, flags, jaxlib and CPU); returns the library's path."""
  cxx = os.environ.get("CXX") or "g++"
  if shutil.which(cxx) is None:
    raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
  with open(source_path, "rb") as f:
    source = f.read()
  key = hashlib.sha256(source + repr((cxx, _FLAGS, jaxlib.__version__, _cpu_id())).encode())
  stem = os.path.splitext(os.path.basename(source_path))[0]
  path = os.path.join(_cache_dir(), f"{stem}_{key.hexdigest()[:16]}.so")
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", source_path, "-o", tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: concurrent builders each publish a whole library
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def register(source_path: str, symbol: str, target: str, what: str) -> bool:
  """Builds ``source_path`` and registers its handler ``symbol`` as the CPU FFI target ``target``;
  False (with a warning naming the reason) when that fails or kernels are turned off."""
  if os.environ.get("AREAL_JAX_CPU_KERNELS", "1") == "0":
    return False
  try:
    lib = ctypes.CDLL(build(source_path))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except (RuntimeError, OSError, AttributeError) as e:
    warnings.warn(f"CPU {what} kernel unavailable, using XLA's form instead: {e}")
    return False
  return True
