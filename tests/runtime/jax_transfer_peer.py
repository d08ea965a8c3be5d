"""A rollout worker's side of ``weights.transfer=jax_transfer`` in a process of its own (a script of
test_jax_transfer.py). 2 fake CPU devices; one JSON command per line on stdin, one reply per line on
stdout:

  {"cmd": "offer", "ticket": {...}}       hands a ticket to the receiver
  {"cmd": "fetch", "current": v | null}   fetch_newer(current): pulls onto the 2-device mesh and
                                          checks every array against peer_tree(version)
  {"cmd": "restart"}                      a fresh receiver (what a restarted worker builds)
"""

import json
import os
import pathlib
import sys

if __name__ == "__main__":  # (the test imports peer_tree from here too)
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[2])]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from areal_jax.runtime import jax_transfer  # noqa: E402


def peer_tree(version: int) -> dict:
  """The parameters of ``version`` (the publisher in the test builds the same)."""
  rng = np.random.default_rng(0)
  base = {"embed": rng.standard_normal((1024, 512), dtype=np.float32),
          "layers": {"w": rng.standard_normal((512, 1024), dtype=np.float32),
                     "b": rng.standard_normal((1000,), dtype=np.float32),
                     "scale": np.float32(rng.standard_normal())},
          "head": rng.standard_normal((64, 256), dtype=np.float32)}
  out = jax.tree.map(lambda x: (x + np.float32(version)).astype(np.float32), base)
  out["head"] = out["head"].astype(jax.numpy.bfloat16)
  return out


def target_and_shardings():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  specs = {"embed": P("x", None), "layers": {"w": P(None, "x"), "b": P(), "scale": P()},
           "head": P("x")}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        peer_tree(0), shardings)
  return target, shardings


def main():
  target, shardings = target_and_shardings()
  receiver = jax_transfer.JaxTransferReceiver(target)
  for line in sys.stdin:
    msg = json.loads(line)
    reply = {"ok": True}
    try:
      if msg["cmd"] == "offer":
        receiver.offer(msg["ticket"])
      elif msg["cmd"] == "fetch":
        found = receiver.fetch_newer(msg["current"])
        if found is None:
          reply["version"] = None
        else:
          version, params = found
          want = peer_tree(version)
          equal = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                      and a.dtype == b.dtype
                      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
          placed = all(a.sharding == s for a, s in zip(jax.tree.leaves(params),
                                                       jax.tree.leaves(shardings)))
          reply.update(version=version, equal=equal, placed=placed,
                       same_tree=jax.tree.structure(params) == jax.tree.structure(want))
      elif msg["cmd"] == "restart":
        receiver.close()
        receiver = jax_transfer.JaxTransferReceiver(target)
      else:
        raise ValueError(f"unknown command {msg['cmd']!r}")
    except Exception as e:  # pylint: disable=broad-except
      reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply), flush=True)


if __name__ == "__main__":
  main()
