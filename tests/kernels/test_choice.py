"""The one place that picks decode kernels: per platform, overridden by config or environment, with
clear errors for choices a platform cannot run."""

import jax
import numpy as np
import pytest

from areal_jax import sharding
from areal_jax.kernels import choice, cpu_attention


def test_auto_picks_per_platform():
  assert choice.attention("cpu") == ("cpu" if cpu_attention.available() else "xla")
  assert choice.attention("gpu") == "dense" and choice.attention("tpu") == "dense"
  with cpu_attention.disabled():
    assert choice.attention("cpu") == "xla"
  assert choice.steps_per_call("cpu") == 1
  assert choice.steps_per_call("gpu") == choice.steps_per_call("tpu") == 16
  assert choice.platform_of(sharding.make_mesh({}, jax.devices()[:1])) == "cpu"


def test_config_beats_environment_beats_platform(monkeypatch):
  monkeypatch.setenv(choice.ATTENTION_ENV, "pallas_gpu")
  assert choice.attention("cpu") == "pallas_gpu" and choice.attention("gpu") == "pallas_gpu"
  assert choice.attention("cpu", "dense") == "dense"
  monkeypatch.setenv(choice.ATTENTION_ENV, "")
  assert choice.attention("gpu") == "dense"


def test_the_gpu_pages_its_cache_where_the_pallas_kernel_reads_the_pages(monkeypatch):
  """kv_pages -1 ("auto"): on GPU a pool of each slot's row of pages and one more, read by the
  Pallas GPU kernel (the attention's default there over pages); rows elsewhere, with the dense
  read forced, with the slots split over devices, or pages the kernel cannot block."""
  for env in (choice.ATTENTION_ENV, choice.PAGED_ENV):
    monkeypatch.delenv(env, raising=False)
  kw = dict(num_slots=8, max_len=100, page_size=64)  # 2 pages a row

  def pages(platform, requested=-1, attention="auto", split=False, **over):
    return choice.kv_pages(platform, requested, attention, split, **{**kw, **over})
  assert pages("gpu") == pages("gpu", attention="pallas_gpu") == 8 * (2 + 1)
  assert pages("gpu", attention="dense") == 0  # the dense read over pages measured slower
  assert pages("gpu", split=True) == 0  # a paged cache is not split over slots
  assert pages("gpu", page_size=8) == 0  # the kernel's blocks are 16 positions or more
  assert pages("cpu") == pages("tpu") == 0
  assert pages("gpu", 0) == 0 and pages("cpu", 40) == 40 and pages("gpu", 40, split=True) == 40
  assert choice.attention("gpu", paged=True) == "pallas_gpu" and choice.attention("gpu") == "dense"
  assert choice.attention("tpu", paged=True) == "dense"
  assert choice.attention("gpu", "dense", paged=True) == "dense"
  monkeypatch.setenv(choice.ATTENTION_ENV, "dense")
  assert pages("gpu") == 0
  monkeypatch.delenv(choice.ATTENTION_ENV)
  monkeypatch.setenv(choice.PAGED_ENV, "1")  # the GPU's choice on any platform (tests)
  assert pages("cpu") == 24 and pages("cpu", page_size=8) == 8 * (13 + 1)
  assert pages("cpu", split=True) == 0
  monkeypatch.setenv(choice.PAGED_ENV, "0")
  assert pages("gpu") == 0 and pages("gpu", 40) == 40
  monkeypatch.setenv(choice.PAGED_ENV, "yes")
  with pytest.raises(ValueError, match=r"\$AREAL_JAX_PAGED_CACHE='yes'"):
    pages("gpu")


def test_bad_choices_name_the_setting(monkeypatch):
  with pytest.raises(ValueError, match="decode_attention='flash'"):
    choice.attention("cpu", "flash")
  monkeypatch.setenv(choice.ATTENTION_ENV, "flash")
  with pytest.raises(ValueError, match=r"\$AREAL_JAX_DECODE_ATTENTION='flash'"):
    choice.attention("cpu")
  monkeypatch.delenv(choice.ATTENTION_ENV)
  with pytest.raises(ValueError, match="'cpu' cannot run on 'gpu'"):
    choice.attention("gpu", "cpu")
  with pytest.raises(ValueError, match="'pallas_gpu' cannot run on 'tpu'"):
    choice.attention("tpu", "pallas_gpu")
  with pytest.raises(ValueError, match="'pallas_tpu' cannot run on 'gpu'"):
    choice.attention("gpu", "pallas_tpu")
  assert choice.attention("tpu", "pallas_tpu") == choice.attention("cpu", "pallas_tpu") == \
      "pallas_tpu"  # on CPU: interpret mode (tests)
  mesh8 = sharding.make_mesh({"data": 8}) if len(jax.devices()) >= 8 else None
  if mesh8 is not None:
    with pytest.raises(ValueError, match="cpu_packed"):
      choice.matmul(mesh8, "float32", "cpu_packed")
    assert choice.matmul(mesh8, "float32") == "xla"
  with pytest.raises(ValueError, match="decode_matmul='mkl'"):
    choice.matmul(sharding.make_mesh({}, jax.devices()[:1]), "float32", "mkl")


def test_decode_matmul_blas_is_the_gpu_default_and_runs_on_gpu_only(monkeypatch):
  monkeypatch.delenv(choice.MATMUL_ENV, raising=False)
  one = sharding.make_mesh({}, jax.devices()[:1])
  with pytest.raises(ValueError, match="'blas'.*cannot run on 'cpu'"):
    choice.matmul(one, "float32", "blas")
  assert choice.matmul(one, "bfloat16") == "xla"  # off GPU
  monkeypatch.setattr(choice, "platform_of", lambda mesh: "gpu")
  assert choice.matmul(one, "bfloat16") == "blas"
  assert choice.matmul(one, "bfloat16", "xla") == "xla"
  monkeypatch.setenv(choice.MATMUL_ENV, "xla")
  assert choice.matmul(one, "bfloat16") == "xla"
  assert choice.matmul(one, "bfloat16", "blas") == "blas"
  assert choice.layers("gpu", "blas", "scan") == "scan"
  assert choice.compiler_options("xla") is None and choice.compiler_options("cpu_packed") is None
  # the option is one XLA knows (a misspelt one is refused at compile time), and it leaves the
  # program's result as it was
  a = jax.random.normal(jax.random.key(0), (8, 8))
  blas = jax.jit(lambda x: x @ x, compiler_options=choice.compiler_options("blas"))
  np.testing.assert_allclose(blas(a), a @ a, rtol=1e-6)
  # XLA's own GEMMs are timed against "blas" only where nothing named "blas" (launch_stages)
  monkeypatch.delenv(choice.MATMUL_ENV)
  assert choice.matmul_open("blas", "auto")
  assert not choice.matmul_open("blas", "blas") and not choice.matmul_open("xla", "auto")
  monkeypatch.setenv(choice.MATMUL_ENV, "blas")
  assert not choice.matmul_open("blas", "auto")


def test_decode_layers_per_platform_config_and_environment(monkeypatch):
  monkeypatch.delenv(choice.LAYERS_ENV, raising=False)
  assert choice.layers("cpu", "xla") == choice.layers("cpu", "cpu_packed") == "unrolled"
  # GPU and TPU: unrolled (compiled for either, a scanned layer's weights and cache slices are
  # copied every step), a paged cache's pools included; in a scan for the Pallas TPU kernel without
  # pages (it reads the scan's stacked cache)
  assert choice.layers("gpu", "blas") == choice.layers("gpu", "xla") == "unrolled"
  assert choice.layers("tpu", "xla") == "unrolled"
  assert choice.layers("gpu", "blas", paged=True) == choice.layers("tpu", "xla", paged=True) == "unrolled"
  assert choice.layers("tpu", "xla", paged=True, attention_impl="pallas_tpu") == "unrolled"
  assert choice.layers("tpu", "xla", attention_impl="pallas_tpu") == "scan"
  assert choice.layers("tpu", "xla", "unrolled", attention_impl="pallas_tpu") == "unrolled"
  assert choice.layers("cpu", "xla", "scan") == "scan"
  monkeypatch.setenv(choice.LAYERS_ENV, "scan")
  assert choice.layers("cpu", "xla") == "scan"
  assert choice.layers("gpu", "xla", "unrolled") == "unrolled"
  with pytest.raises(ValueError, match="needs XLA matmuls"):
    choice.layers("cpu", "cpu_packed")
  monkeypatch.setenv(choice.LAYERS_ENV, "loop")
  with pytest.raises(ValueError, match=r"\$AREAL_JAX_DECODE_LAYERS='loop'"):
    choice.layers("gpu", "xla")
  with pytest.raises(ValueError, match="decode_layers='loop'"):
    choice.layers("gpu", "xla", "loop")


def test_decode_projections_fused_on_accelerators_when_the_tensor_axis_splits_kv_heads(monkeypatch):
  from areal_jax.models import ModelConfig
  monkeypatch.delenv(choice.PROJECTIONS_ENV, raising=False)
  cfg = ModelConfig(n_heads=4, n_kv_heads=2)
  one = sharding.make_mesh({}, jax.devices()[:1])
  assert choice.projections(one, cfg) == "separate"  # CPU keeps the model's layout
  monkeypatch.setattr(choice, "platform_of", lambda mesh: "gpu")
  assert choice.projections(one, cfg) == "fused"
  if len(jax.devices()) >= 8:
    assert choice.projections(sharding.make_mesh({"data": 4, "tensor": 2}), cfg) == "fused"
    # four tensor shards cannot hold whole KV heads of two: the separate layout
    assert choice.projections(sharding.make_mesh({"data": 2, "tensor": 4}), cfg) == "separate"
  assert choice.projections(one, cfg, "separate") == "separate"
  monkeypatch.setenv(choice.PROJECTIONS_ENV, "separate")
  assert choice.projections(one, cfg) == "separate"
  assert choice.projections(one, cfg, "fused") == "fused"
  monkeypatch.delenv(choice.PROJECTIONS_ENV)
  fused_model = ModelConfig(n_heads=4, n_kv_heads=2, fused_projections=True)
  assert choice.projections(one, fused_model) == "fused"
  with pytest.raises(ValueError, match="fused_projections=True"):
    choice.projections(one, fused_model, "separate")
  monkeypatch.setenv(choice.PROJECTIONS_ENV, "merged")
  with pytest.raises(ValueError, match=r"\$AREAL_JAX_DECODE_PROJECTIONS='merged'"):
    choice.projections(one, cfg)


def test_per_layer_cache_layout_and_writes_per_platform():
  # heads-major where the attention reads it in place on a GPU; a TPU holds positions first and
  # writes each layer's new keys and values with one scatter (no loop over the rows)
  assert choice.heads_major_per_layer("dense", "gpu")
  assert choice.heads_major_per_layer("pallas_gpu", "gpu")
  assert not choice.heads_major_per_layer("dense", "tpu")
  assert not choice.heads_major_per_layer("cpu", "cpu")
  assert not choice.heads_major_per_layer("xla", "gpu")
  assert choice.scatter_cache_writes("tpu")
  assert not choice.scatter_cache_writes("gpu") and not choice.scatter_cache_writes("cpu")
  assert choice.vocab_major_logits("tpu")
  assert not choice.vocab_major_logits("gpu") and not choice.vocab_major_logits("cpu")


def test_held_layouts_are_the_compilers_on_tpu(monkeypatch):
  monkeypatch.delenv(choice.HELD_LAYOUTS_ENV, raising=False)
  assert choice.held_layouts("tpu") == "compiler"
  assert choice.held_layouts("gpu") == choice.held_layouts("cpu") == "default"
  monkeypatch.setenv(choice.HELD_LAYOUTS_ENV, "compiler")
  assert choice.held_layouts("cpu") == "compiler"
  monkeypatch.setenv(choice.HELD_LAYOUTS_ENV, "tiled")
  with pytest.raises(ValueError, match="AREAL_JAX_HELD_LAYOUTS='tiled'"):
    choice.held_layouts("tpu")


def test_the_gpu_engine_decides_truncation_on_the_host(monkeypatch):
  # XLA:GPU runs a conditional by reading its predicate back to the host every step
  monkeypatch.delenv(choice.TRUNCATION_ENV, raising=False)
  assert choice.truncation_on_host("gpu")
  assert not choice.truncation_on_host("cpu") and not choice.truncation_on_host("tpu")
  monkeypatch.setenv(choice.TRUNCATION_ENV, "1")
  assert choice.truncation_on_host("cpu")
  monkeypatch.setenv(choice.TRUNCATION_ENV, "0")
  assert not choice.truncation_on_host("gpu")
  monkeypatch.setenv(choice.TRUNCATION_ENV, "yes")
  with pytest.raises(ValueError, match="AREAL_JAX_TRUNCATION_ON_HOST='yes'"):
    choice.truncation_on_host("gpu")


def test_gpus_older_than_ampere_decode_without_pallas_gpu_kernels(monkeypatch):
  """XLA compiles Pallas's Triton kernels for compute capability 8.0 and newer only: on a T4 or a
  V100 the GPU's choices fall back to the dense read over rows, and asking for a Pallas GPU
  kernel there says why instead of failing at the first call."""
  def gpu(kind, cap):
    return type("Device", (), {"platform": "gpu", "device_kind": kind, "compute_capability": cap})()
  h100, a100, t4, v100 = (gpu("NVIDIA H100 80GB HBM3", "9.0"), gpu("NVIDIA A100", "8.0"),
                          gpu("Tesla T4", "7.5"), gpu("Tesla V100-SXM2-16GB", "7.0"))
  mi250 = gpu("AMD Instinct MI250X", "gfx90a")  # ROCm: not a number, not held back
  assert choice.triton_unusable([h100, a100]) is None and choice.triton_unusable([mi250]) is None
  assert choice.triton_unusable(jax.devices()) is None  # CPU devices: interpret mode
  why = choice.triton_unusable([h100, t4, t4])
  assert "Tesla T4 (compute capability 7.5)" in why and "H100" not in why and "8.0" in why
  assert "V100-SXM2-16GB (compute capability 7.0)" in choice.triton_unusable([v100])

  monkeypatch.delenv(choice.ATTENTION_ENV, raising=False)
  monkeypatch.delenv(choice.PAGED_ENV, raising=False)
  kw = dict(num_slots=8, max_len=100, page_size=64)
  assert choice.kv_pages("gpu", -1, "auto", False, **kw) == 24  # an Ampere or newer GPU: pages
  assert choice.kv_pages("gpu", -1, "auto", False, **kw, no_triton=why) == 0  # rows
  assert choice.kv_pages("gpu", 40, "auto", False, **kw, no_triton=why) == 40  # as configured
  assert choice.attention("gpu", paged=True, no_triton=why) == "dense"
  assert choice.attention("gpu", "dense", no_triton=why) == "dense"
  with pytest.raises(ValueError, match=r"'pallas_gpu' cannot run here: .*Tesla T4 .*'dense'"):
    choice.attention("gpu", "pallas_gpu", paged=True, no_triton=why)
  assert choice.norm_matmuls("gpu", True, spec="", no_triton=why) is None
  with pytest.raises(ValueError, match=r"AREAL_JAX_DECODE_NORM_MATMUL='1' cannot run here: .*T4"):
    choice.norm_matmuls("gpu", True, spec="1", no_triton=why)
