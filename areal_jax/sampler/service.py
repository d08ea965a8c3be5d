"""Host side of the sampler: continuous batching in a background thread (``JaxRolloutEngine``).

The loop admits waiting groups into free slots as soon as sequences finish (one prefill per group,
inserted into n slots), advances all slots with ``DecodeEngine.generate`` and streams every finished
sequence out at once to a queue that ``poll`` drains.

When the live sequences fit a smaller width bucket (a batch draining, with nothing left to admit),
those above it are moved down into free lower slots and decode steps run over a smaller width bucket
(``DecodeEngine.width_buckets``), so the tail of long sequences does not pay for empty slots.

Host overhead per decode call is one device->host fetch (tokens, logprobs, valid flags) and it is
pipelined: call k+1 is dispatched before the results of call k are fetched, so the device never
waits for Python. Stop conditions are evaluated on the device too, so a finished slot idles for at
most the one call already queued behind it.

Prefills are memoised per token sequence (``prefix_memo``); requests are checked on submission
(``requests``); waiting groups are admitted first in, first out, with bounded overtaking
(``admission``). A prefill of more than ``prefill_chunk`` positions (a long prompt; a long
sequence re-prefilled after a weight swap or a preemption) runs a chunk before each decode call
instead of all at once (``chunked_prefill``): its group waits (later ones may be admitted), or
its sequence sits out, until the last chunk; no decode step waits longer than one chunk.

Multi-turn continuation (``continuation.py``): a request with ``metadata["continue"]`` keeps its
finished sequences' KV rows; a later request whose prompt shares most of its start with one (the
next turn of the conversation, or a turn cut at a tool call and continued) runs only the tokens
after the shared start on top of it instead of prefilling the whole history.

Weight swaps (``update_params``) take effect between two decode calls without draining sequences.
How a version lands (``weight_swap``):
  * ``"overlap"``: it is converted into the engine's held weights on the caller's thread while the
    loop goes on decoding with the current version; both are held until the swap lands.
  * ``"pause"``: the loop stops between two decode calls, lets go of the current version, converts
    the new one and goes on: one held version less at the swap's peak (``sampler.memory``), for
    as long as the conversion takes (a cast and concatenation of the weights, in one program).
Continuation modes:
  * ``"keep_cache"``: in-flight sequences keep the KV cache computed by the old weights; tokens after
    the swap are drawn from the new weights attending to that old cache. Their logprobs are those of
    the new weights *given the old cache*; they differ from a fresh forward of the new weights over
    the whole sequence by the staleness of the cached prefix (the decoupled objective accounts for
    it). Cheapest.
  * ``"reprefill"``: every in-flight sequence is re-prefilled (prompt + generated so far) under the
    new weights, so tokens after the swap carry exactly the new weights' logprobs.

Paged KV cache (``kv_pages > 0``, or the default -1 on GPU: ``kernels.choice.kv_pages``;
``pages``, ``paging``): slots take pages as they grow, a group's
samples share their prompt's full pages; when the pool runs out, the sequences admitted last are
preempted and later re-prefilled (prompt + generated so far) into a free slot, keeping their
tokens, logprobs and versions and drawing what they would have drawn (same keys and positions).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.models.transformer import Transformer
from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, drain
from areal_jax.sampler import (chunked_prefill, launch_tuning, paging, prefix_memo, requests,
                               sampling, sequences)
from areal_jax.sampler import continuation as continuation_lib
from areal_jax.sampler import warmup as warmup_lib
from areal_jax.sampler.engine import DecodeEngine, EngineConfig
from areal_jax.sampler.pages import PageTable
from areal_jax.sampler.prefilling import Prefilling
from areal_jax.sampler.sequences import Group, Seq

log = logging.getLogger(__name__)

CONTINUATION_MODES = ("keep_cache", "reprefill")
WEIGHT_SWAPS = ("overlap", "pause")


class JaxRolloutEngine(Prefilling, RolloutEngine):
  """Continuous-batching rollout engine on a JAX mesh; see the module docstring."""

  def __init__(self, model: Transformer, *, mesh: Mesh | None = None, num_slots: int = 8,
               max_len: int = 512, prefill_buckets: tuple[int, ...] | None = None,
               kv_buckets: tuple[int, ...] | None = None, continuation: str = "keep_cache",
               eos_token_ids: tuple[int, ...] | None = None, steps_per_call: int = 0,
               max_stop_ids: int = 8, cache_dtype: str | None = None, params: Any = None,
               version: int = 0, decode_attention: str = "auto", decode_matmul: str = "auto",
               decode_layers: str = "auto", decode_projections: str = "auto", lora=None,
               kv_pages: int = -1, page_size: int = 64, max_prefill_tokens: int = 0,
               prefill_attention: str = "auto", output=None, weight_swap: str = "overlap",
               decode_tuning: str = "auto", prefill_chunk: int = -1):
    """``kv_pages``: the paged cache's pool (0: rows; -1: the platform's choice,
    ``kernels.choice.kv_pages``: paged on GPU). ``max_prefill_tokens``: tokens per prefill call
    (``EngineConfig``; 0: no bound). ``prefill_attention``: a prefill's causal attention
    (``kernels.choice.CAUSAL``; "auto": a flash kernel on GPU and TPU). ``output``: where
    finished samples go (anything with ``put``; default: this engine's own queue, drained by
    ``poll``): ``replicas`` routes several engines' samples to one queue. ``decode_tuning``:
    whether the decode programs' kernel launches are timed on the device before the first decode
    call, the fastest kept (``tune_launch``; ``kernels.choice.DECODE_TUNING``).
    ``prefill_chunk``: positions per chunk of a long prefill (``chunked_prefill``; 0: prefills
    run whole; -1: per platform)."""
    if continuation not in CONTINUATION_MODES:
      raise ValueError(f"continuation={continuation!r}; expected one of {CONTINUATION_MODES}")
    if weight_swap not in WEIGHT_SWAPS:
      raise ValueError(f"weight_swap={weight_swap!r}; expected one of {WEIGHT_SWAPS}")
    self.continuation, self.weight_swap = continuation, weight_swap
    self.engine = DecodeEngine(model, EngineConfig(
        num_slots=num_slots, max_len=max_len, prefill_buckets=prefill_buckets,
        kv_buckets=kv_buckets, steps_per_call=steps_per_call, max_stop_ids=max_stop_ids,
        cache_dtype=cache_dtype, decode_attention=decode_attention, decode_matmul=decode_matmul,
        decode_layers=decode_layers, decode_projections=decode_projections, kv_pages=kv_pages,
        page_size=page_size, max_prefill_tokens=max_prefill_tokens,
        prefill_attention=prefill_attention, decode_tuning=decode_tuning), mesh, lora=lora)
    # a paged cache's page table and preempted sequences (host side); None: a row per slot
    kv_pages = self.engine.config.kv_pages  # (-1 resolved)
    self._paging = paging.Paging(PageTable(num_slots, kv_pages, page_size, max_len),
                                 self.engine.config.steps_per_call) if kv_pages else None
    self._admissions = 0
    self.num_slots, self.max_len = num_slots, max_len
    self.vocab_size = model.cfg.vocab_size
    self.eos_token_ids = tuple(model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    # the version the engine runs is its ``params``: the one it built from ``model`` is dropped
    # as soon as another replaces it (a version is held once per device, as the memory plan says)
    if params is not None:
      self.engine.params = self.engine.put_params(params)
    self._version = version
    self._state = None
    self._slots: list[Seq | None] = [None] * num_slots
    self._waiting: collections.deque[Group] = collections.deque()
    self._inflight: collections.deque = collections.deque()  # (outputs, slot snapshot, version)
    self._out: queue.Queue[Sample] = queue.Queue() if output is None else output
    self._lock = threading.Condition()
    self._pending_params = None
    self._aborts: list[int] = []
    self._paused = False
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._continued = continuation_lib.Continuations(  # (a paged cache: kept as its pages)
        self.engine, capacity=num_slots, table=None if self._paging is None else self._paging.table)
    self.stats = collections.Counter()
    self._prefixes = prefix_memo.PrefixMemo(self.engine, self.stats)  # tokens -> KV prefix
    self._chunks = chunked_prefill.ChunkedPrefill(  # a long prefill's row, a chunk a decode call
        self.engine, chunked_prefill.chunk_size(prefill_chunk, self.engine.platform), self.stats)
    self._prefixes.held_beside = self._chunks.positions  # (the memo leaves room for the row)
    self._token_listener = None
    self._tuned = False
    self.launch_report: dict | None = None  # what tune_launch timed (None: nothing)
    self._memory_plan = None

  @property
  def memory_plan(self):
    """The memory plan this engine was sized by (``runtime.engines.build``; None: unplanned): a
    decode launch ``tune_launch`` keeps instead of the engine's own must fit it too, and a row
    cache keeps as many continuation rows as it counts (``kept_rows``; unplanned: one a slot)."""
    return self._memory_plan

  @memory_plan.setter
  def memory_plan(self, plan) -> None:
    self._memory_plan = plan
    if self._paging is None:  # (a paged cache keeps pages of its pool, as many as it lends)
      self._continued.capacity = self.num_slots if plan is None else plan.kept_rows

  # ---- RolloutEngine ---------------------------------------------------------------------------

  @property
  def version(self) -> int:
    return self._version

  def compile_stats(self) -> dict[str, float]:
    return dict(self.engine.compile_stats)

  def warmup(self, progress=None, continuations: bool = False) -> None:
    """Compiles every bucket now (optional; otherwise the first use of a bucket compiles it),
    and with ``continuations`` every program a continued turn runs (``Continuations.warmup``);
    ``progress(done, total, what)`` after each program (``sampler.warmup``), ``warmup_count``
    in all."""
    if self._thread is not None:
      raise RuntimeError("warmup() must run before start()")
    self.tune_launch()  # (so only the launch kept is compiled for every variant)
    total, before = self.warmup_count(continuations), 0

    def report(done: int, _: int, what: str) -> None:
      if progress is not None:
        progress(before + done, total, what)

    self._state = self.engine.warmup(self._state or self.engine.init_state(), report)
    before = warmup_lib.count(self.engine)
    self._chunks.warmup(self.engine.params, progress, before, total)
    if continuations:
      before += self._chunks.warmup_count()
      self._continued.warmup(self.engine.params, self._state, report)
    n = 1
    while n <= 2 * self.num_slots:  # the per-request sampling keys (padded to powers of two)
      sampling.slot_keys(0, n)
      n *= 2

  def warmup_count(self, continuations: bool = False) -> int:
    """Programs ``warmup`` compiles."""
    return warmup_lib.count(self.engine) + self._chunks.warmup_count() + \
        (self._continued.warmup_count() if continuations else 0)

  def tune_launch(self, launch=None) -> dict | None:
    """Before the first decode call, once: times the decode programs' kernel launches on this
    engine's devices and keeps the fastest (``sampler.launch_tuning``; on a GPU, unless
    ``decode_tuning="off"``; one other than the engine's own only if it fits ``memory_plan``);
    ``launch``: takes that ``kernels.choice.Launch`` instead of timing (replicas: the first
    one's). Returns the report (``launch_report``; None: nothing timed)."""
    if self._thread is not None:
      raise RuntimeError("tune_launch() must run before start()")
    if self._tuned:
      return self.launch_report
    self._tuned = True
    if launch is not None:
      self.engine.use_launch(launch)
      return None
    state = self.engine.init_state() if self._state is None else self._state
    self._state, self.launch_report = launch_tuning.tune(
        self.engine, state, plan=self.memory_plan, progress=lambda name: print(
            f"sampler decode launch: compiling {name} to time it", flush=True))
    if self.launch_report is not None:
      print(f"sampler decode launch: {launch_tuning.summary(self.launch_report)}", flush=True)
    return self.launch_report

  def start(self) -> None:
    if self._thread is not None:
      return
    self.tune_launch()
    if self._state is None:
      self._state = self.engine.init_state()
    self._stopping = False
    self._thread = threading.Thread(target=self._run, name="jax-rollout", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self._drain_inflight()
    for seq in [*self._slots, *self._preempted()]:
      if seq is not None and not seq.done:
        self._finish(seq, "abort")
    self._slots = [None] * self.num_slots
    self._chunks.clear()
    if self._paging is not None:
      self._continued.clear()  # (kept pages: before the pool's pages all go back)
      self._paging.reset()
    with self._lock:
      while self._waiting:
        self._emit_group(self._waiting.popleft(), "abort")

  def submit(self, request: GroupRequest, submitted_s: float | None = None) -> None:
    """``submitted_s``: when the request was made, if earlier than now (``replicas`` holds a
    request until a replica has room)."""
    group = Group(request, time.time() if submitted_s is None else submitted_s, ())
    try:
      group.stop_ids = requests.validate(
          request, max_len=self.max_len, vocab_size=self.vocab_size, num_slots=self.num_slots,
          eos_token_ids=self.eos_token_ids, max_stop_ids=self.engine.config.max_stop_ids)
      if self._pages_needed(group) > self.engine.config.kv_pages > 0:
        raise ValueError(f"a group of {request.n} with a {len(request.prompt_tokens)}-token "
                         f"prompt needs {self._pages_needed(group)} pages; the pool has "
                         f"kv_pages={self.engine.config.kv_pages}")
    except ValueError as e:
      self._emit_group(group, "error", str(e))
      return
    with self._lock:
      self._waiting.append(group)
      self._lock.notify_all()

  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    return drain(self._out, timeout)

  def update_params(self, params: Any, version: int) -> None:
    # "pause": converted by the loop once it has let go of the current version (_apply_params)
    placed = self.engine.put_params(params) if self.weight_swap == "overlap" else None
    with self._lock:
      self._pending_params = (placed, params if placed is None else None, int(version))
      self._lock.notify_all()
    if self._thread is None:
      self._apply_params()

  def pause(self) -> None:
    with self._lock:
      self._paused = True

  def resume(self) -> None:
    with self._lock:
      self._paused = False
      self._lock.notify_all()

  def abort(self, group_id: int) -> None:
    with self._lock:
      self._aborts.append(group_id)
      self._lock.notify_all()

  # ---- output ----------------------------------------------------------------------------------

  def _emit_group(self, group: Group, reason: str, error: str | None = None):
    for sample in sequences.unstarted(group, reason, error):
      self._out.put(sample)

  def _finish(self, seq: Seq, reason: str):
    seq.done = True
    self._out.put(seq.sample(reason))
    self.stats["finished"] += 1

  # ---- the loop --------------------------------------------------------------------------------

  def _run(self):
    try:
      while True:
        with self._lock:
          if self._stopping:
            return
          busy = any(s is not None for s in self._slots) or bool(self._waiting) or \
              bool(self._preempted())
          if (self._paused or not busy) and not self._inflight and self._pending_params is None \
              and not self._aborts:
            self._lock.wait(0.05)
            continue
        self._handle_aborts()
        if self._pending_params is not None:
          self._apply_params()
        if self._paused:
          self._drain_inflight()
          continue
        self._admit()
        self._prefill_chunk()
        if any(s is not None and not s.done and not s.prefilling for s in self._slots):
          self._dispatch()
          if len(self._inflight) > 1:
            self._process(self._inflight.popleft())
        else:
          self._drain_inflight()
    except Exception as e:  # a bug, not a bad request: fail every sequence loudly, keep the thread
      log.exception("rollout loop failed")
      self._fail_all(f"{type(e).__name__}: {e}")

  def _fail_all(self, message: str):
    self._inflight.clear()
    self._chunks.clear()
    preempted = self._preempted()
    if self._paging is not None:
      self._continued.clear()  # (kept pages: before the pool's pages all go back)
      self._paging.reset()
    for i, seq in enumerate([*self._slots, *preempted]):
      if seq is not None and not seq.done:
        seq.done = True
        self._out.put(seq.sample("error", message))
      if i < self.num_slots:
        self._slots[i] = None
    with self._lock:
      while self._waiting:
        self._emit_group(self._waiting.popleft(), "error", message)
    self._state = self.engine.init_state()

  def _dispatch(self):
    if self._paging is not None:
      self._grow()  # may preempt sequences (then the slots may have emptied)
      if not any(s is not None and not s.done for s in self._slots):
        return
    width = self._compact()
    active = [s for s in self._slots[:width] if s is not None and not s.done]
    max_pos = max(s.length - 1 for s in active) + len(self._inflight) * \
        self.engine.config.steps_per_call
    kv_len = self.engine.kv_bucket(max_pos)
    pages = None if self._paging is None else self._paging.table.table  # (the engine copies it)
    self._state, outputs = self.engine.generate(self.engine.params, self._state, kv_len, width,
                                                pages)
    self._inflight.append((outputs, list(self._slots), self._version))
    self.stats["calls"] += 1
    self.stats["slot_steps"] += width * self.engine.config.steps_per_call

  def _compact(self) -> int:
    """Decode width for the next call. When the live sequences would fit a smaller width bucket
    (a batch draining, nothing admissible waiting: admission ran just before), the ones above it
    move down into free slots first, so a step stops paying for empty slots. Returns the width."""
    live = [i for i, s in enumerate(self._slots) if s is not None and not s.done]
    width = self.engine.width_bucket(live[-1] + 1)
    target = self.engine.width_bucket(len(live))
    if target == width:
      return width
    src = [i for i in live if i >= target]
    dst = [i for i in range(target) if self._slots[i] is None or self._slots[i].done][:len(src)]
    self._state = self.engine.move(self._state, src, dst)
    if self._paging is not None:  # a finished sequence's slot gave its pages back already
      self._paging.table.move(src, dst)
    for i, j in zip(src, dst):
      seq, self._slots[i] = self._slots[i], None
      seq.slot, self._slots[j] = j, seq
    self.stats["moves"] += len(src)
    return target

  def _drain_inflight(self):
    while self._inflight:
      self._process(self._inflight.popleft())

  def set_token_listener(self, listener) -> None:
    """``listener(group_id, index, tokens)`` hears each sequence's new tokens after every decode
    call (from the engine's thread; streaming servers). The final ``Sample`` stays the authority:
    a listener's exception is logged and never stops decoding. None removes it."""
    self._token_listener = listener

  def _process(self, item):
    outputs, snapshot, version = item
    tokens_KxS, logprobs_KxS, valid_KxS = jax.device_get(outputs)
    listener = self._token_listener
    before = {s: len(seq.tokens) for s, seq in enumerate(snapshot) if seq is not None} if listener else {}
    for k in range(tokens_KxS.shape[0]):
      for s in np.flatnonzero(valid_KxS[k]):
        seq = snapshot[s]
        if seq is None or seq.done:
          continue
        token = int(tokens_KxS[k, s])
        seq.tokens.append(token)
        seq.logprobs.append(float(logprobs_KxS[k, s]))
        seq.versions.append(version)
        self.stats["tokens"] += 1
        reason = seq.finish_reason(token, self.eos_token_ids, self.max_len)
        if reason:
          self._keep_for_continuation(seq, reason)
          self._finish(seq, reason)
          if self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
            self._release([seq.slot])
            self._state = self.engine.retire(self._state, [seq.slot])  # (no device work)
    for s, n in before.items():
      seq = snapshot[s]
      if len(seq.tokens) > n:
        try:
          listener(seq.group.request.group_id, seq.index, seq.tokens[n:])
        except Exception:  # pylint: disable=broad-except  (a listener's bug never stops decoding)
          log.exception("token listener failed")

  def _keep_for_continuation(self, seq: Seq, reason: str) -> None:
    """Keeps the KV row of a finished sequence its request will continue, if all of it (prompt
    included) came from the weights in use."""
    if continuation_lib.wanted(seq.group.request.metadata, reason) and \
        self._slots[seq.slot] is seq and \
        seq.kv_version == self._version and all(v == self._version for v in seq.versions):
      self._continued.keep(self._state, seq.slot, seq.fed(),
                           len(seq.group.request.prompt_tokens))

  def _handle_aborts(self):
    with self._lock:
      ids, self._aborts = set(self._aborts), []
      if not ids:
        return
      kept = collections.deque()
      for g in self._waiting:
        if g.request.group_id in ids:
          self._emit_group(g, "abort")
        else:
          kept.append(g)
      self._waiting = kept
    freed = []
    for i, seq in enumerate(self._slots):
      if seq is not None and seq.group.request.group_id in ids:
        if not seq.done:
          self._finish(seq, "abort")
        self._slots[i] = None
        freed.append(i)
    for seq in [s for s in self._preempted() if s.group.request.group_id in ids]:
      self._paging.preempted.remove(seq)
      self._finish(seq, "abort")
    if freed:
      self._state = self.engine.deactivate(self._state, freed)
      self._release(freed)

  def _apply_params(self):
    with self._lock:
      pending, self._pending_params = self._pending_params, None
    if pending is None:
      return
    placed, given, version = pending
    if placed is None:  # "pause": the calls in flight finish first (a turn they end keeps its row)
      self._drain_inflight()
    # nothing the replaced version computed is reused: memoized prefixes, chunked prefills, rows
    self._prefixes.clear()
    self._chunks.clear()
    self._continued.clear()
    if placed is None:  # "pause": no call reads the current version once drained; let it go
      self.engine.params = None
      placed = self.engine.put_params(given)
      del given, pending
    # (the replaced version is freed once no call reads it)
    self.engine.params, self._version = placed, version
    self.stats["swaps"] += 1
    if self.continuation != "reprefill" or self._state is None:
      return
    self._drain_inflight()
    self._reprefill()
