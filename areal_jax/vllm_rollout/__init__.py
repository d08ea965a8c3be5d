"""vLLM as a rollout backend, behind the same ``RolloutEngine`` interface as the JAX sampler.

Two engines, both driven with token ids (no text crosses the interface):

* ``VllmInProcessEngine`` (``inprocess.py``): vLLM's ``LLMEngine`` in this process, stepped by one
  background thread.
* ``VllmServerEngine`` (``server.py``): a vLLM OpenAI-compatible server on 127.0.0.1 (started here as
  a subprocess, or an existing one), streamed over HTTP.

Both sample each of a group's ``n`` sequences as its own vLLM request (the prompt's KV blocks are
shared through vLLM's prefix cache), return per-token behaviour logprobs in the learner's convention
(``logprobs_mode="processed_logprobs"``; see ``sampling.py`` for the one difference, under top-k /
top-p), and implement partial rollouts: on ``update_params`` the weights are written as Hugging Face
safetensors (``weights.py``), in-flight requests are aborted with their partial tokens and logprobs,
vLLM reloads the weights and resets its prefix cache, and every aborted sequence is resubmitted as
prompt + partial output with the remaining token budget. Each token records the policy version that
produced it.

vLLM is an optional dependency: importing this package never imports vLLM. Building an engine without
vLLM installed raises ``VllmNotInstalledError`` with the install command (``make install-vllm``).
"""

from areal_jax.vllm_rollout.env import VllmNotInstalledError, require_vllm, vllm_available

__all__ = ["VllmNotInstalledError", "require_vllm", "vllm_available", "VllmInProcessEngine",
           "VllmServerEngine", "build"]


def __getattr__(name):  # lazy: the engines import vLLM (in-process) or start it (server)
  if name == "VllmInProcessEngine":
    from areal_jax.vllm_rollout.inprocess import VllmInProcessEngine
    return VllmInProcessEngine
  if name == "VllmServerEngine":
    from areal_jax.vllm_rollout.server import VllmServerEngine
    return VllmServerEngine
  if name == "build":
    from areal_jax.vllm_rollout.factory import build
    return build
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
