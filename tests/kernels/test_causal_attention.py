"""The flash kernels of whole rows' causal attention (a training step's, a prefill's): what they
compute against a float64 NumPy reference and the dense form's gradients (Pallas interpret mode on
CPU), on a mesh (``shard_map``), and lowered as a TPU or a GPU compiles them."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax import sharding
from areal_jax.kernels import causal_attention, choice
from areal_jax.models.transformer import causal_attention as dense_causal, packed_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from common import QWEN3_1P7B, QWEN25_1P5B, SMOLLM2  # noqa: E402

KERNELS = ("pallas_gpu", "pallas_tpu")

# jitted: one program a call, not the wrapper's ops (and their gradients) compiled one by one
_attend = jax.jit(causal_attention.attend, static_argnames=("impl", "interpret"))


def _inputs(b, length, h, kv, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, length, h, d), jnp.float32)
  k, v = (jax.random.normal(x, (b, length, kv, d), jnp.float32) for x in ks[1:])
  return q, k, v


def _segments(b, length):
  """Packed rows: row 0 holds sequences of 50 and 60 tokens then padding, row 1 one sequence
  and padding."""
  ids = np.zeros((b, length), np.int32)
  ids[0, :50], ids[0, 50:110] = 1, 2
  ids[1:, :length - 7] = 1
  return jnp.asarray(ids)


def _reference(q, k, v, ids):
  """float64 NumPy: each query over the keys at or before it in its segment."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, length, h, d = q.shape
  k, v = (np.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  s = np.einsum("blhd,bthd->bhlt", q, k) / np.sqrt(d)
  mask = np.tril(np.ones((length, length), bool))[None]
  if ids is not None:
    ids = np.asarray(ids)
    mask = mask & (ids[:, :, None] == ids[:, None, :])
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhlt,bthd->blhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("impl", KERNELS)
def test_kernels_match_the_reference_on_packed_and_plain_rows(impl):
  """Grouped-query heads (4 queries, 2 K/V heads), rows of 130 positions (padded inside to 256):
  every real position's output equals float64 attention within its segment; without segment
  ids, plain causal attention."""
  b, length, h, kv, d = 2, 130, 4, 2, 32
  q, k, v = _inputs(b, length, h, kv, d)
  ids = _segments(b, length)
  real = np.asarray(ids > 0)
  out = _attend(q, k, v, ids, impl, interpret=True)
  assert out.shape == (b, length, h, d) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out)[real], _reference(q, k, v, ids)[real], atol=2e-5)
  plain = _attend(q, k, v, None, impl, interpret=True)
  np.testing.assert_allclose(np.asarray(plain), _reference(q, k, v, None), atol=2e-5)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.slow
def test_kernel_gradients_match_the_dense_form(impl):
  """The kernels' backward passes (JAX's own, the TPU one in interpret mode too) give the dense
  form's gradients of a loss over the real positions, for queries, keys and values."""
  b, length, h, kv, d = 2, 130, 4, 2, 32
  q, k, v = _inputs(b, length, h, kv, d, seed=1)
  ids = _segments(b, length)
  real = (ids > 0)[:, :, None, None]
  w = jax.random.normal(jax.random.key(2), (b, length, h, d))

  def loss(attend):
    return lambda q, k, v: jnp.sum(jnp.where(real, attend(q, k, v), 0.0) * w)
  dense = lambda q, k, v: dense_causal(q, k, v, packed_mask(ids, b, length))  # noqa: E731
  kernel = lambda q, k, v: causal_attention.attend(q, k, v, ids, impl, True)  # noqa: E731
  got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
  for name, a, e in zip("qkv", got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=5e-5, err_msg=name)


def test_kernel_on_a_mesh_runs_per_device():
  """On 8 devices (rows over data, heads over tensor), under ``shard_map``: the same outputs as on
  one device."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  b, length, h, kv, d = 4, 40, 4, 2, 16
  q, k, v = _inputs(b, length, h, kv, d, seed=3)
  ids = jnp.asarray(np.repeat(np.arange(1, 5)[None], length // 4, 0).T.reshape(1, -1)
                    .repeat(b, 0)[:, :length].astype(np.int32))

  def run(q, k, v, ids):
    with sharding.use(mesh):
      return causal_attention.attend(q, k, v, ids, "pallas_gpu", interpret=True)
  out = jax.jit(run)(q, k, v, ids)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, ids), atol=2e-5)
  text = jax.jit(run).lower(q, k, v, ids).as_text()
  assert "shard_map" in text or "manual" in text


def test_padded_lengths():
  assert causal_attention.padded_length(130, "pallas_gpu") == 256
  assert causal_attention.padded_length(40, "pallas_gpu") == 64
  assert causal_attention.padded_length(5, "pallas_gpu") == 16
  assert causal_attention.padded_length(40, "pallas_tpu") == 128
  assert causal_attention.padded_length(3072, "pallas_tpu") == 3072


@pytest.mark.parametrize("model", ["smollm2", "qwen2.5-1.5b", "qwen3-1.7b"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_forward_and_backward_lower_compiled_for_their_platform(platform, model):
  """The gradient of a loss through the kernel, lowered compiled for the platform (Mosaic's and
  Triton's block rules apply there, not in interpret mode) at the model's heads, rows of a length
  no block divides (1000 positions, a bfloat16 step): the kernel's calls are in the program and
  ``auto`` picks it there."""
  cfg = {"smollm2": SMOLLM2, "qwen2.5-1.5b": QWEN25_1P5B, "qwen3-1.7b": QWEN3_1P7B}[model]
  h, kv, d, length = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1000
  with choice.lowering_for(platform):
    impl, interpret = choice.causal_attention("auto", d)
  assert impl == {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform] and not interpret

  def loss(q, k, v, ids):
    return jnp.sum(causal_attention.attend(q, k, v, ids, impl).astype(jnp.float32) ** 2)
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = (spec(1, length, h, d), spec(1, length, kv, d), spec(1, length, kv, d),
          spec(1, length, dt=jnp.int32))
  with choice.lowering_for(platform):
    text = choice.lower(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), args, platform).as_text()
  call = {"tpu": "tpu_custom_call", "cuda": "triton"}[platform]
  assert text.count(call) >= 2, "forward and backward kernels"  # (the backward: 1 on TPU's dq
  # and dkv each, 2 Triton calls on GPU)


def test_choice_per_platform_and_overrides(monkeypatch):
  monkeypatch.delenv(choice.CAUSAL_ENV, raising=False)
  assert choice.causal_attention() == ("dense", True)  # this CPU
  assert choice.causal_attention("pallas_tpu") == ("pallas_tpu", True)  # interpreted here
  with choice.lowering_for("tpu"):
    assert choice.causal_attention("auto", 128) == ("pallas_tpu", False)
    assert choice.causal_attention("auto", 192)[0] == "dense"  # Mosaic refuses the head size
    with pytest.raises(ValueError, match="cannot run on 'tpu'"):
      choice.causal_attention("pallas_gpu")
    with pytest.raises(ValueError, match="head_dim=192"):
      choice.causal_attention("pallas_tpu", 192)
  with choice.lowering_for("gpu"):
    assert choice.causal_attention() == ("pallas_gpu", False)
    assert choice.causal_attention("dense") == ("dense", False)
  monkeypatch.setenv(choice.CAUSAL_ENV, "pallas_gpu")
  assert choice.causal_attention() == ("pallas_gpu", True)
  assert choice.causal_attention("dense")[0] == "dense"  # a config's request beats the env
  monkeypatch.setenv(choice.CAUSAL_ENV, "flash")
  with pytest.raises(ValueError, match=r"\$AREAL_JAX_CAUSAL_ATTENTION='flash'"):
    choice.causal_attention()


def test_choice_follows_the_active_mesh():
  """The platform is the traced program's: the active mesh's devices (a learner's or an engine's,
  also a mesh of another machine's devices when compiling for it), here CPU ones."""
  with sharding.use(sharding.make_mesh({}, jax.devices()[:1])):
    assert choice.platform_here() == "cpu" and choice.causal_attention()[0] == "dense"


def test_older_accelerators_keep_the_dense_form(monkeypatch):
  """TPUs before v4 (Mosaic refuses the kernel's bfloat16 matmuls there: compiled by libtpu for a
  TPU v3) and GPUs before Ampere (no Triton) keep the dense attention under ``auto``,
  and a request for the kernel there names why; newer chips get the kernel."""
  import types
  monkeypatch.delenv(choice.CAUSAL_ENV, raising=False)

  def on(platform, kind, **attrs):
    device = types.SimpleNamespace(platform=platform, device_kind=kind, **attrs)
    mesh = types.SimpleNamespace(devices=np.array([device]), size=1)
    monkeypatch.setattr(sharding, "current", lambda: (mesh, sharding.DEFAULT_RULES))
    return choice.causal_attention()[0]
  assert on("tpu", "TPU v3") == "dense" and on("tpu", "TPU v2") == "dense"
  assert on("tpu", "TPU v4") == on("tpu", "TPU v5 lite") == on("tpu", "TPU7x") == "pallas_tpu"
  assert on("gpu", "Tesla T4", compute_capability="7.5") == "dense"
  assert on("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0") == "pallas_gpu"
  on("tpu", "TPU v3")
  with pytest.raises(ValueError, match="TPU v4 or newer.*TPU v3"):
    choice.causal_attention("pallas_tpu")
  assert "TPU v3" in choice.mosaic_unusable([types.SimpleNamespace(platform="tpu",
                                                                   device_kind="TPU v3")])
