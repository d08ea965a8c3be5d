"""bench/paged_cache.py's workload on the engine the plan before session 39 chose within the
planned case's budget (oldfit.py: 16 slots over a pool of 144 pages, following them)."""
import dataclasses, json, sys
sys.path.insert(0, "bench")
import paged_cache
import sampler as sampler_bench
from common import SMOLLM2
model = sampler_bench.make_model(dataclasses.replace(SMOLLM2, dtype="float32"))
work = paged_cache.workload(24, SMOLLM2.vocab_size, 512 - paged_cache.PROMPT)
print(json.dumps(paged_cache.run(model, work, 16, 512, kv_pages=144)))
