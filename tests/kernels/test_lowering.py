"""The accelerator kernels lowered as a TPU or a GPU would compile them, on this CPU machine
(``choice.lowering_for``: the Pallas kernels traced compiled, not interpreted, and the program
lowered for the platform): at the head layouts of the recipes' models and of SmolLM2, through the
same dispatch the decode step uses, and a whole engine's decode program. Interpret mode (the
other kernel tests) checks what the kernels compute; Mosaic's and Triton's constraints on block
shapes are only checked here."""

import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest

from areal_jax.kernels import attention, choice, pallas_tpu_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from common import QWEN3_1P7B, QWEN25_1P5B, QWEN25_7B, SMOLLM2  # noqa: E402

MODELS = {"smollm2": SMOLLM2, "qwen2.5-1.5b": QWEN25_1P5B, "qwen3-1.7b": QWEN3_1P7B,
          "qwen2.5-7b": QWEN25_7B}
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "triton"}  # the compiled kernel in the lowering
IMPL = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
L, R, T, PAGE, M, N = 2, 8, 512, 16, 40, 32  # layers, rows, positions; paged: page, pages, per row


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _forms(cfg):
  """Each way the decode step calls a kernel, by name: ``(impl -> function, abstract args)``."""
  k, g, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  q, pos, layer = _spec(R, k, g, d, dtype=jnp.float32), _spec(R, dtype=jnp.int32), _spec(
      dtype=jnp.int32)
  stacked, per_layer = _spec(L, R, k, T, d), _spec(R, k, T, d)
  pool, table = _spec(k, L, M, PAGE, d), _spec(R, N, dtype=jnp.int32)
  return {
      # the layers in a scan: the stacked cache read in place as pages
      "stacked": (lambda impl: lambda q, c, i, p: attention.decode_attention_stacked(
          q, c, c, i, p, T, impl), (q, stacked, layer, pos)),
      # the paged KV cache (rollout.kv_pages)
      "paged": (lambda impl: lambda q, c, i, tb, p: attention.decode_attention_paged(
          q, c, c, i, tb, p, N * PAGE, impl), (q, pool, layer, table, pos)),
      # a per-layer heads-major cache (GPU: JAX's mqa kernel per (row, K/V head))
      "heads_major": (lambda impl: lambda q, c, p: attention.decode_attention_heads_major(
          q, c, c, p, T, impl), (q, per_layer, pos)),
  }


def _lowered(platform, fn, args):
  with choice.lowering_for(platform):
    return choice.lower(jax.jit(fn), args, platform).as_text()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernels_lower_compiled_for_their_platform(platform, model):
  """Every form the platform's Pallas kernel serves lowers with the kernel compiled in it, at the
  model's heads (K/V heads, query heads per K/V head, head size); where JAX's TPU kernel cannot
  take the head size on a TPU, the dispatch reads densely instead (and the kernel itself does fail
  to lower there, so the refusal is not stale)."""
  cfg = MODELS[model]
  impl = IMPL[platform]
  forms = _forms(cfg)
  if platform == "tpu":
    del forms["heads_major"]  # the TPU kernel serves the stacked and the paged caches only
  refused = platform == "tpu" and pallas_tpu_attention.unusable(
      "scan", jnp.bfloat16, T, cfg.head_dim, compiled=True)
  for name, (make, args) in forms.items():
    text = _lowered(platform, make(impl), args)
    assert (KERNEL_CALL[platform] in text) != bool(refused), (model, name)
  if refused:
    assert f"head_dim={cfg.head_dim}" in refused
    k, g, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    kernel = lambda q, c, n, p: pallas_tpu_attention.kernel(q, c, c, n, p, PAGE)  # noqa: E731
    with pytest.raises(ValueError, match="128"):  # Mosaic's block shape rule
      _lowered("tpu", kernel, (_spec(R, k * g, d, dtype=jnp.float32), _spec(1, M, PAGE, d),
                               _spec(R, dtype=jnp.int32), _spec(R, N, dtype=jnp.int32)))


def test_interpret_mode_outside_lowering_for():
  """On this CPU backend the same dispatch traces the kernels in interpret mode (no kernel call in
  the program): what the other kernel tests run."""
  make, args = _forms(QWEN25_1P5B)["stacked"]
  assert choice.interpret() and choice.platform_of(None) == "cpu"
  text = jax.jit(make("pallas_tpu")).trace(*args).lower().as_text()
  assert KERNEL_CALL["tpu"] not in text
  with choice.lowering_for("tpu"):
    assert not choice.interpret() and choice.platform_of(None) == "tpu"
    assert choice.attention(choice.platform_of(None)) == "dense"  # the TPU default
  assert choice.interpret()


@pytest.mark.parametrize("mesh", [{}, {"data": 2, "tensor": 2}])
@pytest.mark.parametrize("paged,layers", [(False, "scan"), (True, "scan"), (True, "unrolled")])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.slow
def test_an_engine_decode_program_lowers_with_the_compiled_kernel(platform, paged, layers, mesh):
  """A sampler engine configured as on the platform (bfloat16, fused projections, 16 steps per
  call, its Pallas kernel; a row cache with the layers in a scan, or a paged one with them in a
  scan or unrolled; one device, or slots and K/V heads split over a mesh, the kernel under
  shard_map) built and lowered for it: the whole decode call lowers, the kernel compiled in it."""
  from flax import nnx

  from areal_jax import sharding
  from areal_jax.models import ModelConfig, Transformer
  from areal_jax.sampler.engine import DecodeEngine, EngineConfig
  if paged and mesh:
    mesh = {"tensor": 2}  # a paged cache is not split over slots
  mesh = sharding.make_mesh(mesh, jax.devices()[:math.prod(mesh.values())]) if mesh else None
  cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=256, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=128, d_ff=256, qkv_bias=True, dtype="bfloat16")
  with choice.lowering_for(platform):
    eng = DecodeEngine(Transformer(cfg, nnx.Rngs(0)), EngineConfig(
        num_slots=4, max_len=256, prefill_buckets=(32,), steps_per_call=16,
        decode_attention=IMPL[platform], decode_layers=layers, decode_matmul="xla",
        decode_projections="fused", kv_pages=24 if paged else 0, page_size=32), mesh=mesh)
    pages = (_spec(4, eng.pages_per_slot, dtype=jnp.int32),) if paged else ()
    generate = eng._make_generate(eng.kv_buckets[-1], 4)  # noqa: SLF001
    text = choice.lower(generate, (eng.params, eng.state_shapes(), *pages),
                        platform).as_text()
  assert text.count(KERNEL_CALL[platform]) >= 1


def test_pallas_tpu_on_a_tpu_refuses_a_head_size_mosaic_cannot_take():
  """SmolLM2's head size (64) with the TPU kernel: built for a TPU the engine says why (and what to
  set); in interpret mode (CPU tests) the kernel takes any head size."""
  from flax import nnx

  from areal_jax.models import ModelConfig, Transformer
  from areal_jax.sampler.engine import DecodeEngine, EngineConfig
  model = Transformer(ModelConfig(vocab_size=128, d_model=128, n_heads=2, n_kv_heads=1,
                                  head_dim=64, d_ff=128, dtype="bfloat16"), nnx.Rngs(0))
  config = EngineConfig(num_slots=2, max_len=64, decode_attention="pallas_tpu",
                        decode_layers="scan", decode_matmul="xla")
  with choice.lowering_for("tpu"), pytest.raises(ValueError, match=r"head_dim=64 .*'dense'"):
    DecodeEngine(model, config)
  assert DecodeEngine(model, config).attention_impl == "pallas_tpu"


def _largest_constant_bytes(hlo_text: str) -> int:
  """Bytes of the largest dense constant (hex-encoded) in a StableHLO module."""
  return max((len(c) // 2 for c in re.findall(r'dense<"0x([0-9A-F]*)"', hlo_text)), default=0)


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_decode_programs_take_the_weights_as_arguments(layers):
  """The weights reach the sampler's prefill and decode programs, and the benchmarks' floor loop,
  as arguments, never as constants baked into the program: closed over, a model's weights land in
  the HLO (3 GB at the Qwen2.5-1.5B shape) for the compiler to fold and copy, and the floor loop's
  program did exactly that until it compiled in no configuration within minutes on an H100."""
  import numpy as np
  from flax import nnx

  import decode_floor
  from areal_jax.models import ModelConfig, Transformer
  from areal_jax.sampler.engine import DecodeEngine, EngineConfig
  cfg = ModelConfig(arch="llama", vocab_size=512, d_model=128, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=32, d_ff=256, dtype="float32")  # 0.5 MB of weights
  eng = DecodeEngine(Transformer(cfg, nnx.Rngs(0)), EngineConfig(
      num_slots=4, max_len=64, prefill_buckets=(16,), steps_per_call=2, decode_attention="dense",
      decode_layers=layers, decode_matmul="xla"))
  programs = {
      "generate": eng._make_generate(64, 4).lower(eng.params, eng.state_shapes()),  # noqa: SLF001
      "prefill": eng._make_prefill(16, 1).lower(eng.params, np.zeros((1, 16), np.int32)),  # noqa: SLF001
  }
  run, state = decode_floor.make(cfg, 4, 64, jnp.float32, steps=2)
  programs["floor"] = run.func.lower(*run.args, state)
  for name, lowered in programs.items():
    assert _largest_constant_bytes(lowered.as_text()) < 16 * 1024, name
