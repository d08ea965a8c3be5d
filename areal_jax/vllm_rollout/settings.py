"""What vLLM runs with, chosen by the platform its build runs on, in one place for both engines.

vLLM's platform is its build's (``vllm.platforms.current_platform``): the CPU wheel ``make
install-vllm`` installs, or a CUDA (or ROCm) build on a GPU host. ``engine_fields`` gives the
``vllm.EngineArgs`` fields that differ between them (the in-process engine passes them as they
are, the server engine as its command line, ``cli_args``), ``environment`` the variables:

* CPU: float32, eager (nothing to compile or capture), ``kv_cache_gib`` of KV cache in host memory
  (``VLLM_CPU_KVCACHE_SPACE``; 0 or less: ``CPU_KV_CACHE_GIB``), ``num_threads`` torch threads, no
  torch.compile;
* GPU: bfloat16, vLLM's torch.compile and CUDA graphs (its defaults), ``kv_cache_gib`` of KV cache
  on the device (``kv_cache_memory_bytes``; 0 or less: vLLM sizes it from its memory share), and
  that share (``gpu_memory_utilization``) by default what is free on the device when the engine
  starts, less ``HEADROOM_GIB``: a JAX learner on the same GPU holds 75% of it by default
  (JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``), and vLLM refuses to start when its share is more
  than is free (not yet tried with vLLM on a GPU).

``dtype`` ``"auto"`` is the platform's; any other value is passed to vLLM as it is.
"""

from __future__ import annotations

import os

GPU = "gpu"
PLATFORMS = ("cpu", GPU)
HEADROOM_GIB = 2.0  # what a share chosen from the free memory leaves (vLLM's own CUDA context...)
MAX_SHARE = 0.92  # vLLM's own default share, the most the automatic one takes
MIN_SHARE = 0.02  # below it the automatic share is an error, not a start that fails later
GIB = 1 << 30
CPU_KV_CACHE_GIB = 1.0  # host memory for vLLM's KV cache on CPU where kv_cache_gib leaves it


def platform() -> str:
  """``"cpu"`` or ``"gpu"`` (CUDA or ROCm): the platform of the vLLM build installed here (vLLM
  must be installed); raises ``ValueError`` for another one (e.g. TPU), naming it."""
  from vllm.platforms import current_platform
  if current_platform.is_cpu():
    return "cpu"
  if current_platform.is_cuda_alike():
    return GPU
  raise ValueError(f"rollout.backend='vllm': vLLM's platform here is "
                   f"{current_platform.device_type!r}; this backend runs vLLM on {PLATFORMS} "
                   "(on a TPU use rollout.backend='jax')")


def device_memory() -> tuple[int, int] | None:
  """``(free, total)`` bytes of the first GPU this process sees, read through NVML (no CUDA
  context is created); None where NVML is not there to ask (e.g. ROCm: vLLM's own default
  share then)."""
  try:
    import pynvml
  except ImportError:
    return None
  try:
    pynvml.nvmlInit()
  except Exception:  # noqa: BLE001  (no driver)
    return None
  try:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    handle = (pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-"))
              else pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0))
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.free), int(info.total)
  except Exception:  # noqa: BLE001
    return None
  finally:
    pynvml.nvmlShutdown()


def memory_share(requested: float, memory: tuple[int, int] | None) -> float | None:
  """The GPU memory share vLLM is given: ``requested`` when above 0, else what ``memory``
  (``(free, total)`` bytes) leaves free less ``HEADROOM_GIB``, at most ``MAX_SHARE`` (None when
  ``memory`` is not known: vLLM's default). Raises ``ValueError`` naming the keys to change when
  too little is free."""
  if requested != 0:
    if not 0 < requested <= 1:
      raise ValueError(f"rollout.vllm.gpu_memory_utilization={requested}: expected a fraction of "
                       "the GPU's memory in (0, 1], or 0 for what is free when vLLM starts")
    return float(requested)
  if memory is None:
    return None
  free, total = memory
  share = (free - HEADROOM_GIB * GIB) / total
  if share < MIN_SHARE:
    raise ValueError(
        f"rollout.backend='vllm' on a GPU: {free / GIB:.1f} of its {total / GIB:.1f} GiB are free "
        f"when vLLM starts, under the {HEADROOM_GIB:g} GiB it leaves plus {MIN_SHARE:.0%} for "
        "itself. A JAX learner on the same GPU takes 75% of it by default: lower its share with "
        "XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.5) or XLA_PYTHON_CLIENT_PREALLOCATE=false, or "
        "set rollout.vllm.gpu_memory_utilization")
  return round(min(MAX_SHARE, share), 3)


def compute_dtype(platform_: str, dtype: str = "auto") -> str:
  """vLLM's compute dtype on ``platform_`` for ``dtype`` (``"auto"``: float32 on CPU, bfloat16 on
  a GPU); the engines write each weight version in it."""
  return dtype if dtype != "auto" else ("bfloat16" if platform_ == GPU else "float32")


def engine_fields(platform_: str, *, dtype: str = "auto", kv_cache_gib: float = 0.0,
                  gpu_memory_utilization: float = 0.0,
                  memory: tuple[int, int] | None = None) -> dict:
  """The ``vllm.EngineArgs`` fields of ``platform_`` (``PLATFORMS``) that this backend sets (the
  rest, the same everywhere, are the engines'); ``memory``: the GPU's ``(free, total)`` bytes
  (``device_memory()``), for the automatic share."""
  if platform_ not in PLATFORMS:
    raise ValueError(f"vLLM platform {platform_!r}: expected one of {PLATFORMS}")
  gpu = platform_ == GPU
  fields = {"dtype": compute_dtype(platform_, dtype),
            "enforce_eager": not gpu, "distributed_executor_backend": "uni"}
  if gpu:
    if kv_cache_gib > 0:
      fields["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
    share = memory_share(gpu_memory_utilization, memory)
    if share is not None:
      fields["gpu_memory_utilization"] = share
  return fields


def engine_fields_here(platform_: str, **chosen) -> dict:
  """``engine_fields`` with ``chosen`` (its keyword arguments but ``memory``) for an engine about
  to start here: on a GPU with the device's memory as it is now (``device_memory``)."""
  return engine_fields(platform_, memory=device_memory() if platform_ == GPU else None, **chosen)


def environment(platform_: str, cache_dir: str, kv_cache_gib: float = 0.0,
                num_threads: int | None = None, bind_threads: bool = False) -> dict[str, str]:
  """Environment variables for vLLM on ``platform_``, every cache under ``cache_dir``:

  * one process, no engine-core subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
  * caches under ``cache_dir``, no usage statistics;
  * on CPU also: no torch.compile / inductor (``TORCHDYNAMO_DISABLE=1``; the engine is eager),
    ``kv_cache_gib`` GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``; 0 or less:
    ``CPU_KV_CACHE_GIB``), ``num_threads`` torch threads
    (``OMP_NUM_THREADS``; default: every core of this process, otherwise vLLM drops to one
    thread) and no OpenMP core pinning unless ``bind_threads`` (pinning an in-process engine
    would also pin the JAX learner's threads sharing the process)."""
  env = {
      "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
      "VLLM_CACHE_ROOT": os.path.join(cache_dir, "vllm"),
      "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
      "VLLM_NO_USAGE_STATS": "1",
      "VLLM_DO_NOT_TRACK": "1",
  }
  if platform_ == "cpu":
    env.update({
        "TORCHDYNAMO_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib if kv_cache_gib > 0 else CPU_KV_CACHE_GIB:g}",
        "VLLM_CPU_OMP_THREADS_BIND": "auto" if bind_threads else "nobind",
        "OMP_NUM_THREADS": str(num_threads or len(os.sched_getaffinity(0))),
    })
  return env


def cli_args(fields: dict) -> list[str]:
  """``fields`` (``EngineArgs`` names) as vLLM's command line: ``--name value``, a flag for True,
  nothing for False."""
  args = []
  for name, value in fields.items():
    flag = "--" + name.replace("_", "-")
    if value is True:
      args.append(flag)
    elif value is not False and value is not None:
      args += [flag, str(value)]
  return args
