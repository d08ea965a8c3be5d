"""How the rollout service's sequences get their KV (``service.JaxRolloutEngine`` runs it):
admission of waiting groups (``admission``) and their prefill (memoised, ``prefix_memo``; a
continued turn's kept row, ``continuation``; a long prompt in chunks between decode calls,
``chunked_prefill``), a paged cache's pages, preemption and resumption (``paging``), and the
re-prefill of live sequences after a weight swap (``continuation="reprefill"``).

A part of the service's class (``Prefilling``, a base of ``JaxRolloutEngine``) over its state:
``_slots``, ``_waiting``, ``_state``, ``_paging``, ``_prefixes``, ``_chunks``, ``_continued``."""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from areal_jax.sampler import admission, prefix_memo, sampling
from areal_jax.sampler.sequences import Group, Seq

log = logging.getLogger(__name__)


class Prefilling:
  """Admission, prefill, paging and re-prefill of ``JaxRolloutEngine`` (see the module doc)."""

  def _admit(self):
    """Admits waiting groups into free slots (``admission.pick``; a paged cache's preempted
    sequences first); the prompts of all groups admitted at once are prefilled together."""
    free = [i for i, s in enumerate(self._slots) if s is None]
    if self._paging is not None:
      free = self._resume(free)
      if self._paging.preempted:  # (still waiting for pages: new groups wait behind them)
        return
    pages, live, cost = 0, 0, self._pages_needed
    if self._paging is not None:  # a page of headroom per live sample (its next), new ones too
      live = sum(s is not None and not s.done for s in self._slots)
      pages = self._paging.table.free_pages - live
      cost = lambda g: self._pages_needed(g) + g.request.n  # noqa: E731
    with self._lock:  # (groups whose prompts are prefilled in chunks wait for the last one)
      waiting = collections.deque(g for g in self._waiting if not self._chunks.pending(
          g, len(g.request.prompt_tokens) - 1) or not self._chunked(g))
      groups = admission.pick(waiting, len(free), pages, self.num_slots, cost)
      if not groups and self._paging is not None and not live and waiting:
        # nothing runs: one group without headroom (any group the pool holds gets to run)
        groups = admission.pick(waiting, min(len(free), waiting[0].request.n), pages,
                                self.num_slots, self._pages_needed)
      self._waiting = collections.deque(g for g in self._waiting
                                        if not any(g is a for a in groups))
    admitted = []
    for group in groups:
      admitted.append((group, free[:group.request.n]))
      free = free[group.request.n:]
    if not admitted:
      return
    # prompts that continue a kept sequence extend it instead (in _start_group); the others are
    # prefilled a window at a time, its groups started before the next window's prefill, so that
    # no more prefixes are held at once than the memory plan counts (``prefix_memo.windows``)
    prompts = [list(g.request.prompt_tokens[:-1]) for g, _ in admitted]
    fresh = [i for i, p in enumerate(prompts) if self._continued.match(p)[0] is None
             and not self._chunks.ready(admitted[i][0])]
    started = 0  # groups start in admission order, continuations among them
    for window in prefix_memo.windows(self.engine, [prompts[i] for i in fresh]):
      try:
        self._prefixes.fill(self.engine.params, [prompts[fresh[j]] for j in window])
      except Exception:  # let each group fail (or not) on its own below
        log.exception("batched prefill failed")
      for i in range(started, fresh[window[-1]] + 1):
        self._start_or_fail(*admitted[i])
      started = fresh[window[-1]] + 1
      self._prefixes.trim()
    for i in range(started, len(admitted)):
      self._start_or_fail(*admitted[i])
    self._prefixes.trim()  # (a continuation that found no kept row was prefilled alone)

  def _start_or_fail(self, group: Group, slots: list[int]):
    try:
      self._start_group(group, slots)
    except Exception as e:  # this request only
      log.exception("admitting group %s failed", group.request.group_id)
      self._emit_group(group, "error", f"{type(e).__name__}: {e}")

  def _start_group(self, group: Group, slots: list[int]):
    r, p = group.request, group.request.params
    prompt = [int(t) for t in r.prompt_tokens]
    params = self.engine.params
    prefix = (self._continued.take(params, prompt[:-1], self._state) if len(self._continued)
              else None)
    if prefix is not None:
      self.stats["continued"] += 1
    elif (prefix := self._chunks.take(group)) is not None:  # (prefilled in chunks)
      self._prefixes.put(prompt[:-1], prefix)
    else:
      prefix = self._prefixes.get(params, prompt[:-1])
    keys = np.asarray(sampling.slot_keys(p.seed, r.n))
    end = min(len(prompt) + p.max_new_tokens, self.max_len)
    pages = None
    if self._paging is not None:  # admission checked there are enough
      if not self._paging.table.share(slots, len(prompt) - 1):
        raise RuntimeError("paged cache: admitted a group its free pages cannot hold")
      pages = self._paging.table.table[slots]
    try:
      self._state = self.engine.insert(
          self._state, prefix, slots, token=[prompt[-1]] * r.n, pos=[len(prompt) - 1] * r.n,
          end=[end] * r.n, keys=keys, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
          greedy=p.greedy, stop_ids=list(group.stop_ids), pages=pages)
    except Exception:  # the group fails alone: its pages go back
      self._release(slots)
      raise
    now = time.time()
    for i, slot in enumerate(slots):
      self._admissions += 1
      seq = Seq(group, i, slot, now, kv_version=self._version, end=end,
                 admitted=self._admissions)
      group.seqs.append(seq)
      self._slots[slot] = seq

  # ---- paged cache (``paging``) -------------------------------------------------------------

  def _grow(self):
    """Gives every live sequence the pages the next call writes; when the pool runs out, syncs
    and preempts the sequences admitted last until the others' pages fit."""
    live = [s for s in self._slots if s is not None and not s.done]
    if self._paging.grow(live, len(self._inflight) + 1):
      return
    self._drain_inflight()  # exact lengths, nothing in flight
    self._preempt(self._paging.preempt_until_fit(
        [s for s in self._slots if s is not None and not s.done]))

  def _preempt(self, seqs: list[Seq]) -> None:
    """Empties the slots of ``seqs`` (their pages already back, ``paging`` holds them)."""
    for seq in seqs:
      self._state = self.engine.deactivate(self._state, [seq.slot])
      self._slots[seq.slot] = None
      self.stats["preempted"] += 1

  def _resume(self, free: list[int]) -> list[int]:
    """Re-prefills preempted sequences into free slots while their pages fit; returns the slots
    still free."""
    while free and (seq := self._paging.resumable()) is not None:
      if self._chunks.pending(seq, seq.length - 1):  # (prefilled in chunks first)
        break
      if not self._reinsert(seq, free[0]):  # (resumable checked its pages)
        raise RuntimeError("paged cache: no pages for a resumable sequence")
      self._paging.preempted.remove(seq)
      self._slots[free.pop(0)] = seq
      self.stats["resumed"] += 1
    self._prefixes.trim()  # (a resumed sequence's prefix is its own: nothing shares it)
    return free

  def _preempted(self) -> list[Seq]:
    return [] if self._paging is None else list(self._paging.preempted)

  def _pages_needed(self, group: Group) -> int:
    if self._paging is None:
      return 0
    r = group.request
    end = min(len(r.prompt_tokens) + r.params.max_new_tokens, self.max_len)
    return self._paging.admission_cost(r.n, len(r.prompt_tokens), end)

  def _reinsert(self, seq: Seq, slot: int) -> bool:
    """Re-prefills ``seq`` (prompt + generated so far) under the weights in use into ``slot``;
    False (nothing done) when a paged cache has not the pages for it."""
    r, p = seq.group.request, seq.group.request.params
    tokens = [int(t) for t in r.prompt_tokens] + seq.tokens
    pages = None
    if self._paging is not None:
      if not self._paging.table.share([slot], len(tokens) - 1):
        return False
      pages = self._paging.table.table[[slot]]
    try:
      prefix = self._chunks.take(seq)  # (prefilled in chunks), else prefilled now
      prefix = self._prefixes.get(self.engine.params, tokens[:-1]) if prefix is None else prefix
      key = np.asarray(sampling.slot_key(p.seed, seq.index))[None]
      self._state = self.engine.insert(
          self._state, prefix, [slot], token=[tokens[-1]], pos=[len(tokens) - 1],
          end=[seq.end], keys=key, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
          greedy=p.greedy, stop_ids=list(seq.group.stop_ids), pages=pages)
    except Exception:
      self._release([slot])
      raise
    seq.slot, seq.kv_version, seq.prefilling = slot, self._version, False
    return True

  # ---- chunked prefill (``chunked_prefill``) ---------------------------------------------------

  def _chunked(self, group: Group) -> bool:
    """Whether ``group``'s prompt is prefilled in chunks: long, not in the prefix memo, and not a
    continued turn (``continuation``)."""
    prompt = group.prefill_key
    return self._chunks.long(len(prompt)) and prompt not in self._prefixes and \
        self._continued.match(prompt)[0] is None

  def _chunk_owner(self):
    """``(owner, tokens())`` of the most urgent prefill that runs in chunks (None: none): a
    sequence sitting out for its re-prefill, a preempted one next to resume, else the first
    waiting group whose prompt is."""
    sitting = [s for s in self._slots if s is not None and not s.done and s.prefilling]
    if sitting:
      seq = min(sitting, key=lambda s: s.admitted)
      return seq, seq.fed
    preempted = self._preempted()
    if preempted and self._chunks.long(preempted[0].length - 1):
      return preempted[0], preempted[0].fed
    with self._lock:
      group = next((g for g in self._waiting if self._chunked(g)), None)
    return None if group is None else (group, lambda: group.prefill_key)

  def _prefill_chunk(self) -> None:
    """Runs a chunk of the most urgent chunked prefill; a sequence sitting out whose row is
    finished goes back into its slot."""
    if not self._chunks.chunk:
      return
    owner, tokens = self._chunk_owner() or (None, None)
    if self._chunks.step(self.engine.params, owner, tokens):
      self._prefixes.trim()  # (room for the row held)
    if isinstance(owner, Seq) and owner.prefilling and self._chunks.ready(owner):
      self._reinsert(owner, owner.slot)  # (a row cache: no pages to find)
      self.stats["reprefills"] += 1

  def _sit_out(self, seqs: list[Seq]) -> None:
    """Sequences whose re-prefill runs in chunks stop decoding until their row is finished: a
    row cache's stay in their slots (inactive), a paged cache's wait as preempted ones do."""
    if self._paging is not None:
      self._preempt([self._paging.wait(seq) for seq in seqs])
    elif seqs:
      self._state = self.engine.deactivate(self._state, [seq.slot for seq in seqs])
      for seq in seqs:
        seq.prefilling = True

  def _release(self, slots: list[int]) -> None:
    """A paged cache's pages of ``slots`` go back."""
    if self._paging is not None:
      for slot in slots:
        self._paging.table.release(slot)

  def _reprefill(self) -> None:
    """Re-prefills every live sequence under the weights just swapped in (prompt and generated
    tokens), admitted first first; a long one in chunks (``_sit_out``)."""
    live = sorted((seq for seq in self._slots if seq is not None and not seq.done),
                  key=lambda s: s.admitted)
    self._release([seq.slot for seq in live])  # (a paged cache: each takes its own pages again)
    self._sit_out([seq for seq in live if self._chunks.long(seq.length - 1)])
    live = [seq for seq in live if not self._chunks.long(seq.length - 1)]
    prompts = [seq.fed() for seq in live]
    for window in prefix_memo.windows(self.engine, prompts):  # (as admission: bounded prefixes)
      self._prefixes.fill(self.engine.params, [prompts[i] for i in window])
      for i in window:
        seq = live[i]
        if self._reinsert(seq, seq.slot):
          self.stats["reprefills"] += 1
        else:  # a group's shared prompt pages are now one copy each: the pool may not hold all
          self._preempt([self._paging.wait(seq)])
      self._prefixes.trim()
