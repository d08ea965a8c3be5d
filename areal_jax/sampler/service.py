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

Prefills are memoised per token sequence (a few entries, cleared by a weight swap), so samples of
one prompt submitted as separate requests (e.g. ``n=1`` with per-sample budgets) share one prefill;
the prompts of the groups admitted in one round are prefilled together (``prefill_batch``).

Multi-turn continuation (``continuation.py``): a request with ``metadata["continue"]`` keeps its
finished sequences' KV rows; a later request whose prompt shares most of its start with one (the
next turn of the conversation, or a turn cut at a tool call and continued) runs only the tokens
after the shared start on top of it instead of prefilling the whole history.

Weight swaps (``update_params``) take effect between two decode calls without draining sequences.
Continuation modes:
  * ``"keep_cache"``: in-flight sequences keep the KV cache computed by the old weights; tokens after
    the swap are drawn from the new weights attending to that old cache. Their logprobs are those of
    the new weights *given the old cache*; they differ from a fresh forward of the new weights over
    the whole sequence by the staleness of the cached prefix (the decoupled objective accounts for
    it). Cheapest.
  * ``"reprefill"``: every in-flight sequence is re-prefilled (prompt + generated so far) under the
    new weights, so tokens after the swap carry exactly the new weights' logprobs.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.models.transformer import Transformer
from areal_jax.rollout_api import GroupRequest, RolloutEngine, Sample, SamplingParams
from areal_jax.sampler import continuation as continuation_lib
from areal_jax.sampler import sampling
from areal_jax.sampler.engine import DecodeEngine, EngineConfig

log = logging.getLogger(__name__)

CONTINUATION_MODES = ("keep_cache", "reprefill")


@dataclasses.dataclass
class _Group:
  request: GroupRequest
  submitted_s: float
  stop_ids: tuple[int, ...]
  seqs: list["_Seq"] = dataclasses.field(default_factory=list)
  bypassed: int = 0  # later groups admitted while this one waited at the head of the queue


@dataclasses.dataclass
class _Seq:
  group: _Group
  index: int
  slot: int
  started_s: float
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  done: bool = False
  kv_version: int = -1  # the weights that computed the prompt's KV

  @property
  def length(self) -> int:
    return len(self.group.request.prompt_tokens) + len(self.tokens)


class JaxRolloutEngine(RolloutEngine):
  """Continuous-batching rollout engine on a JAX mesh; see the module docstring."""

  def __init__(self, model: Transformer, *, mesh: Mesh | None = None, num_slots: int = 8,
               max_len: int = 512, prefill_buckets: tuple[int, ...] | None = None,
               kv_buckets: tuple[int, ...] | None = None, continuation: str = "keep_cache",
               eos_token_ids: tuple[int, ...] | None = None, steps_per_call: int = 0,
               max_stop_ids: int = 8, cache_dtype: str | None = None, params: Any = None,
               version: int = 0, decode_attention: str = "auto", decode_matmul: str = "auto",
               decode_layers: str = "auto", decode_projections: str = "auto", lora=None):
    if continuation not in CONTINUATION_MODES:
      raise ValueError(f"continuation={continuation!r}; expected one of {CONTINUATION_MODES}")
    self.continuation = continuation
    self.engine = DecodeEngine(model, EngineConfig(
        num_slots=num_slots, max_len=max_len, prefill_buckets=prefill_buckets,
        kv_buckets=kv_buckets, steps_per_call=steps_per_call, max_stop_ids=max_stop_ids,
        cache_dtype=cache_dtype, decode_attention=decode_attention, decode_matmul=decode_matmul,
        decode_layers=decode_layers, decode_projections=decode_projections),
        mesh, lora=lora)
    self.num_slots, self.max_len = num_slots, max_len
    self.vocab_size = model.cfg.vocab_size
    self.eos_token_ids = tuple(model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    self._params = self.engine.params if params is None else self.engine.put_params(params)
    self._version = version
    self._state = None
    self._slots: list[_Seq | None] = [None] * num_slots
    self._waiting: collections.deque[_Group] = collections.deque()
    self._inflight: collections.deque = collections.deque()  # (outputs, slot snapshot, version)
    self._out: queue.Queue[Sample] = queue.Queue()
    self._lock = threading.Condition()
    self._pending_params = None
    self._aborts: list[int] = []
    self._paused = False
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._prefixes: collections.OrderedDict = collections.OrderedDict()  # tokens -> KV prefix
    self._continued = continuation_lib.Continuations(self.engine, capacity=num_slots)
    self.stats = collections.Counter()
    self._token_listener = None

  # ---- RolloutEngine ---------------------------------------------------------------------------

  @property
  def version(self) -> int:
    return self._version

  def compile_stats(self) -> dict[str, float]:
    return dict(self.engine.compile_stats)

  def warmup(self) -> None:
    """Compiles every bucket now (optional; otherwise the first use of a bucket compiles it)."""
    if self._thread is not None:
      raise RuntimeError("warmup() must run before start()")
    self._state = self.engine.warmup(self._state or self.engine.init_state())
    n = 1
    while n <= 2 * self.num_slots:  # the per-request sampling keys (padded to powers of two)
      sampling.slot_keys(0, n)
      n *= 2

  def start(self) -> None:
    if self._thread is not None:
      return
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
    for seq in self._slots:
      if seq is not None and not seq.done:
        self._finish(seq, "abort")
    self._slots = [None] * self.num_slots
    with self._lock:
      while self._waiting:
        self._emit_group(self._waiting.popleft(), "abort")

  def submit(self, request: GroupRequest) -> None:
    now = time.time()
    group = _Group(request, now, ())
    try:
      group.stop_ids = self._validate(request)
    except ValueError as e:
      self._emit_group(group, "error", str(e))
      return
    with self._lock:
      self._waiting.append(group)
      self._lock.notify_all()

  def poll(self, timeout: float | None = 0.0) -> list[Sample]:
    out = []
    try:
      if timeout is None or timeout > 0:
        out.append(self._out.get(timeout=timeout))
      while True:
        out.append(self._out.get_nowait())
    except queue.Empty:
      pass
    return out

  def update_params(self, params: Any, version: int) -> None:
    placed = self.engine.put_params(params)
    with self._lock:
      self._pending_params = (placed, int(version))
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

  # ---- validation ------------------------------------------------------------------------------

  def _validate(self, r: GroupRequest) -> tuple[int, ...]:
    p: SamplingParams = r.params
    prompt = r.prompt_tokens
    if not prompt:
      raise ValueError("empty prompt")
    if len(prompt) >= self.max_len:
      raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in a cache of "
                       f"{self.max_len} positions")
    if any(not 0 <= int(t) < self.vocab_size for t in prompt):
      raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
    if not 1 <= r.n <= self.num_slots:
      raise ValueError(f"n={r.n} must be between 1 and the slot count {self.num_slots}")
    if not p.greedy and not p.temperature > 0:
      raise ValueError(f"temperature={p.temperature} must be > 0 (or set greedy=True)")
    if not 0 < p.top_p <= 1:
      raise ValueError(f"top_p={p.top_p} must lie in (0, 1]")
    if p.top_k < 0:
      raise ValueError(f"top_k={p.top_k} must be >= 0 (0 disables it)")
    if p.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={p.max_new_tokens} must be >= 1")
    eos = () if p.ignore_eos else self.eos_token_ids
    stop_ids = tuple(dict.fromkeys([*eos, *p.stop_token_ids]))
    if len(stop_ids) > self.engine.config.max_stop_ids:
      raise ValueError(f"{len(stop_ids)} EOS + stop ids exceed max_stop_ids="
                       f"{self.engine.config.max_stop_ids}")
    if any(not 0 <= int(t) < self.vocab_size for t in stop_ids):
      raise ValueError("stop token ids must be valid vocabulary ids")
    return stop_ids

  # ---- output ----------------------------------------------------------------------------------

  def _emit_group(self, group: _Group, reason: str, error: str | None = None):
    r, now = group.request, time.time()
    for i in range(r.n):
      self._out.put(Sample(r.group_id, i, list(r.prompt_tokens), [], [], [], reason,
                           group.submitted_s, now if reason == "error" else 0.0, now, error,
                           dict(r.metadata)))

  def _finish(self, seq: _Seq, reason: str):
    seq.done = True
    r = seq.group.request
    self._out.put(Sample(r.group_id, seq.index, list(r.prompt_tokens), seq.tokens, seq.logprobs,
                         seq.versions, reason, seq.group.submitted_s, seq.started_s, time.time(),
                         None, dict(r.metadata)))
    self.stats["finished"] += 1

  # ---- the loop --------------------------------------------------------------------------------

  def _run(self):
    try:
      while True:
        with self._lock:
          if self._stopping:
            return
          busy = any(s is not None for s in self._slots) or bool(self._waiting)
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
        if any(s is not None and not s.done for s in self._slots):
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
    for i, seq in enumerate(self._slots):
      if seq is not None and not seq.done:
        seq.done = True
        r = seq.group.request
        self._out.put(Sample(r.group_id, seq.index, list(r.prompt_tokens), seq.tokens,
                             seq.logprobs, seq.versions, "error", seq.group.submitted_s,
                             seq.started_s, time.time(), message, dict(r.metadata)))
      self._slots[i] = None
    with self._lock:
      while self._waiting:
        self._emit_group(self._waiting.popleft(), "error", message)
    self._state = self.engine.init_state()

  def _dispatch(self):
    width = self._compact()
    active = [s for s in self._slots[:width] if s is not None and not s.done]
    max_pos = max(s.length - 1 for s in active) + len(self._inflight) * \
        self.engine.config.steps_per_call
    kv_len = self.engine.kv_bucket(max_pos)
    self._state, outputs = self.engine.generate(self._params, self._state, kv_len, width)
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
        reason = self._finish_reason(seq, token)
        if reason:
          self._keep_for_continuation(seq, reason)
          self._finish(seq, reason)
          if self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None
    for s, n in before.items():
      seq = snapshot[s]
      if len(seq.tokens) > n:
        try:
          listener(seq.group.request.group_id, seq.index, seq.tokens[n:])
        except Exception:  # pylint: disable=broad-except  (a listener's bug never stops decoding)
          log.exception("token listener failed")

  def _keep_for_continuation(self, seq: _Seq, reason: str) -> None:
    """Keeps the KV row of a finished sequence its request will continue, if all of it (prompt
    included) came from the weights in use."""
    r = seq.group.request
    if not r.metadata.get("continue") or reason not in ("eos", "stop", "length"):
      return
    if seq.kv_version != self._version or any(v != self._version for v in seq.versions):
      return
    fed = [int(t) for t in r.prompt_tokens] + seq.tokens[:-1]
    self._continued.keep(self._state, seq.slot, fed)

  def _finish_reason(self, seq: _Seq, token: int) -> str | None:
    if token in seq.group.stop_ids:  # the EOS ids too, unless the request ignores them
      return "eos" if token in self.eos_token_ids else "stop"
    if len(seq.tokens) >= seq.group.request.params.max_new_tokens:
      return "length"
    if seq.length >= self.max_len:
      return "cache_full"
    return None

  def _admit(self):
    """FIFO, except that a later group that fits the free slots may overtake a head group that does
    not, at most ``num_slots`` times per head group (then the slots freed are kept for the head, so
    a big group is never starved by a stream of small ones). The prompts of all groups admitted
    at once are prefilled together."""
    admitted = []
    with self._lock:
      free = [i for i, s in enumerate(self._slots) if s is None]
      while self._waiting and free:
        head = self._waiting[0]
        if head.request.n <= len(free):
          group = self._waiting.popleft()
        elif head.bypassed < self.num_slots:
          group = next((g for g in self._waiting if g.request.n <= len(free)), None)
          if group is None:
            break
          self._waiting.remove(group)
          head.bypassed += 1
        else:
          break
        admitted.append((group, free[:group.request.n]))
        free = free[group.request.n:]
    if not admitted:
      return
    try:  # (prompts that continue a kept sequence extend it instead, in _start_group)
      self._prefill_many([list(g.request.prompt_tokens[:-1]) for g, _ in admitted
                          if self._continued.match(list(g.request.prompt_tokens[:-1]))[0] is None])
    except Exception:  # let each group fail (or not) on its own below
      log.exception("batched prefill failed")
    for group, slots in admitted:
      try:
        self._start_group(group, slots)
      except Exception as e:  # this request only
        log.exception("admitting group %s failed", group.request.group_id)
        self._emit_group(group, "error", f"{type(e).__name__}: {e}")

  _PREFIX_CACHE_SIZE = 8

  def _prefix(self, tokens: list[int]):
    """KV prefix of ``tokens`` under the current weights (from the memo, else prefilled now)."""
    key = tuple(int(t) for t in tokens)
    if key not in self._prefixes:
      self._prefill_many([tokens])
    self._prefixes.move_to_end(key)
    return self._prefixes[key]

  def _prefill_many(self, token_lists: list[list[int]]):
    """Puts the prefixes of ``token_lists`` in the memo (LRU, cleared by a weight swap), prefilling
    those not there yet in batched calls."""
    keys = [tuple(int(t) for t in ts) for ts in token_lists]
    todo = [k for k in dict.fromkeys(keys) if k not in self._prefixes]
    self.stats["prefix_hits"] += len(keys) - len(todo)
    for key in keys:
      if key in self._prefixes:
        self._prefixes.move_to_end(key)
    for key, prefix in zip(todo, self.engine.prefill_batch(self._params, [list(k) for k in todo])):
      self._prefixes[key] = prefix
      self.stats["prefills"] += 1
    while len(self._prefixes) > max(self._PREFIX_CACHE_SIZE, len(set(keys))):
      self._prefixes.popitem(last=False)

  def _start_group(self, group: _Group, slots: list[int]):
    r, p = group.request, group.request.params
    prompt = [int(t) for t in r.prompt_tokens]
    prefix = self._continued.take(self._params, prompt[:-1]) if len(self._continued) else None
    if prefix is None:
      prefix = self._prefix(prompt[:-1])
    else:
      self.stats["continued"] += 1
    keys = np.asarray(sampling.slot_keys(p.seed, r.n))
    end = min(len(prompt) + p.max_new_tokens, self.max_len)
    self._state = self.engine.insert(
        self._state, prefix, slots, token=[prompt[-1]] * r.n, pos=[len(prompt) - 1] * r.n,
        end=[end] * r.n, keys=keys, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        greedy=p.greedy, stop_ids=list(group.stop_ids))
    now = time.time()
    for i, slot in enumerate(slots):
      seq = _Seq(group, i, slot, now, kv_version=self._version)
      group.seqs.append(seq)
      self._slots[slot] = seq

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
    if freed:
      self._state = self.engine.deactivate(self._state, freed)

  def _apply_params(self):
    with self._lock:
      pending, self._pending_params = self._pending_params, None
    if pending is None:
      return
    self._params, self._version = pending
    self._prefixes.clear()
    self._continued.clear()
    self.stats["swaps"] += 1
    if self.continuation != "reprefill" or self._state is None:
      return
    self._drain_inflight()
    live = [(seq, [int(t) for t in seq.group.request.prompt_tokens] + seq.tokens)
            for seq in self._slots if seq is not None and not seq.done]
    self._prefill_many([tokens[:-1] for _, tokens in live])
    for seq, tokens in live:
      r, p = seq.group.request, seq.group.request.params
      prefix = self._prefix(tokens[:-1])
      key = np.asarray(sampling.slot_key(p.seed, seq.index))[None]
      end = min(len(r.prompt_tokens) + p.max_new_tokens, self.max_len)
      self._state = self.engine.insert(
          self._state, prefix, [seq.slot], token=[tokens[-1]], pos=[len(tokens) - 1], end=[end],
          keys=key, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, greedy=p.greedy,
          stop_ids=list(seq.group.stop_ids))
      seq.kv_version = self._version
      self.stats["reprefills"] += 1
