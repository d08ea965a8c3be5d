"""A program's device memory: XLA's analysis, or, where a TPU's compiler refuses a program for want
of memory, a cost that does not fit (so a plan tries a smaller one instead of stopping)."""

import jax
import jax.numpy as jnp
import pytest

from areal_jax import program_memory, sharding

# libtpu's message compiling a 16k-token train step for a 16 GiB v5e chip
REFUSAL = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (23.91G) exceeds available HBM (15.75G).")


class Refused:
  def __init__(self, message):
    self.message = message

  def compile(self):
    raise jax.errors.JaxRuntimeError(self.message)


def test_compiled_costs_come_from_xla():
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  cost = program_memory.cost(jax.jit(lambda a: (a @ a).sum(0)).lower(x), (x,))
  assert cost["args"] == 256 * 256 * 4 and cost["out"] == 256 * 4 and "refused" not in cost


def test_a_refused_program_costs_what_the_compiler_said_it_needed():
  mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
  arg = jax.ShapeDtypeStruct((1024, 8), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
  cost = program_memory.cost(Refused(REFUSAL), (arg,))
  assert cost == dict(args=512 * 8 * 4, out=0, alias=0, temp=int(23.91 * 2**30), refused=True)
  other = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory " \
          "space hbm. Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G."
  assert program_memory.cost(Refused(other), ())["temp"] == int(20.5 * 2**30)
  assert program_memory.cost(Refused("RESOURCE_EXHAUSTED: no size"), ())["temp"] \
      == program_memory.UNKNOWN
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
    program_memory.cost(Refused("INVALID_ARGUMENT: a bug"), ())
