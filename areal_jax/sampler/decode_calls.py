"""The calls a ``DecodeEngine`` makes on its slots, each a jitted program per bucket.

  * ``prefill(params, tokens)`` / ``prefill_batch``: a prompt's KV prefix (padded to a length
    bucket; several prompts a call, up to ``max_prefill_batch`` rows and ``max_prefill_tokens``).
  * ``insert(state, prefix, slots, ...)``: copies one prefix into any number of slots (a GRPO
    group shares one prefill) and arms them: sampling parameters, keys, stop conditions.
  * ``generate(params, state, kv_len, width)``: advances slots ``[0, width)`` by
    ``steps_per_call`` tokens, stop conditions checked on the device; the state is donated.
  * ``move(state, src, dst)``: moves sequences between slots, so live ones stay in the lowest.

The decode state is a dict of device arrays plus one host entry, ``TRUNCATES``: per slot, whether
it holds a sequence whose sampling parameters truncate (``sampling.truncates``), set by
``insert``, carried by ``move``, cleared by ``deactivate`` and ``retire``; ``generate`` picks its
program by it where the host decides truncation (``choice.truncation_on_host``).

``DecodeCalls`` is a mixin of ``engine.DecodeEngine``: it reads the engine's config, mesh, held
formats, kernels and program caches (``_prefill_fns``, ...; ``_variant`` compiles a variant once).
"""

from __future__ import annotations

import bisect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax import sharding
from areal_jax.kernels import choice
from areal_jax.sampler import sampling, slot_cache

State = dict[str, Any]
# the decode state's host-side entry (not an array the programs take)
TRUNCATES = "truncates"


class DecodeCalls:
  """Prefill, insert, generate and move of ``DecodeEngine`` (see the module doc)."""

  # ---- prefill ---------------------------------------------------------------------------------

  def prefill_bucket(self, length: int) -> int:
    i = bisect.bisect_left(self.prefill_buckets, length)
    if i == len(self.prefill_buckets):
      raise ValueError(f"{length} tokens exceed the largest prefill bucket {self.prefill_buckets[-1]}")
    return self.prefill_buckets[i]

  def prefill(self, params: dict, tokens: list[int] | np.ndarray):
    """KV prefix of ``tokens`` (list per layer of {"k","v"} ``[1, bucket, Hkv, D]``; in scan mode one
    {"k","v"} of ``[n_layers, 1, bucket, Hkv, D]``), or None if empty."""
    return self.prefill_batch(params, [tokens])[0]

  def prefill_batch(self, params: dict, token_lists: list) -> list:
    """``prefill`` of several prompts, ``max_prefill_batch`` per call. Rows are independent, so a
    prefix does not depend on what it was batched with; prompts are taken shortest first, and a call
    pads to its longest prompt's bucket."""
    out = [None] * len(token_lists)
    todo = sorted((i for i, t in enumerate(token_lists) if len(t)), key=lambda i: len(token_lists[i]))
    step, start = self.prefill_rows(len(todo)), 0
    longest = lambda chunk: self.prefill_bucket(max(len(token_lists[i]) for i in chunk))  # noqa: E731
    while start < len(todo):
      chunk = todo[start:start + step]
      bucket = longest(chunk)
      n = self.prefill_rows(len(chunk), bucket)
      if n < len(chunk):  # the token budget: fewer rows at this bucket (shortest first)
        chunk = chunk[:n]
        bucket = longest(chunk)
      start += len(chunk)
      tokens_NxL = np.zeros((n, bucket), np.int32)
      for row, i in enumerate(chunk):
        tokens_NxL[row, :len(token_lists[i])] = token_lists[i]
      fn = self._variant(self._prefill_fns, (bucket, n), lambda: self._make_prefill(bucket, n),
                         f"prefill bucket={bucket} rows={n}")
      for i, prefix in zip(chunk, fn(params, tokens_NxL)):
        out[i] = prefix
    return out

  def prefill_rows(self, k: int, bucket: int = 0) -> int:
    """Rows of a prefill call for ``k`` prompts: a power of two, at most ``max_prefill_batch`` and
    the slot count (rounded up), the most prompts one admission round can bring; at ``bucket``
    also at most ``max_prefill_tokens / bucket`` (at least one)."""
    pow2 = lambda n: 1 << max(n - 1, 0).bit_length()
    floor2 = lambda n: 1 << (max(n, 1).bit_length() - 1)
    cap = min(floor2(self.config.max_prefill_batch), pow2(self.config.num_slots))
    if bucket and self.config.max_prefill_tokens:
      cap = min(cap, floor2(self.config.max_prefill_tokens // bucket))
    return min(pow2(k), cap)

  def prefill_positions_to_plan(self) -> int:
    """Positions of the largest planned prefill call's prefixes (rows x bucket)."""
    return max(bucket * rows for bucket, rows in self.prefill_shapes_to_plan())

  def prefill_shapes_to_plan(self) -> list[tuple[int, int]]:
    """``(bucket, rows)`` of the prefill calls whose memory bounds every other's: the largest
    bucket at its most rows, and the bucket whose most rows hold the most tokens (under
    ``max_prefill_tokens`` a smaller bucket can take more rows)."""
    most = [(b, self.prefill_rows(self.config.max_prefill_batch, b)) for b in self.prefill_buckets]
    return sorted({most[-1], max(most, key=lambda s: (s[0] * s[1], s[0]))})

  def _make_prefill(self, bucket: int, n: int):
    cfg, mesh, cache_dtype = self.model_cfg, self.mesh, self._cache_dtype
    layers, layout, attention = self.layers, self.cache_layout, self.prefill_attention

    def fn(params, tokens_NxL):
      with sharding.use(mesh):
        cache = slot_cache.make(cfg, n, bucket, cache_dtype, layout)
        start = jnp.zeros((n,), jnp.int32)
        _, cache = layers.extend(params)(tokens_NxL, start, cache, kv_len=bucket,
                                         prefill_attention=attention)
      # one prefix per prompt, as separate buffers
      return [slot_cache.row(cache, i, layout) for i in range(n)]

    prefix = slot_cache.shardings(self._named, cfg, 1, bucket, layout, prefix=True)
    return jax.jit(fn, in_shardings=(self.held_formats, None), out_shardings=[prefix] * n,
                   compiler_options=self.compiler_options)

  # ---- insert ----------------------------------------------------------------------------------

  def insert(self, state: State, prefix, slots: list[int], *, token: list[int], pos: list[int],
             end: list[int], keys: np.ndarray, temperature: float, top_k: int, top_p: float,
             greedy: bool, stop_ids: list[int], pages: np.ndarray | None = None) -> State:
    """Copies ``prefix`` into ``slots`` and arms them: slot ``slots[i]`` next feeds ``token[i]`` at
    ``pos[i]`` and stops when its sequence reaches ``end[i]`` tokens or samples a ``stop_ids`` token.
    ``keys`` are raw uint32[len(slots), 2] sampling keys. Paged cache: ``pages`` are the slots'
    page table rows (``sampler.pages``); positions ``[0, pos[i])`` of the prefix go there."""
    c = self.config
    s, m = c.num_slots, c.max_stop_ids
    if len(stop_ids) > m:
      raise ValueError(f"{len(stop_ids)} stop ids exceed max_stop_ids={m}")
    k = len(slots)
    n = self.insert_rows(k)  # rows written: k padded to a power of two (index s = dropped)
    slots_N = np.full((n,), s, np.int32)
    slots_N[:k] = slots
    vals = {
        "tokens": np.zeros((n,), np.int32), "pos": np.zeros((n,), np.int32),
        "end": np.zeros((n,), np.int32), "key": np.zeros((n, 2), np.uint32),
    }
    vals["tokens"][:k], vals["pos"][:k], vals["end"][:k] = token, pos, end
    vals["key"][:k] = keys
    vals["temperature"] = np.full((n,), temperature, np.float32)
    vals["top_k"] = np.full((n,), top_k, np.int32)
    vals["top_p"] = np.full((n,), top_p, np.float32)
    vals["greedy"] = np.full((n,), greedy, np.bool_)
    stops = np.full((n, m), -1, np.int32)
    stops[:, :len(stop_ids)] = stop_ids
    vals["stop_ids"] = stops
    bucket = 0 if prefix is None else slot_cache.prefix_len(prefix, self.cache_layout)
    fn = self._variant(self._insert_fns, (bucket, n), lambda: self._make_insert(bucket),
                       f"insert bucket={bucket} rows={n}")
    device, truncates_S = _split(state)
    truncates_S[slots] = sampling.truncates(vals["top_k"][:k], vals["top_p"][:k],
                                            vals["greedy"][:k])
    if not self.paged:
      return {**fn(device, prefix, slots_N, vals), TRUNCATES: truncates_S}
    pages_N = np.full((n, self.pages_per_slot), c.kv_pages, np.int32)  # padding rows: trash
    pages_N[:k] = self._table(pages)
    return {**fn(device, prefix, slots_N, vals, pages_N), TRUNCATES: truncates_S}

  def _table(self, pages) -> np.ndarray:
    if not self.paged:
      raise ValueError("page tables are for a paged cache (kv_pages > 0)")
    if pages is None:
      raise ValueError("a paged cache's insert and generate take the slots' page tables")
    return np.array(pages, np.int32)  # a copy: the caller's table changes after dispatch

  def insert_rows(self, k: int) -> int:
    """Rows an insert of ``k`` slots writes: the next power of two, at most the slot count (so an
    insert costs in proportion to its group, with log2(slots) compiled variants per bucket)."""
    return min(1 << max(k - 1, 0).bit_length(), self.config.num_slots)

  def _make_insert(self, bucket: int):
    layout, paged = self.cache_layout, self.paged

    def fn(state, prefix, slots_N, vals, pages_N=None):
      state = dict(state)
      if prefix is not None and paged:
        state["cache"] = slot_cache.write_prefix_pages(state["cache"], prefix, pages_N,
                                                       vals["pos"], bucket)
      elif prefix is not None:
        state["cache"] = slot_cache.write_prefix(state["cache"], prefix, slots_N, bucket, layout)
      for name, value in vals.items():
        state[name] = state[name].at[slots_N].set(value, mode="drop")
      state["active"] = state["active"].at[slots_N].set(True, mode="drop")
      return state

    return jax.jit(fn, out_shardings=self.state_formats, donate_argnums=0)

  def deactivate(self, state: State, slots: list[int]) -> State:
    mask_S = np.zeros((self.config.num_slots,), np.bool_)
    mask_S[list(slots)] = True
    device, truncates_S = _split(state)
    return self.retire({**self._deactivate(device, mask_S), TRUNCATES: truncates_S}, slots)

  def retire(self, state: State, slots: list[int]) -> State:
    """``state`` with ``slots`` no longer counted as truncating (``TRUNCATES``): slots whose
    sequences are over (stopped on the device, or deactivated). An inactive slot's draw is
    dropped, so its top-k / top-p need not run; host only, no device work."""
    truncates_S = _split(state)[1]
    truncates_S[list(slots)] = False
    return {**state, TRUNCATES: truncates_S}

  # ---- generate --------------------------------------------------------------------------------

  def kv_bucket(self, max_pos: int) -> int:
    """Smallest kv bucket that holds positions ``0..max_pos`` for the next ``steps_per_call`` steps."""
    need = min(max_pos + self.config.steps_per_call, self.config.max_len)
    return self.kv_buckets[bisect.bisect_left(self.kv_buckets, need)]

  def generate(self, params: dict, state: State, kv_len: int, width: int | None = None,
               pages: np.ndarray | None = None):
    """Advances the active slots among ``[0, width)`` (a width bucket; default all) by
    ``steps_per_call`` tokens; slots from ``width`` on are left untouched. Paged cache: ``pages``
    is the page table (``[num_slots, pages_per_slot]``, ``sampler.pages``); every active slot must
    hold the pages of the positions this call writes.

    Returns ``(state, (tokens_KxW, logprobs_KxW, valid_KxW))``; ``valid`` marks slots that were
    active at that step (their token is real).

    The program: one per kv bucket and width; on GPU (``choice.truncation_on_host``) also per
    whether a slot in ``[0, width)`` truncates (top-k / top-p), which the state's host-side
    ``TRUNCATES`` says, so no step waits for the host to decide it."""
    width = width or self.config.num_slots
    if width not in self.width_buckets:
      raise ValueError(f"width {width} is not one of the width buckets {self.width_buckets}")
    device, truncates_S = _split(state)
    any_truncates = bool(truncates_S[:width].any())
    truncate = self._truncate(any_truncates)
    fn = self._variant(self._generate_fns, (kv_len, width, truncate),
                       lambda: self._make_generate(kv_len, width, truncate=any_truncates),
                       f"generate kv_len={kv_len} width={width}"
                       + ("" if truncate is None else f" truncate={truncate}"))
    pages = (self._table(pages)[:width],) if self.paged else ()
    device, outputs = fn(params, device, *pages)
    return {**device, TRUNCATES: truncates_S}, outputs

  def _truncate(self, any_truncates: bool) -> bool | None:
    """A generate program's ``sampling.sample`` ``truncate``: whether its slots truncate where
    the host decides it (``truncation_on_host``), else None (the step decides)."""
    return any_truncates if self.truncation_on_host else None

  def _make_generate(self, kv_len: int, width: int, formats=None, truncate: bool = False):
    """The generate program of ``kv_len`` and ``width``; ``formats``: the weights' and the
    state's jit shardings (or layouts) if not the held ones (``_compiler_layouts``);
    ``truncate``: the program for slots some of which truncate (top-k / top-p; where the step
    decides it, ``truncation_on_host`` off, one program serves both)."""
    truncate = self._truncate(truncate)
    steps, mesh, impl = self.config.steps_per_call, self.mesh, self.attention_impl
    matmul_impl = self.decode_matmul  # (the kernels' padding for the GPU library: query_rows)
    norms, launch = self.launch.norms, self.launch.paged  # (what the model's trace reads)
    layers = self.layers
    scatter = choice.scatter_cache_writes(self.platform)
    by_mask = self.weights.cfg.vocab_major_logits  # (the held model's logits: choice.py)
    out = self._named((None, "cache_batch"), (steps, width))

    def one_step(extend, state):
      logits_Sx1xV, cache = extend(state["tokens"][:, None], state["pos"], state["cache"], kv_len,
                                   attention_impl=impl, writes_B=state["active"])
      active = state["active"]
      # (an inactive slot draws greedily: its token is dropped, and its parameters, left from its
      # last sequence, do not make the step sort for top-k / top-p)
      token_S, logprob_S = sampling.sample(
          logits_Sx1xV[:, 0], state["key"], state["pos"], state["temperature"], state["top_k"],
          state["top_p"], state["greedy"] | ~active, select_by_mask=by_mask, truncate=truncate)
      hit_stop = jnp.any(token_S[:, None] == state["stop_ids"], axis=-1)
      new_len = state["pos"] + 2  # sequence length including the new token
      state = {**state, "cache": cache,
               "tokens": jnp.where(active, token_S, state["tokens"]),
               "pos": jnp.where(active, state["pos"] + 1, state["pos"]),
               "active": active & ~hit_stop & (new_len < state["end"])}
      return state, (token_S, logprob_S, active)

    def fn(params, full, pages_WxN=None):
      with (sharding.use(mesh), choice.matmuls(matmul_impl), choice.fusing_norms(norms),
            choice.launching(launch)):
        extend = layers.extend(params, pages_WxN, scatter_writes=scatter)
        # the first `width` slots' vectors; the cache stays whole (extend uses its first rows)
        state = {k: v if k == "cache" else v[:width] for k, v in full.items()}
        if steps == 1:
          state, (t, lp, v) = one_step(extend, state)
          outputs = (t[None], lp[None], v[None])
        else:
          state, outputs = jax.lax.scan(lambda st, _: one_step(extend, st), state, None,
                                        length=steps)
        full = {k: v if k == "cache" else full[k].at[:width].set(v) for k, v in state.items()}
        return full, outputs

    held, state = formats or (self.held_formats, self.state_formats)
    in_shardings = (held, state) + ((None,) if self.paged else ())
    options = {**(choice.compiler_options(matmul_impl) or {}),
               **self.launch.compiler_options()} or None
    return jax.jit(fn, in_shardings=in_shardings,
                   out_shardings=(state, (out, out, out)), donate_argnums=1,
                   compiler_options=options)

  # ---- move ------------------------------------------------------------------------------------

  def move(self, state: State, src: list[int], dst: list[int]) -> State:
    """Moves the sequences in slots ``src`` to the free slots ``dst`` (cache rows, position, sampling
    parameters, key, stop ids, active flag); ``src`` slots end inactive. Disjoint lists."""
    if len(src) != len(dst) or set(src) & set(dst):
      raise ValueError(f"move needs disjoint source and destination lists of one length: {src}, {dst}")
    s, k = self.config.num_slots, len(src)
    n = self.insert_rows(k)
    src_N, dst_N = np.full((n,), s, np.int32), np.full((n,), s, np.int32)  # index s = dropped
    src_N[:k], dst_N[:k] = src, dst
    fn = self._variant(self._move_fns, n, self._make_move, f"move rows={n}")
    device, truncates_S = _split(state)
    truncates_S[list(dst)] = truncates_S[list(src)]
    truncates_S[list(src)] = False  # (inactive now)
    return {**fn(device, src_N, dst_N), TRUNCATES: truncates_S}

  def _make_move(self):
    layout, paged = self.cache_layout, self.paged

    def fn(state, src_N, dst_N):
      def moved(x):
        return x.at[dst_N].set(x.at[src_N].get(mode="fill", fill_value=0), mode="drop")

      def cache(x):  # a paged cache stays: the slots' page table rows move on the host
        return x if paged else slot_cache.move(x, src_N, dst_N, layout)

      state = {k: cache(v) if k == "cache" else moved(v) for k, v in state.items()}
      state["active"] = state["active"].at[src_N].set(False, mode="drop")
      return state

    return jax.jit(fn, in_shardings=(self.state_formats, None, None),
                   out_shardings=self.state_formats, donate_argnums=0)


def _split(state: State) -> tuple[State, np.ndarray]:
  """``(the device arrays, a copy of TRUNCATES)`` of a decode state. A state without it (not made
  by ``init_state``) counts every slot as truncating: the sort runs, right for any parameters."""
  device = {k: v for k, v in state.items() if k != TRUNCATES}
  truncates_S = state.get(TRUNCATES)
  if truncates_S is None:
    truncates_S = np.ones(device["active"].shape, np.bool_)
  return device, np.array(truncates_S, np.bool_)
