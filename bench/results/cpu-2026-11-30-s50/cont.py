import sys, json, time
sys.argv = sys.argv[:1]
import sampler as S
from common import SMOLLM2
model = S.make_model(SMOLLM2)
groups = S.workload(16, 4, SMOLLM2.vocab_size, 96)
out = []
for i in range(3):
  r = S.run_continuous(model, groups, 16, S.MAX_LEN, None, 1)
  out.append(r["tok_per_s"])
  s = S.run_static(model, groups, 16, S.MAX_LEN, None, 1)
  out.append(s["tok_per_s"])
print("RESULT", json.dumps([round(x, 1) for x in out]), flush=True)
