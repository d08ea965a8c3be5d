"""Expected faults of a run directory, reported to a person without a traceback (see launch.py)."""


class RunDirError(RuntimeError):
  """A damaged or unwritable checkpoint or weights directory; the message says what to do."""
