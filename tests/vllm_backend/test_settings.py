"""What vLLM runs with, by its platform: float32 and eager on CPU as before; on a GPU bfloat16,
vLLM's compiled graphs, the KV cache on the device and a memory share no larger than what is
free. The pure functions run under the main venv too; what vLLM's own command-line parser makes of
the server's arguments needs vLLM (``make test-vllm``)."""

import os
import sys
import types

import pytest

from areal_jax import config as config_lib
from areal_jax import models
from areal_jax.runtime import engines
from areal_jax.vllm_rollout import env as env_lib
from areal_jax.vllm_rollout import server, settings

GIB = 1 << 30
needs_vllm = pytest.mark.skipif(not env_lib.vllm_available(), reason="needs vLLM: make test-vllm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_on_cpu_the_engine_is_float32_and_eager_with_its_cache_in_host_memory(tmp_path):
  assert settings.engine_fields("cpu") == {
      "dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni"}
  assert settings.engine_fields("cpu", dtype="bfloat16", gpu_memory_utilization=0.5,
                                memory=(GIB, 2 * GIB))["dtype"] == "bfloat16"
  env = settings.environment("cpu", str(tmp_path), kv_cache_gib=1.5, num_threads=3)
  assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5" and env["OMP_NUM_THREADS"] == "3"
  assert env["TORCHDYNAMO_DISABLE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
  assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
  assert settings.environment("cpu", str(tmp_path))["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the default


def test_on_a_gpu_bfloat16_compiled_and_the_cache_on_the_device(tmp_path):
  # by default vLLM sizes its cache from its share, what is free less the headroom
  fields = settings.engine_fields("gpu", memory=(20 * GIB, 80 * GIB))
  assert fields == {"dtype": "bfloat16", "enforce_eager": False,
                    "distributed_executor_backend": "uni",
                    "gpu_memory_utilization": 0.225}  # (20 - 2) / 80 GiB
  # a size asked for; an explicit share and dtype are kept
  fields = settings.engine_fields("gpu", dtype="float16", kv_cache_gib=1,
                                  gpu_memory_utilization=0.4, memory=(20 * GIB, 80 * GIB))
  assert fields["dtype"] == "float16" and fields["kv_cache_memory_bytes"] == GIB
  assert fields["gpu_memory_utilization"] == 0.4
  assert "gpu_memory_utilization" not in settings.engine_fields("gpu")  # unknown: vLLM's own
  env = settings.environment("gpu", str(tmp_path), kv_cache_gib=1.5, num_threads=3)
  for cpu_only in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE",
                   "VLLM_CPU_OMP_THREADS_BIND"):
    assert cpu_only not in env  # (torch.compile builds vLLM's CUDA graphs on a GPU)
  assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
  with pytest.raises(ValueError, match="expected one of"):
    settings.engine_fields("tpu")


def test_the_weights_are_written_in_the_compute_dtype():
  assert settings.compute_dtype("cpu") == "float32"
  assert settings.compute_dtype("gpu") == "bfloat16"
  assert settings.compute_dtype("gpu", "float32") == "float32"
  assert settings.compute_dtype("cpu", "bfloat16") == "bfloat16"


def test_the_automatic_share_is_what_is_free_less_headroom_at_most_vllms_default():
  assert settings.memory_share(0.0, (80 * GIB, 80 * GIB)) == settings.MAX_SHARE
  assert settings.memory_share(0.0, (10 * GIB, 80 * GIB)) == 0.1
  assert settings.memory_share(0.3, (1 * GIB, 80 * GIB)) == 0.3  # asked: vLLM says if it fits
  assert settings.memory_share(0.0, None) is None
  # a JAX learner holding most of the card: an error naming what to change, not a failed start
  with pytest.raises(ValueError, match="XLA_PYTHON_CLIENT_MEM_FRACTION.*gpu_memory_utilization"):
    settings.memory_share(0.0, (3 * GIB, 80 * GIB))
  for bad in (1.5, -0.2):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization={bad}"):
      settings.memory_share(bad, (80 * GIB, 80 * GIB))


def test_free_memory_is_read_for_the_first_visible_gpu(monkeypatch):
  calls = []

  class Info:
    free, total = 5 * GIB, 8 * GIB

  fake = types.SimpleNamespace(
      nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
      nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
      nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
      nvmlDeviceGetMemoryInfo=lambda h: calls.append(h) or Info())
  monkeypatch.setitem(sys.modules, "pynvml", fake)
  for visible, handle in (("2,3", ("index", 2)), ("GPU-8f1e,GPU-aa", ("uuid", "GPU-8f1e")),
                          ("", ("index", 0))):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    calls.clear()
    assert settings.device_memory() == (5 * GIB, 8 * GIB)
    assert calls == ["init", handle, "shutdown"]

  def no_driver():
    raise RuntimeError("NVML Shared Library Not Found")

  monkeypatch.setattr(fake, "nvmlInit", no_driver)
  assert settings.device_memory() is None
  monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed (a ROCm or CPU build)
  assert settings.device_memory() is None


def test_a_platform_this_backend_does_not_run_on_is_named(monkeypatch):
  tpu = types.SimpleNamespace(is_cpu=lambda: False, is_cuda_alike=lambda: False,
                              device_type="tpu")
  monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
  monkeypatch.setitem(sys.modules, "vllm.platforms",
                      types.SimpleNamespace(current_platform=tpu))
  with pytest.raises(ValueError, match="platform here is 'tpu'.*rollout.backend='jax'"):
    settings.platform()
  tpu.is_cuda_alike = lambda: True  # CUDA or ROCm
  assert settings.platform() == "gpu"


def test_cli_args_flags_and_values():
  assert settings.cli_args({"dtype": "bfloat16", "enforce_eager": False, "a_b": True,
                            "kv_cache_memory_bytes": GIB, "x": None}) == [
      "--dtype", "bfloat16", "--a-b", "--kv-cache-memory-bytes", str(GIB)]


def test_a_vllm_dtype_it_does_not_take_is_named(tokenizer):
  c = config_lib.load(os.path.join(ROOT, "configs/gsm8k.py:tiny"))
  config_lib.override(c, "rollout.backend", "vllm")
  config_lib.override(c, "rollout.vllm.dtype", "fp8")
  model, _ = models.load("tiny")
  with pytest.raises(ValueError, match=r"rollout.vllm.dtype='fp8' is not one of"):
    engines.build(c, model, tokenizer, None)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_vllms_own_parser_reads_the_server_arguments_as_the_engine_fields(platform):
  """The server's command line (``server.server_args``) through vLLM's ``serve`` parser gives the
  ``EngineArgs`` the in-process engine builds from the same fields."""
  env_lib.require_vllm()
  from vllm.engine.arg_utils import EngineArgs
  from vllm.entrypoints.launchers.cli_args import make_arg_parser
  from vllm.utils.argparse_utils import FlexibleArgumentParser
  fields = settings.engine_fields(platform, kv_cache_gib=1, memory=(40 * GIB, 80 * GIB))
  args = server.server_args("/tmp/model", 8123, num_slots=4, max_model_len=96, seed=3,
                            fields=fields)
  parsed = EngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(args))
  for name, value in fields.items():
    assert getattr(parsed, name) == value, name
  assert (parsed.max_num_seqs, parsed.max_model_len, parsed.seed) == (4, 96, 3)
  if platform == "gpu":
    assert parsed.dtype == "bfloat16" and not parsed.enforce_eager
    assert parsed.gpu_memory_utilization == 0.475 and parsed.kv_cache_memory_bytes == GIB


@pytest.mark.vllm
@needs_vllm
def test_the_vllm_installed_here_runs_on_cpu():
  env_lib.require_vllm()
  assert settings.platform() == "cpu"
