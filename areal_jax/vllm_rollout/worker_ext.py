"""Worker-side weight loading, mixed into vLLM's worker through ``worker_extension_cls``.

``collective_rpc("load_policy_weights", kwargs={"weights_path": DIR})`` (in-process, or
``POST /collective_rpc`` on a server) runs vLLM's own ``reload_weights`` and then repacks the
weights of embedding-backed output layers.

Why the repack: on CPU, vLLM computes the LM head through a packed copy of its weight (a oneDNN
handle built once by ``process_weights_after_loading``). ``reload_weights`` refreshes that copy for
layers that receive tensors from the checkpoint, but a head *tied* to the input embeddings
(``tie_word_embeddings``: the tiny test models and SmolLM2) receives none, so it keeps computing
logits with the first weights (measured in vLLM 0.32: logprob errors of ~1 nat after a reload). Re-running
the embedding method's ``process_weights_after_loading`` rebuilds the packed copy from the reloaded
(shared) weight; for an untied head it is a harmless second repack.

This module imports only torch and vLLM (it runs inside the vLLM worker, possibly in a server
process without JAX).
"""

from __future__ import annotations


def repack_embedding_heads(model) -> int:
  """Rebuilds the packed CPU weights of every embedding-method layer; returns how many."""
  from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

  n = 0
  for module in model.modules():
    method = getattr(module, "quant_method", None)
    if isinstance(method, UnquantizedEmbeddingMethod) and hasattr(module, "cpu_linear"):
      method.process_weights_after_loading(module)
      n += 1
  return n


class PolicyWeightSync:
  """Methods added to vLLM's worker class (``EngineArgs.worker_extension_cls``)."""

  def load_policy_weights(self, weights_path: str) -> dict:
    """Loads the Hugging Face safetensors in ``weights_path`` into the running model."""
    self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
    repacked = repack_embedding_heads(self.model_runner.get_model())
    return {"weights_path": weights_path, "repacked_heads": repacked}
