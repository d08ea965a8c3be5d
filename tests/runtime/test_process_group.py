"""A learner process's error reaches the driver as the fault it is: a fault a person fixes keeps
its type and a one-line message (its traceback only as a note), other errors their nearest
builtin type, and replies in the older form (one type name, the traceback in the message) still
raise."""

import pytest

from areal_jax import cli
from areal_jax.config import ConfigError
from areal_jax.learner import memory
from areal_jax.models import CheckpointError
from areal_jax.runtime import process_group
from areal_jax.runtime.errors import RunDirError


def _round_trip(error, process=1):
  """``error`` raised in a worker, its reply sent, and the driver's exception for it."""
  try:
    raise error
  except Exception as e:  # pylint: disable=broad-except
    reply = process_group.error_reply(e)
  assert reply[0] == "error"
  return process_group.worker_error(process, *reply[1:])


@pytest.mark.parametrize("error", [ConfigError("actor.lr=-1 must be >= 0"),
                                   CheckpointError("model.source: /x is not there"),
                                   RunDirError("checkpoint 3 does not fit this run")])
def test_faults_keep_their_type_and_one_line(error):
  raised = _round_trip(error)
  assert type(raised) is type(error)
  assert str(raised) == f"learner process 1: {error}"
  assert "Traceback" not in str(raised)
  (note,) = raised.__notes__
  assert note.startswith("learner process 1's traceback:\nTraceback")
  assert f"{type(error).__name__}: {error}" in note


def test_other_errors_take_the_nearest_known_base():
  plan = _round_trip(memory.DoesNotFit("actor.micro_batch_tokens=64 does not fit", None))
  assert type(plan) is MemoryError and isinstance(plan, cli.fault_kinds())
  assert str(plan) == "learner process 1: DoesNotFit: actor.micro_batch_tokens=64 does not fit"
  missing = _round_trip(KeyError("params"), process=0)
  assert type(missing) is LookupError and str(missing) == "learner process 0: KeyError: 'params'"

  class Unknown(Exception):
    pass

  bug = _round_trip(Unknown("boom"))
  assert type(bug) is RuntimeError and not isinstance(bug, cli.fault_kinds())
  assert str(bug) == "learner process 1: Unknown: boom"


def test_older_replies_still_raise():
  old = process_group.worker_error(0, "FloatingPointError", "non-finite loss\nTraceback ...")
  assert type(old) is FloatingPointError and str(old).startswith("learner process 0: non-finite")
  assert not getattr(old, "__notes__", None)
  assert type(process_group.worker_error(0, "SomethingElse", "x")) is RuntimeError


def test_a_worker_fault_ends_the_command_line_in_one_line(capsys):
  with pytest.raises(SystemExit) as exit_:
    with cli.reported_faults():
      raise _round_trip(ConfigError("actor.lr=-1 must be >= 0"))
  assert exit_.value.code == 1
  assert capsys.readouterr().err == "error: learner process 1: actor.lr=-1 must be >= 0\n"
