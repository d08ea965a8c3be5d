"""Runs untrusted Python programs in a child process isolated by the operating system.

Every ``Sandbox.run(code)`` starts a fresh child, ``unshare --net --mount --pid --fork
--kill-child --mount-proc`` (util-linux; plus ``--map-root-user`` when not root) running
``sandbox_init.py``, which sets it up and then ``execve``s the interpreter on the code. What the
program gets:

- no network: a network namespace of its own with only a loopback interface, which is down, so
  even 127.0.0.1 is unreachable;
- a private, read-only view of the system's directories (/usr, /etc, /lib, /dev, ...; every
  other top-level directory, /home, /root, /var, /sys and the project's among them, is an empty
  tmpfs to it, but for the interpreter's own directory); the only writable places are fresh tmpfs
  mounts (``/tmp``, ``/dev/shm``, each at most ``max_file_mib``) that vanish with the run; the
  program starts in ``/tmp/work``;
- a PID namespace: it sees only its own processes and cannot signal any other; when its main
  process ends, the kernel kills every process it started;
- started by root, its own unprivileged uid (drawn from ``UID_RANGE``); started by another user,
  uid 1000 of a user namespace of its own; either way no capabilities and no new privileges;
- resource limits of the kernel: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), processes
  (RLIMIT_NPROC), file size (RLIMIT_FSIZE), 64 open files; a wall-clock limit enforced here;
  stdout and stderr read up to ``max_output_bytes`` together, beyond which the run is killed.

The child leads a process group of its own (``start_new_session``), and every run ends with
``os.killpg(SIGKILL)`` of that group. Python-level checks play no part in the isolation.

Isolation needs Linux >= 5.12 (``mount_setattr``), util-linux ``unshare``, and either root or
unprivileged user namespaces. ``Sandbox`` probes for them when built (a real run that must see
no network interface but ``lo``). Where the probe fails, it logs why, and ``run`` refuses with
``SandboxUnavailable`` unless built with ``allow_unisolated=True``: then programs run with the
resource limits, the process group and a temporary directory only (no namespaces: the program
can reach the network and the files of the user running it, and as root RLIMIT_NPROC does not
bind).

The environment interface of ``areal_jax.envs`` (``PythonEnv``) wraps this for the workflows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import random
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

log = logging.getLogger(__name__)

INIT = pathlib.Path(__file__).with_name("sandbox_init.py")
SETUP_FAILED = 125  # sandbox_init.SETUP_FAILED
# As root, each run's uid and gid, drawn at random (not checked against the system's users).
UID_RANGE = (1 << 20, 1 << 21)
# Why a run ended.
REASONS = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "sandbox_error")


class SandboxUnavailable(RuntimeError):
  """No isolation can be made here and unisolated runs were not allowed."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use. The keys of ``rollout.python_tool`` carry the same names."""

  wall_s: float = 10.0  # wall-clock seconds, then the process group is killed
  cpu_s: int = 5  # CPU seconds of each process (RLIMIT_CPU; SIGKILL at the limit)
  memory_mib: int = 512  # address space of each process (RLIMIT_AS)
  max_processes: int = 16  # processes of the run's uid at once (RLIMIT_NPROC)
  max_file_mib: int = 16  # largest file (RLIMIT_FSIZE) and size of each writable tmpfs
  max_output_bytes: int = 65536  # stdout + stderr kept; more kills the run
  max_code_bytes: int = 65536  # longer programs are not run

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if not getattr(self, f.name) > 0:
        raise ValueError(f"sandbox limit {f.name}={getattr(self, f.name)!r} must be > 0")


@dataclasses.dataclass
class Result:
  """How a run went. ``reason`` is one of ``REASONS``; ``exit_code`` is the program's (negative:
  killed by that signal; an exit status above 128 reads as a signal; None: not reaped);
  ``truncated``: output past the limit was dropped; ``cpu_s``: CPU time of all its processes."""

  stdout: str
  stderr: str
  reason: str
  exit_code: int | None = None
  truncated: bool = False
  wall_s: float = 0.0
  cpu_s: float = 0.0

  @property
  def ok(self) -> bool:
    return self.reason == "ok"


class Sandbox:
  """Runs Python programs under ``limits``, isolated where the kernel allows (see the module).

  ``unshare``: the util-linux program (a name on PATH or a path); ``python``: the interpreter the
  programs run on (default: this one's). Thread-safe: runs share nothing but the settings.
  """

  def __init__(self, limits: Limits | None = None, *, allow_unisolated: bool = False,
               unshare: str = "unshare", python: str | None = None):
    self.limits = limits or Limits()
    self.allow_unisolated = bool(allow_unisolated)
    self.python = os.path.realpath(python or sys.executable)
    # The interpreter's installation (bound back into the namespace where its directory is hidden).
    home = os.path.realpath(sysconfig.get_config_var("prefix") or sys.prefix)
    self._home = (home if self.python.startswith(home + os.sep)
                  else os.path.dirname(os.path.dirname(self.python)))
    self._unshare = shutil.which(unshare)
    self._root = os.geteuid() == 0
    self.isolated, self.unavailable = False, ""
    self._probe()

  # -- the probe ------------------------------------------------------------------------------

  def _probe(self):
    if self._unshare is None:
      self.unavailable = "util-linux 'unshare' not found"
    else:
      self.isolated = True
      r = self._run("print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev')"
                    ".readlines()[2:]))")
      if not (r.ok and r.stdout.strip() == "['lo']"):
        self.isolated = False
        why = (r.stderr.strip().splitlines() or [r.reason])[-1]
        self.unavailable = f"namespaces could not be made ({why})"
    if self.unavailable:
      log.warning("python sandbox: no isolation on this machine: %s; %s", self.unavailable,
                  "programs run with resource limits only (allow_unisolated)"
                  if self.allow_unisolated else "untrusted programs will not be run "
                  "(rollout.python_tool.allow_unisolated=True runs them without isolation)")

  def check(self) -> None:
    """Raises ``SandboxUnavailable`` unless programs may run here."""
    if not self.isolated and not self.allow_unisolated:
      raise SandboxUnavailable(
          f"the Python sandbox cannot isolate programs on this machine: {self.unavailable}. "
          "It needs util-linux unshare, Linux >= 5.12 and root or unprivileged user namespaces; "
          "rollout.python_tool.allow_unisolated=True runs programs with resource limits only")

  # -- runs -----------------------------------------------------------------------------------

  def run(self, code: str) -> Result:
    """Runs ``code`` as ``main.py`` and returns its bounded output and why it ended."""
    self.check()
    if not isinstance(code, str):
      raise TypeError(f"code must be a string, got {type(code).__name__}")
    if len(code.encode("utf-8", "replace")) > self.limits.max_code_bytes:
      return Result("", f"program longer than {self.limits.max_code_bytes} bytes", "error")
    return self._run(code)

  def _argv(self, spec_path: str) -> list[str]:
    init = [self.python, "-I", "-S", "-B", str(INIT), spec_path]
    if not self.isolated:
      return init
    ns = [self._unshare, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if not self._root:
      ns.insert(1, "--map-root-user")
    return ns + ["--"] + init

  def _run(self, code: str) -> Result:
    lim = self.limits
    uid = random.SystemRandom().randrange(*UID_RANGE) if self.isolated and self._root else None
    spec = dict(limits=dataclasses.asdict(lim), namespaces=self.isolated, uid=uid,
                python=self.python, python_home=self._home)
    with tempfile.TemporaryDirectory(prefix="areal_sandbox_") as tmp:
      spec_path = os.path.join(tmp, "spec.json")
      with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
      with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
      t0 = time.monotonic()
      proc = subprocess.Popen(self._argv(spec_path), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                              start_new_session=True, close_fds=True)
      pipes, status, cpu = _Pipes(proc, lim.max_output_bytes), None, 0.0
      try:
        killed = pipes.read(t0 + lim.wall_s)
        # The pipes closed: the process ends, or runs on after closing them itself.
        status, cpu = (None, 0.0) if killed else _reap(proc, t0 + lim.wall_s)
        if status is None and not killed:
          killed = "timeout"
      finally:
        _kill_group(proc.pid)
        # End of file: every process that held the pipes is gone (the whole PID namespace).
        pipes.read(time.monotonic() + 10.0, keep=False)
        pipes.close()
      if status is None:
        status, cpu = _reap(proc, time.monotonic() + 10.0)
      wall = time.monotonic() - t0
    stdout, stderr = (bytes(b).decode("utf-8", "replace") for b in pipes.kept)
    code_ = None if status is None else os.waitstatus_to_exitcode(status)
    proc.returncode = code_  # reaped here (os.wait4, for the CPU time), not by Popen
    if code_ is not None and 128 < code_ < 128 + signal.NSIG:  # the supervisor's report
      code_ = 128 - code_
    return Result(stdout, stderr, _reason(killed, code_, cpu, lim, stderr), code_,
                  killed == "output_limit", round(wall, 3), round(cpu, 3))


class _Pipes:
  """The child's stdout and stderr, read without blocking; at most ``budget`` bytes kept."""

  def __init__(self, proc, budget: int):
    self.files, self.budget, self.total = (proc.stdout, proc.stderr), budget, 0
    self.kept = (bytearray(), bytearray())
    self.sel = selectors.DefaultSelector()
    for i, f in enumerate(self.files):
      os.set_blocking(f.fileno(), False)
      self.sel.register(f.fileno(), selectors.EVENT_READ, i)

  def read(self, deadline: float, keep: bool = True) -> str | None:
    """Reads until both pipes close (None), the deadline passes ("timeout") or, when keeping,
    more than the budget came ("output_limit")."""
    while self.sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        return "timeout"
      for key, _ in self.sel.select(timeout=left):
        try:
          chunk = os.read(key.fd, 65536)
        except BlockingIOError:
          continue
        if not chunk:
          self.sel.unregister(key.fd)
        elif keep:
          self.kept[key.data].extend(chunk[:max(self.budget - self.total, 0)])
          self.total += len(chunk)
          if self.total > self.budget:
            return "output_limit"
    return None

  def close(self) -> None:
    self.sel.close()
    for f in self.files:
      f.close()


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _reap(proc, deadline: float):
  """Waits for the child until ``deadline``; returns (wait status or None, its CPU seconds with
  those of the processes it waited for)."""
  while time.monotonic() < deadline:
    pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      return status, ru.ru_utime + ru.ru_stime
    time.sleep(0.005)
  return None, 0.0


def _reason(killed, exit_code, cpu_s, lim: Limits, stderr: str) -> str:
  if killed:
    return killed
  if exit_code == 0:
    return "ok"
  if exit_code == SETUP_FAILED and stderr.startswith("sandbox setup failed"):
    return "sandbox_error"
  # RLIMIT_CPU: SIGKILL at the limit (the CPU time the kernel reports for a killed child runs
  # a little below the limit's own count: up to 13% below it on a loaded machine).
  if exit_code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu_s >= 0.75 * lim.cpu_s:
    return "cpu_limit"
  last = (stderr.strip().splitlines() or [""])[-1]
  if last.startswith("MemoryError"):
    return "memory_limit"
  return "error"
