"""Data-parallel sampling as replicas: one ``JaxRolloutEngine`` per index of the sampler mesh's
data axis, each on its own sub-mesh (its tensor axis kept), behind one ``RolloutEngine``.

Why not one engine whose slots are split over the data axis: its decode calls cover slots
``[0, width)``, and when a batch drains to a smaller width those slots live on the first devices
only, so XLA gathers the whole KV cache onto every device for the call (seen in the compiled
program of a 4-way split, ``tests/sampler/test_replicas.py``); a paged cache's page ids would have
to name pages on other devices. A replica decodes its own slots on its own devices: no collective
over the data axis at all, its own width as its own batch drains, a paged cache each, its own host
loop (one replica's sync or prefill never holds up another's decode calls).

Routing: a group goes whole to one replica (its samples share a prefill and, paged, their
prompt's pages), so ``rollout.n_samples`` must fit one replica's slots. A request that continues a
conversation (``metadata["continue"]``) goes to the replica that kept the KV of the earlier turn
sharing the longest start with its prompt (at least half of that turn, as ``continuation``
matches); every other request to the replica with the fewest samples outstanding (submitted, not
yet returned) per slot, the lowest index among equals. Samples are the same whichever replica draws
them: sampling keys come from the request's seed and the sample's index, never from a slot.

Weights: ``update_params`` hands every replica the new version as the shards already on its
devices (``on_mesh``: weights arrive replicated over the sampler mesh, and no replica copies
them); each converts them to the layout it holds. ``version`` is the oldest in use, so a caller
waiting for a version waits for all.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, drain
from areal_jax.sampler.continuation import shared_start


def on_mesh(x, mesh: Mesh):
  """``x`` as an array on ``mesh`` (a replica's sub-mesh) made of the shards it already has on
  that mesh's devices: no copy (weights arrive replicated over the whole sampler mesh; a copy per
  replica would hold a second float32 copy of the weights on every device during the swap).
  Anything else is returned as it is (the engine places it)."""
  sh = getattr(x, "sharding", None)
  if not isinstance(sh, NamedSharding) or "data" in jax.tree.leaves(tuple(sh.spec)) or \
      set(sh.mesh.axis_names) != set(mesh.axis_names):
    return x
  target = NamedSharding(mesh, sh.spec)
  shards = {s.device: s.data for s in x.addressable_shards}
  if not all(d in shards for d in mesh.devices.flat):
    return x
  return jax.make_array_from_single_device_arrays(
      x.shape, target, [shards[d] for d in target.addressable_devices])


class _Output:
  """Replica ``index``'s sample sink: counts the sample back, then queues it for ``poll``."""

  def __init__(self, owner: "ReplicatedRolloutEngine", index: int):
    self.owner, self.index = owner, index

  def put(self, sample: Sample) -> None:
    self.owner._returned(self.index, sample)  # noqa: SLF001
    self.owner._out.put(sample)  # noqa: SLF001


class ReplicatedRolloutEngine(RolloutEngine):
  """``make(mesh, output)`` builds one replica (a ``JaxRolloutEngine`` on ``mesh`` putting its
  samples to ``output``), called for each of ``meshes`` in order; see the module docstring."""

  def __init__(self, make: Callable[[Mesh, Any], Any], meshes: list[Mesh]):
    self._out: queue.Queue[Sample] = queue.Queue()
    self._lock = threading.Lock()  # never held while calling a replica
    self._outstanding = [0] * len(meshes)
    self._groups: dict[int, list[int]] = {}  # group_id -> [replica, samples not yet returned]
    self._kept: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
    self.replicas = [make(mesh, _Output(self, i)) for i, mesh in enumerate(meshes)]
    self.num_slots = sum(r.num_slots for r in self.replicas)
    self.max_len = self.replicas[0].max_len

  @property
  def engine(self):
    """The first replica's ``DecodeEngine`` (every replica's has the same config and plan)."""
    return self.replicas[0].engine

  @property
  def version(self) -> int:
    return min(r.version for r in self.replicas)

  @property
  def stats(self) -> collections.Counter:
    return sum((collections.Counter(r.stats) for r in self.replicas), collections.Counter())

  def compile_stats(self) -> dict[str, float]:
    total: collections.Counter = collections.Counter()
    for r in self.replicas:
      total.update(r.compile_stats())
    return dict(total)

  def load(self) -> list[int]:
    """Samples outstanding per replica."""
    with self._lock:
      return list(self._outstanding)

  # ---- RolloutEngine ---------------------------------------------------------------------------

  def warmup(self) -> None:
    """Compiles every replica's programs, the replicas at once (XLA compiles without the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
      list(pool.map(lambda r: r.warmup(), self.replicas))

  def start(self) -> None:
    for r in self.replicas:
      r.start()

  def stop(self) -> None:
    for r in self.replicas:
      r.stop()

  def submit(self, request: GroupRequest) -> None:
    with self._lock:
      i = self._pick(request)
      self._outstanding[i] += request.n
      group = self._groups.setdefault(request.group_id, [i, 0])
      group[1] += request.n if group[0] == i else 0
    self.replicas[i].submit(request)

  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    return drain(self._out, timeout)

  def update_params(self, params: Any, version: int) -> None:
    for r in self.replicas:
      r.update_params(jax.tree.map(lambda x: on_mesh(x, r.engine.mesh), params), version)

  def pause(self) -> None:
    for r in self.replicas:
      r.pause()

  def resume(self) -> None:
    for r in self.replicas:
      r.resume()

  def abort(self, group_id: int) -> None:
    with self._lock:
      group = self._groups.get(group_id)
    for i in ([group[0]] if group else range(len(self.replicas))):
      self.replicas[i].abort(group_id)

  def set_token_listener(self, listener) -> None:
    for r in self.replicas:
      r.set_token_listener(listener)

  # ---- routing ---------------------------------------------------------------------------------

  def _pick(self, request: GroupRequest) -> int:
    """The replica for ``request`` (under the lock)."""
    if request.metadata.get("continue") and self._kept:
      prompt = request.prompt_tokens[:-1]
      best, best_n = None, 0
      for key in self._kept:
        n = shared_start(key, prompt)
        if 2 * n >= len(key) and n > best_n:
          best, best_n = key, n
      if best is not None:  # its row is taken by this request (rows are used once)
        return self._kept.pop(best)
    load = [n / r.num_slots for n, r in zip(self._outstanding, self.replicas)]
    return load.index(min(load))

  def _returned(self, i: int, sample: Sample) -> None:
    with self._lock:
      self._outstanding[i] = max(self._outstanding[i] - 1, 0)
      group = self._groups.get(sample.group_id)
      if group is not None and group[0] == i:
        group[1] -= 1
        if group[1] <= 0:
          del self._groups[sample.group_id]
      if sample.metadata.get("continue") and sample.finish_reason in ("eos", "stop", "length") \
          and sample.tokens:
        # the KV the replica may keep: prompt + generated[:-1] (``continuation``)
        key = tuple(int(t) for t in [*sample.prompt_tokens, *sample.tokens[:-1]])
        self._kept[key] = i
        self._kept.move_to_end(key)
        while len(self._kept) > self.num_slots:
          self._kept.popitem(last=False)
