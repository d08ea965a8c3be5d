"""Weights from the learner to a rollout worker in another process: Orbax vs jax_transfer.

  python bench/weight_transfer.py [--quick] [--versions N] [--dtypes float32,bfloat16] [--json PATH]

For each model (the tiny test model, and a random model of SmolLM2-135M's shape: vocab 49152,
d_model 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, d_ff 1536; float32) and each
``weights.transfer`` that crosses processes, this process plays the learner and one worker process
(this script with ``--worker``) plays a rollout worker, as in ``runtime.mode=ray``:

  orbax         ``OrbaxPublisher.publish(wait=False)`` (the learner waits for the copy out of device
                memory only) into a temporary directory; the worker polls it every 20 ms like
                ``ray_worker`` (``OrbaxReceiver.fetch_newer``) and restores onto its device.
  jax_transfer  ``JaxTransferPublisher.publish`` + ``ticket`` (a device copy, dispatched); the
                worker pulls over loopback sockets (``JaxTransferReceiver.fetch_newer``).

Per version: ``blocked_s``, the seconds the learner's call took (publish, plus the ticket for
jax_transfer), and ``until_worker_s``, from the start of that call until the worker holds the new
arrays on its device (both clocks are this machine's). The first version (connection set-up, first
directory) is reported apart; medians are over the others. Memory is not measured.

Each row runs per ``--dtypes`` entry: ``float32`` publishes the learner's weights as they are;
``bfloat16`` casts them on the learner's device first (``weight_transfer.version_dtype`` of a
bfloat16 sampler: what a run does), and the worker restores into ``weight_transfer.cast_target``:
half the bytes cross.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from areal_jax.models import Transformer  # noqa: E402
from areal_jax.runtime import jax_transfer, weight_transfer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SMOLLM2, TINY, finish, machine  # noqa: E402

MODELS = {"tiny": TINY, "smollm2-135m": SMOLLM2}
MODES = ("orbax", "jax_transfer")


def abstract_params(cfg) -> dict:
  """The model's parameters as ``ShapeDtypeStruct`` on this process's first device."""
  state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                      nnx.to_pure_dict(state))


# ---- the worker process ------------------------------------------------------------------------
def worker(model: str, mode: str, path: str, dtype: str) -> None:
  target = weight_transfer.cast_target(abstract_params(MODELS[model]), dtype)
  receiver = (weight_transfer.OrbaxReceiver(path, target) if mode == "orbax"
              else jax_transfer.JaxTransferReceiver(target))
  current = None
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("ticket"):
      receiver.offer(msg["ticket"])
    while True:
      found = receiver.fetch_newer(current)
      if found is not None and found[0] >= msg["version"]:
        break
      time.sleep(0.02)  # Orbax: not finalized yet (ray_worker polls the same way)
    current = found[0]
    print(json.dumps({"version": current, "done": time.time()}), flush=True)
  receiver.close()


# ---- the learner (this process) ----------------------------------------------------------------
def run(model: str, mode: str, versions: int, dtype: str = "float32") -> dict:
  cfg = MODELS[model]
  params = nnx.to_pure_dict(nnx.state(Transformer(cfg, nnx.Rngs(0)), nnx.Param))
  mib = weight_transfer.version_bytes(params, dtype) / 2**20
  bump = jax.jit(lambda t, v: jax.tree.map(lambda x: x + v, t))
  tmp = tempfile.mkdtemp(prefix="bench_weights_")
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", model, mode, tmp,
                           dtype],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  pub = (weight_transfer.OrbaxPublisher(tmp, keep=2, dtype=dtype) if mode == "orbax"
         else jax_transfer.JaxTransferPublisher("127.0.0.1", dtype))
  rows = []
  try:
    assert json.loads(proc.stdout.readline()).get("ready"), "the worker did not start"
    for v in range(1, versions + 1):
      params = jax.block_until_ready(bump(params, 1.0))  # the learner's new version
      t0 = time.time()
      if mode == "orbax":
        pub.publish(params, v, wait=False)
        ticket = None
      else:
        pub.publish(params, v)
        ticket = pub.ticket(0)
      blocked = time.time() - t0
      proc.stdin.write(json.dumps({"version": v, "ticket": ticket}) + "\n")
      proc.stdin.flush()
      reply = json.loads(proc.stdout.readline())
      assert reply["version"] == v, reply
      rows.append({"version": v, "blocked_s": blocked, "until_worker_s": reply["done"] - t0})
      if mode == "orbax":
        pub.wait()  # finalized already (the worker read it): only the bookkeeping
  finally:
    proc.stdin.close()
    proc.wait(timeout=60)
    pub.close()
    shutil.rmtree(tmp, ignore_errors=True)
  rest = rows[1:] or rows
  return {"model": model, "transfer": mode, "dtype": dtype, "MiB": mib, "versions": rows,
          "first_until_worker_s": rows[0]["until_worker_s"],
          "blocked_s": statistics.median(r["blocked_s"] for r in rest),
          "until_worker_s": statistics.median(r["until_worker_s"] for r in rest),
          "max_until_worker_s": max(r["until_worker_s"] for r in rest)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="3 versions per row")
  ap.add_argument("--versions", type=int, default=6, help="versions published per row")
  ap.add_argument("--models", default="tiny,smollm2-135m")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="the dtypes a version is published in (cast on the learner's device)")
  ap.add_argument("--json", default=None, help="write results to this path")
  ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "DIR", "DTYPE"),
                  help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    worker(*args.worker)
    return
  t_start = time.perf_counter()
  versions = 3 if args.quick else args.versions
  info = machine()
  print(f"machine: {info}")
  dtypes = args.dtypes.split(",")
  results = [run(m, mode, versions, d) for m in args.models.split(",") for d in dtypes
             for mode in MODES]
  print(f"\n{'model':14} {'dtype':9} {'MiB':>7} {'transfer':13} {'blocked s':>10} "
        f"{'worker has s':>13} {'max s':>7} {'first s':>8}")
  for r in results:
    print(f"{r['model']:14} {r['dtype']:9} {r['MiB']:7.1f} {r['transfer']:13} "
          f"{r['blocked_s']:10.4f} {r['until_worker_s']:13.3f} {r['max_until_worker_s']:7.3f} "
          f"{r['first_until_worker_s']:8.3f}")
  ratios = {}
  for m in args.models.split(","):
    row = lambda t, d: next(r for r in results  # noqa: E731
                            if r["model"] == m and r["transfer"] == t and r["dtype"] == d)
    o, j = row("orbax", dtypes[0]), row("jax_transfer", dtypes[0])
    ratios[m] = {"until_worker_orbax_over_jax": o["until_worker_s"] / j["until_worker_s"],
                 "blocked_orbax_over_jax": o["blocked_s"] / max(j["blocked_s"], 1e-9)}
    print(f"{m} ({dtypes[0]}): worker has the weights "
          f"{ratios[m]['until_worker_orbax_over_jax']:.2f}x sooner with jax_transfer; learner "
          f"blocked {ratios[m]['blocked_orbax_over_jax']:.1f}x less")
    for d in dtypes[1:]:
      for t in MODES:
        key = f"until_worker_{t}_{d}_over_{dtypes[0]}"
        ratios[m][key] = row(t, d)["until_worker_s"] / row(t, dtypes[0])["until_worker_s"]
        print(f"{m} {t}: the worker has a {d} version in {ratios[m][key]:.2f}x the time of a "
              f"{dtypes[0]} one")
  finish({"machine": info, "versions": versions, "rows": results, "ratios": ratios}, args.json,
         t_start)


if __name__ == "__main__":
  main()
