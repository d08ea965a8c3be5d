"""Matmul throughput at decode shapes, XLA:CPU's against the packed-weight CPU kernel
(``areal_jax/kernels/cpu_matmul.py``): what bounds the sampler's roofline fraction.

  python bench/decode_matmul.py [--json PATH]

The matmuls of one SmolLM2-135M decode step (per layer q, k, v, o, gate, up, down; then the tied
LM head), float32, for M rows (slots), in one jitted function, once with XLA's matmuls (``xla``)
and once with the weights packed for the kernel (``kernel``, when it is available):
  * ``cold``: every layer its own weights (540 MB, read from memory each step, as in decoding);
  * ``hot``: every layer layer 0's weights (14 MB, mostly served from the caches).
Each row reports GFLOP/s and its fraction of the 2048^3 float32 matmul rate measured in the same
run (the throughput ``bench/sampler.py``'s roofline uses), and the weight bytes streamed per second
against the measured read bandwidth. At M=64 the step is compute-bound on paper (64 FLOPs per 4-byte
weight), so the matmul rate at 64 rows is what keeps a decode step from the roofline or near it.
Runs in about 20 seconds on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from areal_jax.kernels import cpu_matmul
from areal_jax.models.transformer import linear
from common import SMOLLM2, Hardware, best_time, machine


def weights(cfg, layers: int, seed: int = 0):
  e, f, q, kv = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  shapes = {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e), "gate": (e, f), "up": (e, f),
            "down": (f, e)}
  key = jax.random.key(seed)
  out = []
  for i in range(layers):
    key, *ks = jax.random.split(key, len(shapes) + 1)
    out.append({n: jax.random.normal(k, s, jnp.float32) * 0.02 for k, (n, s) in zip(ks, shapes.items())})
  return out


@jax.jit
def step_matmuls(x_MxE, layers, embed_VxE):
  """The decode step's matmuls in order (the elementwise glue is a small fraction of the time),
  through ``transformer.linear``: XLA's matmuls, or the CPU kernel for weights packed for it."""
  for w in layers:
    q, k, v = linear(x_MxE, w["q"]), linear(x_MxE, w["k"]), linear(x_MxE, w["v"])
    x_MxE = x_MxE + linear(q + jnp.tile(k + v, (1, q.shape[1] // k.shape[1])), w["o"])
    x_MxE = x_MxE + linear(jax.nn.silu(linear(x_MxE, w["gate"])) * linear(x_MxE, w["up"]), w["down"])
  return linear(x_MxE, embed_VxE, transpose_w=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", default=None, help="write results to this path")
  args = ap.parse_args()
  cfg, info, hw = SMOLLM2, machine(), Hardware().probe(3)
  cold = weights(cfg, cfg.n_layers)
  hot = [cold[0]] * cfg.n_layers
  embed = jax.random.normal(jax.random.key(1), (cfg.vocab_size, cfg.d_model), jnp.float32) * 0.02
  n_weights = sum(w.size for w in jax.tree.leaves(cold)) + embed.size
  kinds = [("xla", cold, hot, embed)]
  if cpu_matmul.available():
    pcold = [{n: cpu_matmul.pack(w) for n, w in layer.items()} for layer in cold]
    kinds.append(("kernel", pcold, [pcold[0]] * cfg.n_layers, cpu_matmul.pack(embed, True)))
  rows = []
  for m in (16, 64, 256):
    x = jax.random.normal(jax.random.key(2), (m, cfg.d_model), jnp.float32)
    for kind, cold_w, hot_w, head in kinds:
      for label, layers in (("cold", cold_w), ("hot", hot_w)):
        hw.probe()
        s = best_time(step_matmuls, x, layers, head, reps=5)
        f = hw.figures()
        gflops = 2 * m * n_weights / s / 1e9
        rows.append({"rows": m, "matmul": kind, "weights": label, "ms": s * 1e3, "GFLOPps": gflops,
                     "frac_of_2048_matmul": gflops / f["matmul_GFLOPps"],
                     "weight_GBps": 4 * n_weights / s / 1e9, "read_GBps": f["read_GBps"]})
  f = hw.figures()
  print(f"machine: {info['cpu']}, {info['cores']} cores, jax {info['jax']}; read "
        f"{f['read_GBps']:.1f} GB/s, 2048^3 matmul {f['matmul_GFLOPps']:.0f} GFLOP/s (f32)")
  print(f"{'rows':>5} {'matmul':>7} {'weights':>7} {'ms':>8} {'GFLOP/s':>8} {'of 2048^3':>9} "
        f"{'weights GB/s':>12}")
  for r in rows:
    print(f"{r['rows']:>5} {r['matmul']:>7} {r['weights']:>7} {r['ms']:8.2f} {r['GFLOPps']:8.1f} "
          f"{100 * r['frac_of_2048_matmul']:8.0f}% {r['weight_GBps']:12.1f}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"machine": info, "hardware": f, "model": "smollm2-135m shapes, float32",
                 "weights_MB": 4 * n_weights / 1e6, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  main()
