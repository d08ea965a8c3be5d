"""The Python sandbox: limits of the kernel stop hostile programs, namespaces keep them in."""

import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
import uuid

import pytest

from areal_jax.envs.python_sandbox import Limits, Sandbox, SandboxUnavailable

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAST = Limits(wall_s=20.0, cpu_s=1, memory_mib=256, max_processes=8, max_output_bytes=4096)


@pytest.fixture(scope="module")
def box():
  s = Sandbox(FAST)
  if not s.isolated:
    pytest.skip(f"no namespaces on this machine: {s.unavailable}")
  return s


def unisolated(limits=FAST):
  """A sandbox whose probe fails (no unshare program at that path), run without isolation."""
  return Sandbox(limits, unshare="/nonexistent/unshare", allow_unisolated=True)


def processes_with(marker: str) -> list[int]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def gone(marker: str, wait_s: float = 10.0) -> bool:
  """No process carries ``marker`` (waits for ones the kernel is still tearing down)."""
  end = time.monotonic() + wait_s
  while processes_with(marker) and time.monotonic() < end:
    time.sleep(0.05)
  return not processes_with(marker)


def test_a_program_runs_and_its_output_comes_back(box):
  r = box.run("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
  assert r.ok and r.exit_code == 0 and r.stdout == "42\n" and r.stderr == "warn\n"
  r = box.run("raise ValueError('bad')")
  assert r.reason == "error" and r.exit_code == 1 and r.stderr.strip().endswith("ValueError: bad")


def test_runs_from_many_threads_at_once_stay_apart(box):
  """Episodes run the tool from threads of their own: each run gets its own output (and a text
  that is no valid UTF-8, here a lone surrogate in a comment, still makes a program)."""
  from concurrent.futures import ThreadPoolExecutor
  code = "import os\nprint({i}, os.getpid(), sorted(os.listdir('.')))  # \ud800"
  with ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda i: box.run(code.format(i=i)), range(8)))
  for i, r in enumerate(results):
    assert r.ok and r.stdout == f"{i} 2 ['main.py']\n", r


def test_an_endless_loop_is_stopped_by_the_cpu_limit(box):
  r = box.run("while True:\n  pass")
  assert r.reason == "cpu_limit" and r.exit_code == -9 and r.cpu_s > 0.5


def test_a_sleeper_and_its_children_are_killed_at_the_wall_limit(box):
  marker = f"sandbox-marker-{uuid.uuid4().hex}"
  code = textwrap.dedent(f"""
      import os, subprocess, sys, time
      subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # {marker}"])
      if os.fork() == 0:
        os.setsid()  # leaves the process group: the PID namespace still ends it
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)  # {marker}"])
      time.sleep(600)
  """)
  r = Sandbox(Limits(wall_s=2.0)).run(code)
  assert r.reason == "timeout" and r.exit_code == -9
  assert gone(marker)


def test_ten_gigabytes_are_refused(box):
  r = box.run("x = bytearray(10 * 2**30)")
  assert r.reason == "memory_limit" and r.stderr.strip().endswith("MemoryError")
  r = box.run("x = []\nwhile True:\n  x.append(bytearray(2**20))")
  assert r.reason == "memory_limit"


def test_a_fork_bomb_is_bounded(box):
  marker = f"sandbox-marker-{uuid.uuid4().hex}"
  code = textwrap.dedent(f"""
      import os, sys
      n = 0
      for _ in range(100):
        try:
          pid = os.fork()
        except OSError:
          break
        if pid == 0:
          os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)  # {marker}"])
        n += 1
      print(n)
  """)
  r = box.run(code)
  assert r.ok and int(r.stdout) < FAST.max_processes
  assert gone(marker)  # the program ended: the kernel ended every process it started
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  r = Sandbox(Limits(wall_s=1.0, cpu_s=1, max_processes=8)).run(bomb)
  assert r.reason in ("timeout", "cpu_limit")


def test_ten_megabytes_or_a_gigabyte_of_output_are_cut(box):
  r = box.run("print('x' * 10_000_000)")
  assert r.reason == "output_limit" and r.truncated
  assert r.stdout == "x" * FAST.max_output_bytes and r.stderr == ""
  r = box.run("import sys\nfor _ in range(1024):\n  sys.stderr.write('y' * 2**20)")
  assert r.reason == "output_limit" and r.stderr == "y" * FAST.max_output_bytes


def test_no_network_inside_even_to_loopback(box):
  server = socket.create_server(("127.0.0.1", 0))
  server.settimeout(0.5)
  port = server.getsockname()[1]
  code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
          "print('connected')")
  try:
    r = box.run(code)
    assert r.reason == "error" and "connected" not in r.stdout
    assert "Network is unreachable" in r.stderr
    with pytest.raises(socket.timeout):
      server.accept()
    # The same program outside the namespace reaches the server: the check above can fail.
    r = unisolated().run(code)
    assert r.ok and r.stdout == "connected\n"
    server.accept()[0].close()
  finally:
    server.close()


def test_files_stay_in_the_run_and_the_host_is_out_of_reach(box, tmp_path, monkeypatch):
  secret = tmp_path / "secret.txt"
  secret.write_text("s3cret")
  outside = tmp_path / "written.txt"
  runs = tmp_path / "runs"
  runs.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(runs))  # where the sandbox makes its directory
  code = textwrap.dedent(f"""
      import os
      open("scratch.txt", "w").write("data")
      print(os.getcwd(), sorted(os.listdir(".")))
      for path in ({str(secret)!r}, {str(ROOT / "README.md")!r}):
        try:
          print(open(path).read())
        except OSError as e:
          print("read", type(e).__name__)
      for path in ({str(outside)!r}, {str(ROOT / "sandbox_was_here.txt")!r}, "/etc/x", "/usr/x"):
        try:
          open(path, "w").write("x")
          print("wrote", path)
        except OSError as e:
          print("write", type(e).__name__)
      os.kill(os.getppid(), 9)
  """)
  r = box.run(code)
  assert r.stdout.startswith("/tmp/work ['main.py', 'scratch.txt']")
  assert "s3cret" not in r.stdout and "areal_jax" not in r.stdout and "wrote" not in r.stdout
  assert r.stdout.count("read FileNotFoundError") == 2 and r.stdout.count("write ") == 4
  assert r.stderr.strip().endswith("PermissionError: [Errno 1] Operation not permitted")
  assert not outside.exists() and not (ROOT / "sandbox_was_here.txt").exists()
  assert list(runs.iterdir()) == []  # the run's directory was removed


def test_without_namespaces_it_refuses_unless_allowed(caplog):
  with caplog.at_level(logging.WARNING, logger="areal_jax.envs.python_sandbox"):
    refusing = Sandbox(FAST, unshare="/nonexistent/unshare")
  assert not refusing.isolated and "unshare" in refusing.unavailable
  assert "untrusted programs will not be run" in caplog.text
  with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
    refusing.run("print(1)")
  r = unisolated().run("import os\nprint(os.getcwd())")
  assert r.ok and os.path.basename(r.stdout.strip()).startswith("areal_sandbox_")
  assert unisolated().run("while True:\n  pass").reason == "cpu_limit"  # the limits still hold


def test_limits_are_checked():
  with pytest.raises(ValueError, match="wall_s=0"):
    Limits(wall_s=0)
  r = unisolated(Limits(max_code_bytes=10)).run("print('a long program')")
  assert r.reason == "error" and "longer than 10 bytes" in r.stderr


NON_ROOT_CHECK = """
import ctypes, json, os
from areal_jax.envs.python_sandbox import Limits, Sandbox
box = Sandbox(Limits(wall_s=20.0, cpu_s=1), python={python!r})
undo = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]
print(os.getuid(), caps, libc.umount2(b'/work', 2), libc.mount(None, b'/', None, 32 | 4096, None))
'''
out = dict(isolated=box.isolated, why=box.unavailable)
if box.isolated:
  for name, code in (("undo", undo), ("write", "open('/etc/x', 'w')"), ("loop", "while True: pass"),
                     ("net", "import socket; socket.create_connection(('127.0.0.1', 1), timeout=1)")):
    r = box.run(code)
    out[name] = [r.reason, r.stdout.strip(), (r.stderr.strip().splitlines() or [''])[-1]]
print(json.dumps(out))
"""


def test_a_non_root_user_gets_the_same_isolation():
  """Started by a user who is not root, the sandbox makes a user namespace; the program ends up
  without capabilities and cannot unmount or remount anything."""
  python = "/usr/bin/python3"
  setpriv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
  if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(python):
    pytest.skip("needs root (to become another user), setpriv and a system python3")
  if subprocess.run(setpriv + [python, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                    "import areal_jax.envs.python_sandbox"], capture_output=True).returncode:
    pytest.skip("the system python3 cannot import the sandbox as another user")
  done = subprocess.run(setpriv + [python, "-c", NON_ROOT_CHECK.format(python=python)],
                        capture_output=True, text=True, timeout=300,
                        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
  out = json.loads(done.stdout.strip().splitlines()[-1])
  if not out["isolated"]:
    pytest.skip(f"no user namespaces for non-root users here: {out['why']}")
  # uid 1000 of its own user namespace, no capability, umount and remount refused (-1)
  assert out["undo"] == ["ok", "1000 0000000000000000 -1 -1", ""]
  assert out["write"][0] == "error" and "Read-only file system" in out["write"][2]
  assert out["loop"][0] == "cpu_limit"
  assert out["net"][0] == "error" and "Network is unreachable" in out["net"][2]
