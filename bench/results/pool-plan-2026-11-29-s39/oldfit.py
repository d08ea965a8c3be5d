"""The slots the memory plan before session 39 (960ff46) took in bench/paged_cache.py's planned
case: 64 slots asked, a paged pool following them, within the budget of 16 slots' pool."""
import dataclasses, json, os, sys
sys.path.insert(0, "bench")
os.environ["AREAL_JAX_PAGED_CACHE"] = "1"
import sampler as sampler_bench
from common import SMOLLM2
from areal_jax.sampler import memory
from areal_jax.sampler.service import JaxRolloutEngine
budget = int(sys.argv[1])
model = sampler_bench.make_model(dataclasses.replace(SMOLLM2, dtype="float32"))
make = lambda n: JaxRolloutEngine(model, num_slots=n, max_len=512, prefill_buckets=(32,),
                                  eos_token_ids=(), decode_layers="scan", decode_matmul="xla",
                                  decode_attention="dense", kv_pages=-1, page_size=64)
holder, plan = memory.fit(make, 64, min_slots=4, budget_bytes=budget)
print(json.dumps({"slots": plan.num_slots, "kv_pages": plan.kv_pages}))
