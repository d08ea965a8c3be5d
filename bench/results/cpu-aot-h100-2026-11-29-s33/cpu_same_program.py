"""The CPU decode program of an engine (SmolLM2 widths, 4 layers, the C++ kernels as shipped), its
compiled text written to argv[1]: run with the code before and after, then compared."""
import sys
import jax
import numpy as np
from flax import nnx
from areal_jax.models import ModelConfig, Transformer
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
cfg = ModelConfig(vocab_size=49152, d_model=576, n_layers=4, n_heads=9, n_kv_heads=3, head_dim=64,
                  d_ff=1536, tie_embeddings=True)
eng = DecodeEngine(Transformer(cfg, nnx.Rngs(0)), EngineConfig(num_slots=8, max_len=128))
pages = ()
text = eng._make_generate(eng.kv_buckets[-1], 8).lower(eng.params, eng.state_shapes()).compile().as_text()
open(sys.argv[1], "w").write(text)
print(eng.attention_impl, eng.matmul_impl, eng.truncation_on_host, len(text))
