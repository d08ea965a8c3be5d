"""What a compiled program needs of a device's memory, for the learner's and the sampler's plans.

``cost(lowered, args)``: XLA's memory analysis of the compiled program (bytes of arguments,
outputs, outputs aliased to donated arguments, temporaries, per device). A TPU's compiler checks a
program's buffers against the device's memory while compiling and refuses one that does not fit
("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries
(23.91G) exceeds available HBM (15.75G)", from libtpu compiling a train step for a v5e chip): a
plan then gets a cost that does not fit (the bytes the compiler said it needed, beside the
arguments), marked ``refused``, and tries a smaller program, where an exception would have
stopped it.
"""

from __future__ import annotations

import re

import jax

from areal_jax import sharding

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# the bytes a refusing compiler says it needed, in the two phrasings seen from libtpu
_NEEDED = (re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)"),
           re.compile(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm"))
UNKNOWN = 2**50  # the temporaries of a refused program whose message names no size


def refused(error: Exception) -> bool:
  """Whether ``error`` is a compiler refusing a program for want of device memory."""
  return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def cost(lowered, args) -> dict:
  """``{args, out, alias, temp}`` bytes per device of ``lowered`` compiled; where the compiler
  refuses it for want of memory, ``temp`` the bytes it said it needed, ``args`` those of ``args``
  (abstract values with shardings) and ``refused`` True."""
  try:
    m = lowered.compile().memory_analysis()
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if not refused(e):
      raise
    needed = next((m for m in (r.search(text) for r in _NEEDED) if m), None)
    temp = int(float(needed[1]) * _UNITS[needed[2]]) if needed else UNKNOWN
    return dict(args=sharding.device_bytes(args), out=0, alias=0, temp=temp, refused=True)
  return dict(args=m.argument_size_in_bytes, out=m.output_size_in_bytes,
              alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
