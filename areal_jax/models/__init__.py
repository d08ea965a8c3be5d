"""Model layer: the transformer and its checkpoint formats. Knows nothing of sampling or training."""

from areal_jax.models.transformer import Cache, ModelConfig, Transformer, init_cache

__all__ = ["Cache", "ModelConfig", "Transformer", "init_cache"]
