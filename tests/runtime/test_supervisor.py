"""The supervisor reruns a training process that lost its learner (or was killed) with resume, and
leaves clean exits, ordinary errors and exhausted restarts alone."""

import json
import sys

import pytest

from areal_jax.runtime import supervisor
from areal_jax.runtime.errors import RESTART_EXIT_CODE

# A stand-in training process: records its argv, then ends as told by the next code in the plan.
SCRIPT = """
import json, os, signal, sys
log, plan = sys.argv[1], json.loads(sys.argv[2])
runs = json.load(open(log)) if os.path.exists(log) else []
runs.append(dict(argv=sys.argv[3:], child=os.environ.get("AREAL_JAX_SUPERVISED")))
json.dump(runs, open(log, "w"))
code = plan[min(len(runs), len(plan)) - 1]
if code == "kill":
  os.kill(os.getpid(), signal.SIGKILL)
sys.exit(code)
"""


def run(tmp_path, plan, max_restarts):
  log = tmp_path / "runs.json"
  cmd = [sys.executable, "-c", SCRIPT, str(log), json.dumps(plan), "--config.x=1"]
  rc = supervisor.supervise(cmd, max_restarts)
  return rc, json.loads(log.read_text())


def test_lost_learner_and_killed_driver_restart_with_resume(tmp_path, capfd):
  rc, runs = run(tmp_path, [RESTART_EXIT_CODE, "kill", 0], max_restarts=3)
  assert rc == 0 and len(runs) == 3
  assert runs[0]["argv"] == ["--config.x=1"]
  assert all(r["argv"] == ["--config.x=1", supervisor.RESUME_FLAG] for r in runs[1:])
  assert all(r["child"] == "1" for r in runs)  # the child does not supervise itself
  err = capfd.readouterr().err
  assert "lost a learner process; restart 1/3" in err and "killed by SIGKILL; restart 2/3" in err


@pytest.mark.parametrize("plan,max_restarts,rc,n_runs", [
    ([1], 3, 1, 1),  # an ordinary error would fail again: not restarted
    ([RESTART_EXIT_CODE], 2, RESTART_EXIT_CODE, 3),  # restarts used up
    (["kill"], 0, 128 + 9, 1),
])
def test_no_restart(tmp_path, plan, max_restarts, rc, n_runs):
  got_rc, runs = run(tmp_path, plan, max_restarts)
  assert (got_rc, len(runs)) == (rc, n_runs)
