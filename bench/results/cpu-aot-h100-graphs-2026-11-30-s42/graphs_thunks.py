"""Host launches a decode step of ours compiled for an H100 on a CPU machine (XLA's AOT with JAX's
CUDA plugin; see bench/aot_decode.py for the venv), with and without the decode call's loop in
command buffers (choice.Launch.graphs): the top-level thunks of the loop's body in XLA's thunk
sequence after its thunk passes (each a launch by the host; a command buffer, a CUDA graph, one)
and the thunks inside its command buffers.

  /tmp/cuda/bin/python bench/results/cpu-aot-h100-graphs-2026-11-30-s42/graphs_thunks.py \
      --matmul blas --graphs none,while,unrolled
"""
import argparse
import dataclasses
import glob
import re
import sys
import tempfile

sys.path.insert(0, "bench")
import aot_decode  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.kernels import choice  # noqa: E402
from areal_jax.kernels.pallas_attention import PagedTuning  # noqa: E402
from areal_jax.models import Transformer  # noqa: E402


def host_launches(path):
  """(top-level thunks of the while body, of which command buffers, thunks inside them)."""
  body, top, buffers, inner = False, 0, 0, 0
  for line in open(path).read().splitlines():
    if line.strip() == "body:":
      body = True
      continue
    m = re.match(r"(\s*)\d+: (k\w+)", line)
    if not body or not m:
      continue
    if len(m.group(1)) == 4:
      top, buffers = top + 1, buffers + (m.group(2) == "kCommandBuffer")
    elif len(m.group(1)) >= 8:
      inner += 1
  return top, buffers, inner


ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--matmul", default="blas")
ap.add_argument("--graphs", default="none,while,unrolled")
args = ap.parse_args()
cfg, slots, ctx = aot_decode.SHAPES[args.model]
cfg = dataclasses.replace(cfg, dtype="bfloat16")
device = aot_decode.target_device("h100")
model = Transformer(cfg, nnx.Rngs(0))
for g in args.graphs.split(","):
  g = "" if g == "none" else g
  dump = tempfile.mkdtemp(prefix="graphs_")
  extra = {**choice.Launch(None, PagedTuning(), g).compiler_options(), "xla_dump_to": dump}
  fn, fargs = aot_decode._program("ours", cfg, slots, ctx, 16, "pallas_gpu", "unrolled", device,  # noqa: SLF001
                                  args.matmul, model, 64, extra)
  with choice.lowering_for("cuda"):
    choice.lower(fn, fargs, "cuda", device.device_kind).compile()
  top, buffers, inner = host_launches(glob.glob(f"{dump}/*after_thunk_passes.txt")[0])
  print(f"{args.model} matmul={args.matmul} graphs={g or 'none'} launch={choice.pallas_gpu_tuning()} "
        f"norms={choice.NORM_MATMUL_ENV in __import__('os').environ}: {top} host launches a step "
        f"({buffers} command buffers holding {inner} thunks)", flush=True)
