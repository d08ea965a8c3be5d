"""Expected faults of a run directory, reported to a person without a traceback (see launch.py)."""


class RunDirError(RuntimeError):
  """A damaged or unwritable checkpoint or weights directory; the message says what to do."""


# Exit status of a training process whose learner group lost a process: the supervisor
# (``supervisor.py``) reruns it, and it resumes from its last checkpoint (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75


class LearnerProcessDied(RuntimeError):
  """A process of the learner group exited or lost its connection; the group was torn down."""
