"""weights.transfer=jax_transfer: the learner (this process) publishes, a worker in a process of its
own (jax_transfer_peer.py, 2 CPU devices) pulls over loopback sockets onto its own shardings."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import config as config_lib
from areal_jax.runtime import jax_transfer as jt

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from jax_transfer_peer import peer_tree  # noqa: E402  (the same trees on both sides)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEER = pathlib.Path(__file__).with_name("jax_transfer_peer.py")


class Peer:
  """The worker process: one JSON command per line, one reply per line."""

  def __init__(self):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    self.proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)

  def __call__(self, **msg) -> dict:
    self.proc.stdin.write(json.dumps(msg) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    assert line, f"the peer exited (rc {self.proc.poll()})"
    return json.loads(line)

  def close(self):
    self.proc.stdin.close()
    try:
      self.proc.wait(timeout=30)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def peer():
  p = Peer()
  yield p
  p.close()


@pytest.fixture(scope="module")
def publisher():
  pub = jt.JaxTransferPublisher("127.0.0.1")
  yield pub
  pub.close()


def learner_params(version):
  """``peer_tree(version)`` as the learner holds it: sharded over devices 2 and 3 (not the
  publisher's device 0, so publishing gathers)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[2:4]), ("fsdp",))
  tree = peer_tree(version)
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp") if np.ndim(x) and
                                                                np.shape(x)[0] % 2 == 0 else P())),
                      tree)


@jax.jit
def _zero(tree):
  return jax.tree.map(lambda x: x * 0, tree)


def _zero_donated(tree):
  return jax.jit(_zero, donate_argnums=0)(tree)


def test_a_worker_process_pulls_each_version_onto_its_shardings(peer, publisher):
  assert publisher.ticket(0) is None  # nothing published yet
  for version in (1, 2):
    params = learner_params(version)
    blocked = publisher.publish(params, version)
    assert blocked < 5.0
    params = _zero_donated(params)  # the learner reuses its buffers at once
    ticket = publisher.ticket(0)
    assert ticket["version"] == version and ticket["address"] == publisher.address
    assert peer(cmd="offer", ticket=ticket)["ok"]
    got = peer(cmd="fetch", current=version - 1)
    assert got == dict(ok=True, version=version, equal=True, placed=True, same_tree=True), got
  assert peer(cmd="fetch", current=2) == dict(ok=True, version=None)  # nothing newer
  with pytest.raises(ValueError, match="versions must be ints that increase"):
    publisher.publish(learner_params(0), 2)


def test_a_worker_that_missed_a_version_gets_the_newest(peer, publisher):
  publisher.publish(learner_params(3), 3)
  older = publisher.ticket(0)
  publisher.publish(learner_params(4), 4)
  newest = publisher.ticket(0)  # the same entry, now holding version 4
  assert older["uuid"] == newest["uuid"] and older["version"] == 3
  assert peer(cmd="offer", ticket=older)["ok"]  # the worker pulls before version 4's ticket came
  assert peer(cmd="fetch", current=2) == dict(ok=True, version=4, equal=True, placed=True,
                                              same_tree=True)
  assert peer(cmd="offer", ticket=newest)["ok"]
  assert peer(cmd="fetch", current=4) == dict(ok=True, version=None)  # has it already


def test_a_restarted_worker_gets_the_newest_version_under_a_new_uuid(peer, publisher):
  publisher.publish(learner_params(5), 5)
  first = publisher.ticket(0)
  publisher.drop(0)  # the worker died before pulling
  publisher.publish(learner_params(6), 6)
  assert peer(cmd="restart")["ok"]
  again = publisher.ticket(0, incarnation=1)
  assert again["version"] == 6 and again["uuid"] != first["uuid"]
  # from a fresh server: a pull cut off by the death may have wedged the old one
  assert again["address"] != first["address"] and publisher.servers_started == 2
  assert peer(cmd="offer", ticket=again)["ok"]
  assert peer(cmd="fetch", current=None) == dict(ok=True, version=6, equal=True, placed=True,
                                                 same_tree=True)
  # the dead incarnation's entry, on the retired server, holds the newest version too (nothing
  # older is kept alive)
  assert peer(cmd="offer", ticket=dict(first, version=6))["ok"]
  assert peer(cmd="fetch", current=5) == dict(ok=True, version=6, equal=True, placed=True,
                                              same_tree=True)


def _target():
  dev = jax.devices()[0]
  one = jax.sharding.SingleDeviceSharding(dev)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one),
                      peer_tree(0))


def test_an_unreachable_learner_is_a_clear_error():
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  receiver = jt.JaxTransferReceiver(_target())
  receiver.offer(dict(mode="jax_transfer", address=f"127.0.0.1:{port}", uuid=7, version=1,
                      spec=jt.describe(_target())))
  with pytest.raises(jt.WeightPullError, match=f"cannot reach .* at 127.0.0.1:{port}"):
    receiver.fetch_newer(None)
  with pytest.raises(ValueError, match="not a host:port"):
    jt.split_address("localhost")


def test_another_model_is_refused_before_anything_is_pulled():
  receiver = jt.JaxTransferReceiver(_target())
  spec = jt.describe(_target())
  spec[0] = (spec[0][0], [1024, 511], spec[0][2])
  ticket = dict(mode="jax_transfer", address="127.0.0.1:1", uuid=7, version=1, spec=spec)
  with pytest.raises(ValueError, match=r"do not match this worker's model .*\[1024, 511\]"):
    receiver.pull(ticket)


def test_uuids_are_distinct_and_bounded():
  assert len({jt.make_uuid(s, i) for s in range(3) for i in range(3)}) == 9
  with pytest.raises(ValueError, match="slot=65536"):
    jt.make_uuid(65536, 0)


def test_jax_transfer_needs_ray_mode():
  c = config_lib.base_config()
  config_lib.override(c, "weights.transfer", "jax_transfer")
  with pytest.raises(ValueError, match="weights.transfer='jax_transfer' .* runtime.mode='ray'"):
    config_lib.validate(c)
  config_lib.override(c, "runtime.mode", "ray")
  config_lib.override(c, "mesh.colocated", False)
  config_lib.override(c, "actor.lora.rank", 4)
  with pytest.raises(ValueError, match="with actor.lora.rank > 0 or runtime.learner_processes > 1"):
    config_lib.validate(c)
  config_lib.override(c, "weights.transfer", "nccl")
  with pytest.raises(ValueError, match="weights.transfer='nccl' is not one of"):
    config_lib.validate(c)


def test_a_version_cast_for_the_sampler_is_offered_and_pulled_cast():
  """Given the sampler's compute dtype, the publisher casts a version on the learner's devices
  before its copy (matrices and biases; other vectors, scalars stay float32): the offer says
  so, and a worker whose target is ``weight_transfer.cast_target`` of its model pulls it."""
  from areal_jax.models.transformer import cast_weights
  from areal_jax.runtime import weight_transfer
  pub = jt.JaxTransferPublisher("127.0.0.1", "bfloat16")
  receiver = None
  try:
    pub.publish(learner_params(1), 1)
    ticket = pub.ticket(0)
    dtypes = {path: dtype for path, _, dtype in ticket["spec"]}
    assert dtypes == {"['embed']": "bfloat16", "['head']": "bfloat16", "['layers']['b']": "float32",
                      "['layers']['scale']": "float32", "['layers']['w']": "bfloat16"}
    receiver = jt.JaxTransferReceiver(weight_transfer.cast_target(_target(), "bfloat16"))
    receiver.offer(ticket)
    version, got = receiver.fetch_newer(None)
    want = cast_weights(peer_tree(1), jax.numpy.bfloat16)
    assert version == 1
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.dtype == w.dtype
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="do not match this worker's model"):  # (float32 target)
      jt.JaxTransferReceiver(_target()).pull(ticket)
  finally:
    if receiver is not None:
      receiver.close()
    pub.close()
