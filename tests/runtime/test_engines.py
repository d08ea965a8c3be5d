"""runtime.engines: a backend that needs full weights gets LoRA adapters merged into its base."""

import jax
import numpy as np
from flax import nnx

from areal_jax.models import ModelConfig, Transformer, lora
from areal_jax.runtime.engines import MergingEngine


class FakeEngine:
  def __init__(self):
    self.updates = []

  def update_params(self, params, version):
    self.updates.append((params, version))

  def poll(self, timeout=0.0):
    return ["sample"]


def test_merging_engine_hands_merged_weights_and_passes_the_rest_through():
  model = Transformer(ModelConfig(vocab_size=32), nnx.Rngs(0))
  base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  lcfg = lora.LoraConfig(rank=2, alpha=4.0, targets=("up_proj",))
  ad = lora.init_adapters(base, lcfg, jax.random.key(0))
  ad = jax.tree.map(lambda x: x + 0.5, ad)
  inner = FakeEngine()
  engine = MergingEngine(inner, model, lcfg)
  engine.update_params(ad, 3)
  merged, version = inner.updates[-1]
  assert version == 3 and not lora.is_adapters(merged)
  want = lora.merge(base, ad, lcfg)
  np.testing.assert_array_equal(merged["layers"][1]["mlp"]["up"], want["layers"][1]["mlp"]["up"])
  assert np.abs(np.asarray(merged["layers"][1]["mlp"]["up"] - base["layers"][1]["mlp"]["up"])).max() > 0
  engine.update_params(base, 4)  # full weights go through untouched
  assert inner.updates[-1] == (base, 4)
  assert engine.poll() == ["sample"]
