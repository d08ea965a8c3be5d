"""Data-parallel sampling as replicas: one ``JaxRolloutEngine`` per index of the sampler mesh's
data axis, each on its own sub-mesh (its tensor axis kept), behind one ``RolloutEngine``.

Why not one engine whose slots are split over the data axis: its decode calls cover slots
``[0, width)``, and when a batch drains to a smaller width those slots live on the first devices
only, so XLA gathers the whole KV cache onto every device for the call (seen in the compiled
program of a 4-way split, ``tests/sampler/test_replicas.py``); a paged cache's page ids would have
to name pages on other devices. A replica decodes its own slots on its own devices: no collective
over the data axis at all, its own width as its own batch drains, a paged cache each, its own host
loop (one replica's sync or prefill never holds up another's decode calls).

Routing (a thread of its own, ``start``): a group goes whole to one replica (its samples share a
prefill and, paged, their prompt's pages), so ``rollout.n_samples`` must fit one replica's slots.
Groups wait here, in order, until a replica has room for them (its samples outstanding, handed
over and not yet returned, leave slots for the group; or it has none outstanding): bound late, a
group never queues behind one replica's long sequences while another replica's slots are free.
Among replicas with room, the one with the fewest samples outstanding per slot takes it (the lowest
index among equals). A request that continues a conversation (``metadata["continue"]``) goes at
once to the replica that kept the KV of the earlier turn sharing the longest start with its prompt
(``continuation.longest_match``, the rule that replica's store then applies), which continues it
instead of prefilling the history. Samples are the same whichever replica draws them: sampling keys come
from the request's seed and the sample's index, never from a slot.

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
import time
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding

from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, drain
from areal_jax.sampler import continuation, requests, sequences
from areal_jax.sampler.sequences import Group


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
    self._pending: collections.deque[Group] = collections.deque()  # not yet handed to a replica
    self._wake = threading.Condition(self._lock)  # a request came in or samples came back
    self._router: threading.Thread | None = None
    self._stopping = False
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

  def load(self) -> tuple[list[int], int]:
    """Samples outstanding per replica (handed over, not yet returned), and groups waiting for a
    replica."""
    with self._lock:
      return list(self._outstanding), len(self._pending)

  # ---- RolloutEngine ---------------------------------------------------------------------------

  def warmup(self, progress=None, continuations: bool = False) -> None:
    """Compiles every replica's programs (``JaxRolloutEngine.warmup``), the replicas at once (XLA
    compiles without the GIL); ``progress(done, total, what)`` after each program, counted over
    all replicas."""
    self._tune()
    total = sum(r.warmup_count(continuations) for r in self.replicas)
    done, lock = 0, threading.Lock()

    def tick(i: int):
      def report(_done, _total, what):
        nonlocal done
        with lock:
          done += 1
          if progress is not None:
            progress(done, total, f"replica {i}: {what}")
      return report

    with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
      list(pool.map(lambda ir: ir[1].warmup(tick(ir[0]), continuations), enumerate(self.replicas)))

  def _tune(self) -> None:
    """The first replica times the decode launches (``JaxRolloutEngine.tune_launch``); the others
    take the one it kept (the same program on the same kind of device)."""
    first, *rest = self.replicas
    first.tune_launch()
    for r in rest:
      r.tune_launch(first.engine.launch)

  @property
  def launch_report(self) -> dict | None:
    return self.replicas[0].launch_report

  def start(self) -> None:
    if self._router is None:
      self._tune()
    for r in self.replicas:
      r.start()
    if self._router is None:
      self._stopping = False
      self._router = threading.Thread(target=self._route_loop, name="replica-router", daemon=True)
      self._router.start()

  def stop(self) -> None:
    """Stops routing, then every replica (its sequences come back aborted), then aborts the groups
    still waiting for one."""
    with self._wake:
      self._stopping = True
      self._wake.notify_all()
    if self._router is not None:
      self._router.join()
      self._router = None
    for r in self.replicas:
      r.stop()
    with self._lock:
      pending, self._pending = list(self._pending), collections.deque()
    for group in pending:
      self._emit(group, "abort")

  def submit(self, request: GroupRequest) -> None:
    group, first = Group(request, time.time(), ()), self.replicas[0]
    try:  # checked now (a replica checks it again), not after waiting for room
      requests.validate(request, max_len=self.max_len, vocab_size=first.vocab_size,
                        num_slots=min(r.num_slots for r in self.replicas),
                        eos_token_ids=first.eos_token_ids,
                        max_stop_ids=first.engine.config.max_stop_ids)
    except ValueError as e:
      self._emit(group, "error", str(e))
      return
    with self._wake:
      self._pending.append(group)
      self._wake.notify_all()

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
      waiting = [g for g in self._pending if g.request.group_id == group_id]
      for g in waiting:
        self._pending.remove(g)
      group = self._groups.get(group_id)
    for g in waiting:
      self._emit(g, "abort")
    if group is not None:
      self.replicas[group[0]].abort(group_id)

  def set_token_listener(self, listener) -> None:
    for r in self.replicas:
      r.set_token_listener(listener)

  # ---- routing ---------------------------------------------------------------------------------

  def _route_loop(self) -> None:
    while True:
      with self._wake:
        if self._stopping:
          return
        routed = self._assign()
        if not routed:  # until a request comes in, samples come back or stop
          self._wake.wait()
          continue
      for i, group in routed:  # (no lock held: a replica's submit takes its own)
        self.replicas[i].submit(group.request, submitted_s=group.submitted_s)

  def _assign(self) -> list[tuple[int, Group]]:
    """Waiting groups that a replica takes now, in order, and their replicas (under the lock)."""
    routed = []
    for group in list(self._pending):
      r = group.request
      i = self._kept_by(r) if r.metadata.get("continue") else None
      if i is None:
        room = [j for j, rep in enumerate(self.replicas)
                if self._outstanding[j] == 0 or self._outstanding[j] + r.n <= rep.num_slots]
        if not room:
          continue
        i = min(room, key=lambda j: (self._outstanding[j] / self.replicas[j].num_slots, j))
      self._pending.remove(group)
      self._outstanding[i] += r.n
      owner = self._groups.setdefault(r.group_id, [i, 0])
      owner[1] += r.n if owner[0] == i else 0
      routed.append((i, group))
    return routed

  def _kept_by(self, request: GroupRequest) -> int | None:
    """The replica that kept the turn ``request`` continues (its row is then taken: rows are used
    once), or None."""
    key, _ = continuation.longest_match(self._kept, request.prompt_tokens[:-1])
    return None if key is None else self._kept.pop(key)

  def _emit(self, group: Group, reason: str, error: str | None = None) -> None:
    for sample in sequences.unstarted(group, reason, error):
      self._out.put(sample)

  def _returned(self, i: int, sample: Sample) -> None:
    with self._wake:
      self._wake.notify_all()  # room, maybe, for a waiting group
      self._outstanding[i] = max(self._outstanding[i] - 1, 0)
      group = self._groups.get(sample.group_id)
      if group is not None and group[0] == i:
        group[1] -= 1
        if group[1] <= 0:
          del self._groups[sample.group_id]
      if continuation.wanted(sample.metadata, sample.finish_reason) and sample.tokens:
        # the KV the replica may keep: prompt + generated[:-1] (``continuation``)
        key = tuple(int(t) for t in [*sample.prompt_tokens, *sample.tokens[:-1]])
        self._kept[key] = i
        self._kept.move_to_end(key)
        while len(self._kept) > self.num_slots:
          self._kept.popitem(last=False)
