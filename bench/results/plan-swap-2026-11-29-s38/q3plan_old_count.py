"""The :qwen3 sampler at 16k (one v5e chip, max_len 512 + 16384) planned by aot_decode.sampler_plan:
argv = slots, kv_pages, decode_attention, decode_layers[, max_new_tokens]. Run at f51ba0f (the
plan before session 38: 2 x weights + the larger program) for q3plan_old_count.txt."""
import os, sys, time, dataclasses
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "bench")]
import jax, aot_decode
from flax import nnx
from common import QWEN3_1P7B
from areal_jax.models import Transformer
from areal_jax.sampler.engine import EngineConfig
from areal_jax.sampler import memory
slots, pages, attn, layers = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
new = int(sys.argv[5]) if len(sys.argv) > 5 else 16384
dev = aot_decode.target_device("v5e:2x2")
model = Transformer(dataclasses.replace(QWEN3_1P7B, dtype="bfloat16"), nnx.Rngs(0))
t = time.time()
p = aot_decode.sampler_plan(dev, model, EngineConfig(num_slots=slots, max_len=512 + new,
    prefill_buckets=(64, 128, 256, 512), steps_per_call=16, decode_attention=attn,
    decode_layers=layers, kv_pages=pages, page_size=64, max_prefill_tokens=4096),
    budget_bytes=int(0.9 * 16 * 2**30))
print(sys.argv[1:], f"{time.time()-t:.0f}s", p.summary(), "fits" if p.fits else "DOES NOT FIT",
      "slots_that_fit", p.slots_that_fit(), flush=True)
