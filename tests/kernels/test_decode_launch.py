"""The decode launches a GPU engine times before it decodes: which stages are offered, in which
order, what the environment keeps, and the compiler options each launch adds."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from areal_jax.kernels import (choice, decode_launch, pallas_attention, pallas_launch,
                               pallas_norm_matmul)


def test_on_a_gpu_the_launches_left_open_are_offered_to_be_timed(monkeypatch):
  """``launch_stages``: on a GPU, our paged step kernel (with dots where it takes them) where the
  Pallas kernel reads the pages, the fused norms on one device, then the decode loop in CUDA
  graphs, each unless the environment forces its setting; the Triton ones only where Triton
  runs; none on CPU, TPU or "off". Each stage offers the launch kept so far first."""
  for name in (pallas_launch.PAGED_TUNING_ENV, pallas_launch.NORM_MATMUL_ENV,
               pallas_launch.BLOCK_PAGES_ENV):
    monkeypatch.delenv(name, raising=False)
  flags = " ".join(  # (no command buffers forced; the tests' 8 devices kept)
      f for f in os.environ.get("XLA_FLAGS", "").split() if "command_buffer" not in f)
  monkeypatch.setenv("XLA_FLAGS", flags)
  own = decode_launch.Launch(None, pallas_attention.PagedTuning())
  shape = dict(paged_pallas=True, one_device=True, group=3, page_size=64, head_dim=64,
               norm_dims=((576, 960), (576, 1536)))  # SmolLM2-135M

  def stages(platform="gpu", requested="auto", **kw):
    """Each stage's offer, given the launch the stage before it offered last."""
    kept, out = own, []
    for stage in decode_launch.launch_stages(platform, requested, **{**shape, **kw}):
      offered = stage(kept)
      assert offered[0] == kept
      out.append([x.name for x in offered[1:]])
      kept = offered[-1]
    return out

  graphs = ["graphs", "graphs:unrolled"]
  # the last of the paged step's offers (4 warps a program) kept by the helper
  step = "warps=4,writes=1,dot=1"
  assert stages() == [["writes=1", "writes=1,dot=1", "stages=1,writes=1,dot=1",
                       "block_pages=2,writes=1,dot=1", step],
                      [f"{step}+norms:block_n=16", f"{step}+norms"],
                      [f"{step}+norms+{g}" for g in graphs]]
  assert stages("cpu") == stages("tpu") == stages(requested="off") == []
  assert stages(no_triton="a Tesla T4") == [graphs]  # the graphs need no Triton
  # XLA's autotuned GEMMs last, on what the stages before kept, where the engine's are "blas" by
  # default
  assert stages(matmul_open=True)[3] == [f"{step}+norms+graphs:unrolled+matmul=xla"]
  assert stages(no_triton="a Tesla T4", matmul_open=True) == [
      graphs, ["graphs:unrolled+matmul=xla"]]
  assert stages("tpu", matmul_open=True) == stages(requested="off", matmul_open=True) == []
  # the library's GEMMs autotuned, where the engine's are the library's (forced or by default),
  # before XLA's own
  assert stages(blas=True)[3] == [f"{step}+norms+graphs:unrolled+autotune"]
  assert stages(blas=True, matmul_open=True)[3] == [
      f"{step}+norms+graphs:unrolled+autotune", f"{step}+norms+graphs:unrolled+matmul=xla"]
  assert stages("tpu", blas=True) == []
  assert stages(paged_pallas=False) == [["norms:block_n=16", "norms"],
                                        [f"norms+{g}" for g in graphs]]
  assert stages(one_device=False)[1] == [f"{step}+graphs", f"{step}+graphs:unrolled"]
  # no dots: half a head under 16
  assert stages(head_dim=16)[0] == ["writes=1", "stages=1,writes=1", "block_pages=2,writes=1",
                                    "warps=4,writes=1"]
  # a query group the step kernel does not take
  assert stages(group=64)[0] == ["norms:block_n=16", "norms"]
  assert stages(norm_dims=((576, 24),))[1] == [f"{step}+{g}" for g in graphs]
  monkeypatch.setenv(pallas_launch.PAGED_TUNING_ENV, "parts=2")  # forced: kept as the environment says
  assert stages()[0] == ["norms:block_n=16", "norms"]
  monkeypatch.setenv(pallas_launch.NORM_MATMUL_ENV, "0")  # "0" forces nothing
  assert stages()[0] == ["norms:block_n=16", "norms"]
  monkeypatch.setenv(pallas_launch.NORM_MATMUL_ENV, "1")
  monkeypatch.setenv("XLA_FLAGS", flags + " --xla_gpu_enable_command_buffer=")
  assert stages() == []
  both = decode_launch.Launch(pallas_norm_matmul.NormTuning(warps=8),
                       pallas_attention.PagedTuning(parts=2, writes=True))
  assert both.name == "parts=2,writes=1+norms:warps=8"
  with pytest.raises(ValueError, match="rollout.decode_tuning='on'"):
    stages(requested="on")
  # the graphs: compiler options XLA takes (an unknown name or value is an error)
  assert own.compiler_options() == {}
  offered = decode_launch.graphs_to_time(own)
  assert decode_launch.graphs_to_time(offered[1]) == [offered[1]]  # already in graphs
  for launch in offered[1:]:
    options = launch.compiler_options()
    assert "WHILE" in options["xla_gpu_enable_command_buffer"]
    assert jax.jit(lambda x: x + 1, compiler_options=options)(jnp.ones(2)).tolist() == [2, 2]
  assert offered[2].compiler_options()["xla_gpu_command_buffer_unroll_loops"] is True
  # the library's GEMMs autotuned: merged over "blas"'s options as the engine merges them, the
  # autotuning is on and the Triton GEMMs stay off, and XLA takes them
  tuned = dataclasses.replace(own, autotune=True)
  assert tuned.name == "autotune"
  options = {**choice.compiler_options("blas"), **tuned.compiler_options()}
  assert options == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 4}
  assert jax.jit(lambda x: x + 1, compiler_options=options)(jnp.ones(2)).tolist() == [2, 2]
  graphs_tuned = dataclasses.replace(offered[1], autotune=True)
  assert graphs_tuned.name == "graphs+autotune"
  assert graphs_tuned.compiler_options()["xla_gpu_autotune_level"] == 4
