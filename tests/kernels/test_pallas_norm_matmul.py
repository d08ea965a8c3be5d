"""Our Pallas GPU kernel for RMSNorm then a matmul (interpret mode on CPU): the norm, the product,
the bias and SwiGLU as NumPy computes them; the shapes it refuses; and its lowering for a GPU at
the benchmark models' shapes (Triton's block rules are checked there, not in interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.kernels import choice, pallas_norm_matmul
from areal_jax.models import transformer

EPS = 1e-6


def _reference(x, scale, w, bias, glu):
  x = x.astype(np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale @ w.astype(np.float64)
  if glu:
    gate, up = y[:, 0::2], y[:, 1::2]
    y = gate / (1 + np.exp(-gate)) * up
  return y if bias is None else y + bias


@pytest.mark.parametrize("rows,d_in,d_out,glu,bias", [
    (5, 96, 48, False, False),  # rows padded to 16; blocks of 32 inputs, 16 outputs
    (20, 64, 256, True, False),  # 32 rows; SwiGLU over interleaved gate/up columns
    (3, 48, 80, False, True),  # the q/k/v projection's bias
    (64, 576, 960, False, False),  # the SmolLM2 shape's q/k/v projection
    (200, 64, 64, True, False),  # two blocks of 128 rows (the second padded), a program each
])
def test_the_kernel_computes_the_norm_the_matmul_and_swiglu(rows, d_in, d_out, glu, bias):
  rng = np.random.default_rng(rows)
  x = rng.normal(size=(rows, d_in)).astype(np.float32)
  scale = (1 + 0.2 * rng.normal(size=d_in)).astype(np.float32)
  w = (rng.normal(size=(d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)
  b = rng.normal(size=d_out // (2 if glu else 1)).astype(np.float32) if bias else None
  assert pallas_norm_matmul.usable(d_in, d_out // (2 if glu else 1))
  y = pallas_norm_matmul.norm_matmul(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(w),
                                     None if b is None else jnp.asarray(b), eps=EPS, glu=glu,
                                     interpret=True)
  assert y.shape == (rows, d_out // (2 if glu else 1)) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), _reference(x, scale, w, b, glu), rtol=2e-5, atol=2e-5)


def test_in_bfloat16_it_rounds_as_the_model_does():
  """bfloat16: the normalized rows and the products are rounded as the model's norm and matmul
  round them (within a unit of the last place of the outputs)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 128)), jnp.bfloat16)
  scale = jnp.asarray(1 + 0.2 * rng.normal(size=128), jnp.float32)
  w = jnp.asarray(rng.normal(size=(128, 64)) / 11, jnp.bfloat16)
  tuning = pallas_norm_matmul.NormTuning(block_n=16, warps=2, stages=1)
  y = pallas_norm_matmul.norm_matmul(x, scale, w, eps=EPS, tuning=tuning, interpret=True)
  ref = jnp.einsum("ni,io->no", transformer.rms_norm(x, scale, EPS), w)  # the model's rounding
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                             rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("block_n", [16, 32])
def test_in_bfloat16_swiglu_rounds_as_the_model_does(block_n):
  """``glu`` in bfloat16: the gate/up product rounded to bfloat16, its interleaved columns parted
  exactly, then ``jax.nn.silu(gate) * up`` as XLA computes it: equal up to the products' order."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(8, 128)), jnp.bfloat16)
  scale = jnp.asarray(1 + 0.2 * rng.normal(size=128), jnp.float32)
  w = jnp.asarray(rng.normal(size=(128, 128)) / 11, jnp.bfloat16)
  tuning = pallas_norm_matmul.NormTuning(block_n=block_n, warps=2, stages=1)
  y = pallas_norm_matmul.norm_matmul(x, scale, w, eps=EPS, glu=True, tuning=tuning,
                                     interpret=True)
  both = jnp.einsum("ni,io->no", transformer.rms_norm(x, scale, EPS), w)
  ref = jax.nn.silu(both[:, 0::2]) * both[:, 1::2]
  assert y.dtype == jnp.bfloat16 and y.shape == (8, 64)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                             rtol=2 ** -7, atol=1e-2)


def test_shapes_it_does_not_take_and_bad_launches_are_refused():
  assert not pallas_norm_matmul.usable(24, 64)  # no input block of 16
  assert not pallas_norm_matmul.usable(64, 40)  # no output block of 16
  with pytest.raises(ValueError, match="block_n=24"):
    pallas_norm_matmul.NormTuning(block_n=24)


def test_the_choice_is_off_unless_asked_and_names_a_bad_setting(monkeypatch):
  monkeypatch.delenv(choice.NORM_MATMUL_ENV, raising=False)
  assert choice.norm_matmuls("gpu", True) is None
  assert choice.norm_matmuls("gpu", True, "1") == pallas_norm_matmul.NormTuning()
  assert choice.norm_matmuls("gpu", True, "0") is None
  assert choice.norm_matmuls("gpu", False, "1") is None  # the kernel is not split over a mesh
  assert choice.norm_matmuls("tpu", True, "1") is None  # a Triton kernel
  monkeypatch.setenv(choice.NORM_MATMUL_ENV, "block_n=32,warps=8")
  assert choice.norm_matmuls("cpu", True) == pallas_norm_matmul.NormTuning(block_n=32, warps=8)
  with pytest.raises(ValueError, match="AREAL_JAX_DECODE_NORM_MATMUL.*'rows=2'"):
    choice.norm_matmuls("gpu", True, "rows=2")
  with pytest.raises(ValueError, match="AREAL_JAX_DECODE_NORM_MATMUL.*block_n=48"):
    choice.norm_matmuls("gpu", True, "block_n=48")


@pytest.mark.parametrize("rows,d_in,d_out,glu,bias", [
    (64, 576, 960, False, False), (64, 576, 3072, True, False),  # SmolLM2-135M
    (128, 1536, 2048, False, True), (128, 1536, 17920, True, False),  # Qwen2.5-1.5B
    (256, 1536, 17920, True, False)])  # 256 slots: two blocks of rows
def test_the_kernel_lowers_for_a_gpu_at_the_benchmark_shapes(rows, d_in, d_out, glu, bias):
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = [spec(rows, d_in), spec(d_in, dt=jnp.float32), spec(d_in, d_out)]
  args += [spec(d_out)] if bias else []
  fn = jax.jit(lambda *a: pallas_norm_matmul.norm_matmul(*a, eps=EPS, glu=glu))
  with choice.lowering_for("gpu"):
    text = choice.lower(fn, args, "cuda").as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1 and "norm_matmul" in text
