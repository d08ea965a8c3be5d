"""``weights.transfer="jax_transfer"``: rollout workers pull each weights version from the learner's
memory over sockets (``jax.experimental.transfer``), with no file in between.

The learner (the driver, ``runtime.mode="ray"``) runs one transfer server. ``publish(params, v)``
copies the parameters onto the learner's first device (a real copy, gathered there when they are
sharded; the learner may donate or overwrite its own arrays at once) and returns without waiting:
only the dispatch of that device copy blocks the learner, the server serves the arrays once they
are ready. An entry of the server's pull table serves exactly one pull, and a pull that arrives
before its entry waits for it. No timeout is relied on (tried with jaxlib 0.10.2 on CPU: a pull
with a 2 s timeout of an entry registered already expired had neither data nor an error after
100 s), so an entry cannot be withdrawn, only replaced. So every worker has one uuid of its own,
from ``(worker, incarnation)``, and ``ticket`` (re)registers the newest version under it, replacing
whatever that entry held: a worker that missed versions gets the newest, nothing piles up, and at
most the newest copy (plus one being sent) is held. The pulled arrays carry their version (one more
scalar), so a worker knows what it got. The ticket (the server's address, the uuid, the announced
version, the tree's shapes) reaches the worker with ``notify``; the worker
(``JaxTransferReceiver``) starts a transfer server of its own, connects once per learner address,
pulls onto one of its devices and places the arrays on its sampler shardings. A worker that dies
leaves its uuid behind: that entry follows the newest version from then on (no extra copy); the
restarted worker has a new incarnation, hence a new uuid. A pull that never returns (seen in test
runs after the previous incarnation was SIGKILLed mid-pull; once, every later pull from that server
stalled too, through three restarts) is cut by the worker's watchdog (``weights.pull_timeout_s``,
``ray_worker``): the worker ends and Ray restarts it. So a worker's death also retires the server:
later tickets come from a fresh one (a new address), while the old one keeps the entries it holds
(kept on the newest version, like the dead incarnations' ones) and any pull already under way.
"""

from __future__ import annotations

import socket
import threading
import time

import jax
import numpy as np
from flax import nnx

from areal_jax.runtime import weight_transfer

CHUNK_BYTES = 32 * 2**20  # the servers' staging buffer size per copy ...
PARALLEL_COPIES = 4  # ... and how many copies run at once (host memory: 3 x their product)
_SLOT_BITS, _INC_BITS = 16, 24


class WeightPullError(RuntimeError):
  """A worker could not pull the weights it was offered (unreachable learner, lost connection)."""


def _module():
  try:
    from jax.experimental import transfer  # pylint: disable=import-outside-toplevel
    transfer.start_transfer_server  # noqa: B018  (missing on jaxlib builds without it)
  except (ImportError, AttributeError) as e:
    raise RuntimeError(f"weights.transfer='jax_transfer' needs jax.experimental.transfer, which "
                       f"this jax/jaxlib {jax.__version__} does not provide ({e}); use "
                       "weights.transfer='orbax'") from e
  return transfer


def make_uuid(slot: int, incarnation: int) -> int:
  """The pull-table key of worker ``slot`` in its ``incarnation`` (its restarts so far)."""
  for name, value, bits in (("slot", slot, _SLOT_BITS), ("incarnation", incarnation, _INC_BITS)):
    if not 0 <= value < 2**bits:
      raise ValueError(f"jax_transfer uuid: {name}={value} out of range [0, 2**{bits})")
  return (1 << 62) | (slot << _INC_BITS) | incarnation


def split_address(address: str) -> tuple[str, int]:
  """``"host:port"`` (``"[v6]:port"``) as ``(host, port)``; a clear error for anything else."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit():
    raise ValueError(f"jax_transfer: {address!r} is not a host:port address")
  return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
  return host in ("localhost", "::1") or host.startswith("127.")


def _start_server(host: str):
  device = jax.local_devices()[0]
  return _module().start_transfer_server(
      device.client, f"{host}:0", [f"{host}:0"], max_num_parallel_copies=PARALLEL_COPIES,
      transfer_size=CHUNK_BYTES)


def _pure(params):
  if isinstance(params, nnx.Module):
    params = nnx.state(params, nnx.Param)
  if isinstance(params, nnx.State):
    params = nnx.to_pure_dict(params)
  return params


def describe(tree) -> list:
  """``[(path, shape, dtype), ...]`` of a tree's leaves in flattening order (sent with a ticket)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p), list(x.shape), str(x.dtype)) for p, x in leaves]


# ---- the learner's side ------------------------------------------------------------------------
class JaxTransferPublisher:
  """Holds the newest version on the learner's first device and offers it to workers."""

  mode = "jax_transfer"

  def __init__(self, host: str = "127.0.0.1", dtype=None):
    """``dtype``: a version is cast to it on the learner's devices before its copy to the first
    one (``weight_transfer.version_dtype``; workers pull into targets of those dtypes)."""
    self._cast = weight_transfer.caster(dtype)
    self.host = host
    self.server = _start_server(host)
    self.address = self.server.address()
    self.device = jax.local_devices()[0]
    self._lock = threading.Lock()
    self._latest: tuple[int, list, list] | None = None  # (version, arrays + [version], describe())
    # worker slot -> (server, uuid) of its current offer
    self._uuids: dict[int, tuple[object, int]] = {}
    # (server, uuid) entries no current worker will pull (dead incarnations, a retired server's
    # offers): they may be pending, so they follow the newest version
    self._orphans: list[tuple[object, int]] = []
    self.servers_started = 1
    self.last_publish_s = 0.0

  def publish(self, params, version: int) -> float:
    """Makes ``version`` the one offered from now on; returns the seconds the caller was blocked
    (dispatching the device copy: the copy itself and the serving happen in the background)."""
    t0 = time.perf_counter()
    with self._lock:
      latest = None if self._latest is None else self._latest[0]
    if not isinstance(version, int) or version < 0 or (latest is not None and version <= latest):
      raise ValueError(f"publish({version!r}): versions must be ints that increase "
                       f"(latest published is {latest})")
    tree = _pure(params)
    if self._cast is not None:
      tree = self._cast(tree)
    arrays = jax.device_put(jax.tree.leaves(tree) + [np.int32(version)], self.device,
                            may_alias=False)
    with self._lock:
      self._latest = (version, arrays, describe(tree))
      for server, uuid in self._orphans:  # keep them on the newest copy: no older one stays alive
        server.await_pull(uuid, arrays)
    self.last_publish_s = time.perf_counter() - t0
    return self.last_publish_s

  def send(self, params, version: int) -> None:
    """The runtime's announcer interface (``ray_rollout``): ``publish``."""
    self.publish(params, version)

  def latest_version(self) -> int | None:
    with self._lock:
      return None if self._latest is None else self._latest[0]

  def ticket(self, slot: int, incarnation: int = 0) -> dict | None:
    """Offers the newest version to worker ``slot`` (``incarnation``: its restarts so far) under
    its uuid, replacing what that entry held; the ticket goes to the worker with ``notify``."""
    with self._lock:
      if self._latest is None:
        return None
      version, arrays, spec = self._latest
      uuid = make_uuid(slot, incarnation % 2**_INC_BITS)
      old = self._uuids.get(slot)
      if old is not None and old != (self.server, uuid) and old not in self._orphans:
        self._orphans.append(old)
      self._uuids[slot] = (self.server, uuid)
      self.server.await_pull(uuid, arrays)
    return dict(mode=self.mode, address=self.address, uuid=uuid, version=version, spec=spec)

  def drop(self, slot: int) -> None:
    """The worker died: its entry (if not pulled) stays on the newest version from now on, and
    the server it may have died pulling from is retired (see the module docstring)."""
    with self._lock:
      old = self._uuids.pop(slot, None)
      if old is not None and old not in self._orphans:
        self._orphans.append(old)
      self.server = _start_server(self.host)  # the old one lives on in the entries it holds
      self.address = self.server.address()
      self.servers_started += 1

  def close(self) -> None:
    with self._lock:
      self._latest = None


# ---- a worker's side -----------------------------------------------------------------------------
class JaxTransferReceiver:
  """Pulls the newest version it holds a ticket for onto the sampler's shardings (``target``)."""

  mode = "jax_transfer"

  def __init__(self, target, host: str | None = None):
    """``target``: pure dict of ``jax.ShapeDtypeStruct`` with ``sharding=`` (``abstract_params``);
    ``host``: the address this worker's own server binds to when the learner is not on loopback."""
    leaves = jax.tree.leaves(target)
    if not leaves or not all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                             for x in leaves):
      raise TypeError("target must be a tree of jax.ShapeDtypeStruct with sharding= set "
                      "(see weight_transfer.abstract_params)")
    self.target, self.host = target, host
    self._spec = describe(target)
    self._treedef = jax.tree.structure(target)
    self._shardings = [x.sharding for x in leaves]
    first = leaves[0].sharding
    self._device = min(first.device_set, key=lambda d: d.id)
    self._server = None
    self._conns: dict[str, object] = {}
    self._lock = threading.Lock()
    self._ticket: dict | None = None
    self.last_fetch_s = 0.0

  def offer(self, ticket: dict) -> None:
    """A ticket from the driver (``notify``); an older one than the held ticket is ignored."""
    with self._lock:
      if self._ticket is None or ticket["version"] >= self._ticket["version"]:
        self._ticket = ticket

  def latest_version(self) -> int | None:
    with self._lock:
      return None if self._ticket is None else self._ticket["version"]

  def fetch_newer(self, current: int | None) -> tuple[int, dict] | None:
    """``(version, params)``: the version offered now (at least the newest ticket's) when that
    ticket is above ``current``; None otherwise."""
    with self._lock:
      ticket = self._ticket
    if ticket is None or (current is not None and ticket["version"] <= current):
      return None
    return self.pull(ticket)

  def pull(self, ticket: dict) -> tuple[int, dict]:
    """``(version, params)`` from one ticket, on the target's shardings (blocks until there)."""
    t0 = time.perf_counter()
    self._check_spec(ticket)
    conn = self._connect(ticket["address"])
    one = jax.sharding.SingleDeviceSharding(self._device)
    avals = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=one)
             for _, shape, dtype in ticket["spec"]]
    avals.append(jax.ShapeDtypeStruct((), np.int32, sharding=one))
    try:
      flat = jax.block_until_ready(conn.pull(ticket["uuid"], avals))
    except Exception as e:  # pylint: disable=broad-except  (JaxRuntimeError and friends)
      first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
      raise WeightPullError(f"could not pull weights version {ticket['version']} (uuid "
                            f"{ticket['uuid']}) from {ticket['address']}: {first}") from e
    version = int(flat.pop())
    if version < ticket["version"]:  # the entry is re-registered before each ticket: cannot happen
      raise WeightPullError(f"pulled version {version} from {ticket['address']}, older than the "
                            f"announced {ticket['version']}")
    out = jax.block_until_ready(jax.device_put(flat, self._shardings))
    self.last_fetch_s = time.perf_counter() - t0
    return version, jax.tree.unflatten(self._treedef, out)

  def _check_spec(self, ticket: dict) -> None:
    theirs = [(p, list(s), d) for p, s, d in ticket["spec"]]
    if theirs != self._spec:
      diff = next(((a, b) for a, b in zip(theirs, self._spec) if a != b), None)
      what = (f"learner {diff[0]} vs this worker {diff[1]}" if diff else
              f"{len(theirs)} arrays vs this worker's {len(self._spec)}")
      raise ValueError(f"jax_transfer: the learner's weights do not match this worker's model "
                       f"({what}); both must load the same model.source")

  def _connect(self, address: str):
    conn = self._conns.get(address)
    if conn is not None:
      return conn
    host, port = split_address(address)
    try:  # fail fast, naming the cause, before the transfer server tries
      socket.create_connection((host, port), timeout=5.0).close()
    except OSError as e:
      raise WeightPullError(f"weights.transfer='jax_transfer': cannot reach the learner's transfer "
                            f"server at {address}: {e}") from e
    if self._server is None:
      own = "127.0.0.1" if _is_loopback(host) else (self.host or _own_ip(host, port))
      self._server = _start_server(own)
    conn = self._server.connect(address)
    self._conns[address] = conn
    return conn

  def close(self) -> None:
    self._conns.clear()
    self._server = None


def _own_ip(host: str, port: int) -> str:
  """This machine's address on the route to ``host`` (no packet is sent)."""
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host, port))
    return s.getsockname()[0]
