"""The rollout service's policy over a paged KV cache (``pages.PageTable``): the pages a group
takes at admission, the pages each live sequence needs before a decode call, which sequences give
theirs back when the pool runs out (preemption: the ones admitted last), and when a preempted
sequence can come back (earliest admitted first, ahead of new groups). A preempted sequence is
re-prefilled (prompt + generated so far) and draws what it would have drawn (same keys and
positions).

The service admits a group when its prompt's pages and first call's growth fit with a page of
headroom left per live sample, its own included (when nothing runs, the first group needs no
headroom): without it, admission would fill the pool with first pages and the next call's growth
would preempt at once (measured on CPU, ``bench/paged_cache.py``, a pool of half the rows' memory:
no preemptions and 170 tokens/s with the headroom, 44 preemptions of 96 sequences and 122 tokens/s
without it).

Sequences are the service's: anything with ``slot``, ``length`` (tokens so far, prompt included),
``end`` (the length it stops at) and ``admitted`` (admission order).
"""

from __future__ import annotations

from areal_jax.sampler.pages import PageTable


class Paging:
  """A page table and the preempted sequences waiting for pages, for decode calls of
  ``steps_per_call`` steps."""

  def __init__(self, table: PageTable, steps_per_call: int):
    self.table, self.steps = table, steps_per_call
    self.preempted: list = []  # waiting to be re-prefilled, in admission order

  def written(self, seq, calls: int) -> int:
    """Positions ``[0, n)`` ``seq`` may have written after ``calls`` more decode calls (it feeds
    position ``length - 1`` next)."""
    return min(seq.length - 1 + calls * self.steps, seq.end)

  def admission_cost(self, n: int, prompt_len: int, end: int) -> int:
    """Free pages a group of ``n`` takes at admission: its prompt's (the KV of ``prompt[:-1]``) and
    its first call's growth."""
    prefix = prompt_len - 1
    grown = self.table.pages_for(min(prefix + self.steps, end)) - self.table.pages_for(prefix)
    return self.table.share_cost(n, prefix) + n * grown

  def grow(self, live: list, calls: int) -> bool:
    """Gives each live sequence the pages of the next call (``calls``: calls in flight + 1);
    False when the pool ran out first (some grew)."""
    return all(self.table.grow(s.slot, self.written(s, calls)) for s in live)

  def preempt_until_fit(self, live: list) -> list:
    """With nothing in flight: the sequences (admitted last first) whose pages go back so that the
    others grow by a call; their slots' pages are released and they wait in ``preempted``."""
    live = sorted(live, key=lambda s: s.admitted)
    out = []
    while live and not self.grow(live, 1):
      seq = live.pop()
      self.table.release(seq.slot)
      out.append(self.wait(seq))
    return out

  def wait(self, seq):
    """``seq`` (its pages given back) waits for pages among the preempted; returns it."""
    self.preempted = sorted(self.preempted + [seq], key=lambda s: s.admitted)
    return seq

  def resumable(self):
    """The preempted sequence to re-prefill next if its pages (its KV so far and a call's growth)
    are free, else None."""
    if not self.preempted:
      return None
    seq = self.preempted[0]  # its "prompt" now: prompt + generated so far
    need = self.admission_cost(1, seq.length, seq.end)
    return seq if need <= self.table.free_pages else None

  def reset(self) -> None:
    """Every page free, nothing preempted (the service failed or stopped)."""
    self.table.reset()
    self.preempted = []
