"""The lifeline the vLLM server runs under: the server, and what it starts, never outlive the process
that started it. Plain processes stand in for the server here (no vLLM needed); test_server.py
checks the real one."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_jax.vllm_rollout import lifeline

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX process groups")

# CMD: writes its pid, starts a child in its own group (the engine core of a vLLM server) that
# writes its pid, then sleeps, or exits with EXIT. IGNORE=1: the child ignores SIGTERM.
_CMD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out, ignore, code = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    child = ("import os, signal, sys, time\\n"
             + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore else "")
             + "open(sys.argv[1], 'w').write(str(os.getpid()))\\n"
             + "time.sleep(600)\\n")
    subprocess.Popen([sys.executable, "-c", child, out + ".child"])
    open(out + ".cmd", "w").write(str(os.getpid()))
    while not os.path.exists(out + ".child"):
        time.sleep(0.01)
    if code >= 0:
        sys.exit(code)
    time.sleep(600)
""")


def _cmd(out, ignore_term=False, exit_code=-1):
  return [sys.executable, "-c", _CMD, str(out), "1" if ignore_term else "0", str(exit_code)]


def _alive(pid: int) -> bool:
  """Runs (a zombie, left for a reaper that may never come, does not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _pids(out, timeout=30.0):
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      with open(f"{out}.cmd", encoding="utf-8") as a, open(f"{out}.child", encoding="utf-8") as b:
        return int(a.read()), int(b.read())
    except (OSError, ValueError):
      time.sleep(0.02)
  raise TimeoutError(f"{out}: the command did not start")


def _gone(pids, timeout):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if not any(_alive(p) for p in pids):
      return True
    time.sleep(0.05)
  return False


@pytest.fixture
def run(tmp_path):
  """``run(...) -> (Popen, out)``: starts a lifeline over ``_cmd`` (or ``argv``, as it is);
  whatever is left runs until the test ends, then is killed."""
  out, procs = tmp_path / "run", []

  def start(ignore_term=False, exit_code=-1, grace_s=30.0, owner=None, argv=None):
    argv = argv or lifeline.command(_cmd(out, ignore_term, exit_code), owner=owner or os.getpid(),
                                    grace_s=grace_s, pid_file=f"{out}.pidfile")
    procs.append(subprocess.Popen(argv, start_new_session=True))
    return procs[-1], out

  yield start
  for proc in procs:
    proc.kill()
  for suffix in (".cmd", ".child"):
    try:
      with open(f"{out}{suffix}", encoding="utf-8") as f:
        os.kill(int(f.read()), signal.SIGKILL)
    except (OSError, ValueError):
      pass


def test_owner_killed_by_sigkill_stops_the_command_and_its_children(run, tmp_path):
  """The owner runs no exit handler; the lifeline sees it gone and stops CMD's whole group."""
  out = tmp_path / "run"
  owner_src = textwrap.dedent(f"""
      import os, subprocess, sys, time
      from areal_jax.vllm_rollout import lifeline
      subprocess.Popen(lifeline.command({_cmd(out)!r}, owner=os.getpid(), grace_s=30.0,
                                        pid_file={str(out) + ".pidfile"!r}),
                       start_new_session=True)
      time.sleep(600)
  """)
  owner, _ = run(argv=[sys.executable, "-c", owner_src])
  cmd_pid, child_pid = _pids(out)
  with open(f"{out}.pidfile", encoding="utf-8") as f:
    assert int(f.read()) == cmd_pid  # the pid file names CMD
  assert os.getpgid(child_pid) == cmd_pid  # CMD leads the group its children are in
  owner.kill()
  owner.wait()
  assert _gone([cmd_pid, child_pid], timeout=20), "CMD or its child outlived the owner"


def test_sigterm_stops_the_group_and_sigkills_what_ignores_it(run):
  proc, out = run(ignore_term=True, grace_s=1.0)
  cmd_pid, child_pid = _pids(out)
  proc.terminate()  # what VllmServerEngine.close does
  proc.wait(timeout=30)
  # the lifeline returns after the group is gone: the child that ignored SIGTERM was killed
  assert not _alive(cmd_pid) and not _alive(child_pid)


def test_command_exit_status_passes_through_and_its_leftovers_are_stopped(run):
  proc, out = run(exit_code=3)
  assert proc.wait(timeout=60) == 3
  _, child_pid = _pids(out)
  assert not _alive(child_pid)


def test_nothing_starts_when_the_owner_is_already_gone(run):
  proc, out = run(owner=1)  # pid 1 is not the lifeline's parent
  assert proc.wait(timeout=60) == 1
  assert not os.path.exists(f"{out}.cmd") and not os.path.exists(f"{out}.pidfile")


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_killed_lifeline_leaves_no_orphan_behind_a_guarded_module(run, tmp_path, monkeypatch,
                                                                     ignore_term):
  """Ray SIGKILLs a worker's direct children when the worker exits: the lifeline, not the server.
  The server, run as a guarded module, sees its parent gone and stops its group; a reaper
  SIGKILLs what ignores SIGTERM."""
  (tmp_path / "fake_server.py").write_text(_CMD)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
  out = tmp_path / "run"
  guarded = lifeline.guarded("fake_server", _cmd(out, ignore_term)[3:], grace_s=1.0)
  proc, _ = run(argv=lifeline.command(guarded, owner=os.getpid(), grace_s=30.0,
                                      pid_file=f"{out}.pidfile"))
  server_pid, child_pid = _pids(out)
  with open(f"{out}.pidfile", encoding="utf-8") as f:
    assert int(f.read()) == server_pid  # the guarded module runs in the process the lifeline began
  proc.kill()
  proc.wait()
  assert _gone([server_pid, child_pid], timeout=20), "the guarded module outlived its lifeline"


def test_a_guarded_module_whose_lifeline_died_before_it_started_stops_at_once(run, tmp_path,
                                                                              monkeypatch):
  """The lifeline names itself to the module (``PARENT_ENV``), so a guard that starts after the
  lifeline was killed does not take its new parent for the lifeline and run on forever."""
  (tmp_path / "fake_server.py").write_text(_CMD)
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  monkeypatch.setenv(lifeline.PARENT_ENV, str(dead.pid))
  out = tmp_path / "run"
  proc, _ = run(argv=lifeline.guarded("fake_server", _cmd(out)[3:], grace_s=1.0))
  assert proc.wait(timeout=30) == -signal.SIGTERM, "the guard took its parent for the lifeline"
  child = f"{out}.child"  # (stopped at once: it may not have started its child)
  assert not os.path.exists(child) or _gone([int(pathlib.Path(child).read_text())], 20)


def test_no_command_is_an_error():
  proc = subprocess.run(lifeline.command([], owner=os.getpid(), grace_s=1.0, pid_file=""),
                        capture_output=True, text=True, timeout=60, check=False)
  assert proc.returncode == 2 and "no command" in proc.stderr
