"""Worker processes a test starts and always stops (test_distributed.py, test_checkpoint.py)."""

import contextlib
import subprocess


@contextlib.contextmanager
def running(cmds, env=None):
  """One process per command (stdout and stderr together, as text); whatever is still running on
  leaving the block is killed."""
  procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for cmd in cmds]
  try:
    yield procs
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
