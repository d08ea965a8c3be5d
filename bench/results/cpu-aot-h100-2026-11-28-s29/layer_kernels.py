"""The launching instructions of a decode program's step loop, in order (for reading a layer's
kernels off an HLO dump of ``bench/aot_decode.py --dump DIR``):

  python bench/results/cpu-aot-h100-2026-11-28-s29/layer_kernels.py DIR/ours_unrolled_blas.hlo
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # bench/
from aot_decode import _FREE, _computations, _kind, _opcode  # noqa: E402

comps, _ = _computations(open(sys.argv[1]).read())
bodies = [re.search(r"body=%([^,\s]+)", x).group(1) for lines in comps.values() for x in lines
          if _opcode(x) == "while"]
body = max(bodies, key=lambda b: sum(_opcode(x) not in _FREE for x in comps[b]))
for line in comps[body]:
  op = _opcode(line)
  if op and op not in _FREE:
    name, rest = line.split(" = ", 1)
    print(f"{_kind(op, line):34s} {name.strip()[:40]:40s} {rest.split(' ')[0][:50]}")
