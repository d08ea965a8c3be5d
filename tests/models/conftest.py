"""Fixtures for the model tests: tiny random Qwen2 / Llama / Qwen3 checkpoints written by
``transformers``."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300


def _tiny_hf_model(arch: str):
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2)
  torch.manual_seed({"qwen2": 0, "llama": 1, "qwen3": 2, "qwen3-tied": 3}[arch])
  if arch == "qwen2":  # GQA, q/k/v biases, untied embeddings
    config = transformers.Qwen2Config(rope_theta=10000.0, tie_word_embeddings=False, **common)
    model = transformers.Qwen2ForCausalLM(config)
  elif arch.startswith("qwen3"):  # GQA, per-head q/k RMSNorm, no biases; untied and tied
    config = transformers.Qwen3Config(rope_theta=1e6, tie_word_embeddings=arch == "qwen3-tied",
                                      attention_bias=False, **common)
    model = transformers.Qwen3ForCausalLM(config)
  else:  # tied embeddings, a different rope base
    config = transformers.LlamaConfig(rope_theta=50000.0, tie_word_embeddings=True, **common)
    model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # make biases and norm scales nonzero / non-trivial
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.2)
  return model.eval()


@pytest.fixture(scope="session", params=["qwen2", "llama", "qwen3", "qwen3-tied"])
def hf_checkpoint(request, tmp_path_factory):
  """(arch, directory, torch model) of a tiny random checkpoint saved with save_pretrained."""
  model = _tiny_hf_model(request.param)
  path = tmp_path_factory.mktemp(f"hf_{request.param}")
  model.save_pretrained(path)
  return request.param.split("-")[0], path, model


@pytest.fixture(scope="session")
def torch_logits():
  """``torch_logits(hf_model, tokens_BxL) -> logits_BxLxV`` (float32 NumPy)."""

  def run(model, tokens_BxL) -> np.ndarray:
    with torch.no_grad():
      return model(torch.as_tensor(np.asarray(tokens_BxL))).logits.float().numpy()

  return run
