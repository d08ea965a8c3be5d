"""``bench/common.py``'s read probe: off CPU it reads its buffer ``Hardware.READS`` times in one
call, each pass a full read whose result counts (so none is hoisted or shared), and its bandwidth
counts every pass."""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import common  # noqa: E402


def test_passes_sum_each_pass_of_the_whole_buffer():
  x = jnp.arange(4096 * 8, dtype=jnp.float32) / 1000
  for reduce in (jnp.sum, lambda x: x.reshape(-1, 4096).sum(0),
                 lambda x: x.reshape(-1, 4096).sum(1)):
    got = jax.jit(functools.partial(common._passes, reduce, 3))(x)
    np.testing.assert_allclose(got, (1 + 2 + 3) * reduce(x), rtol=1e-5)
    np.testing.assert_allclose(common._passes(reduce, 1, x), reduce(x), rtol=1e-6)


def test_read_bandwidth_counts_every_pass():
  hw = common.Hardware()
  assert hw.reads == 1  # (CPU: one pass a call, as before)
  hw.read_s, hw.reads = 0.004, 8  # eight passes of the buffer timed at 4 ms
  assert np.isclose(hw.figures()["read_GBps"], 8 * hw.x.nbytes / 0.004 / 1e9)
