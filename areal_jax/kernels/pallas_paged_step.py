"""A decode step's attention over the paged cache as one Pallas GPU kernel of our own: it writes
the step's new key and value into their page and attends, for every (row, K/V head) at once.

Why a kernel of our own: JAX's paged kernel (``pallas_attention.paged``) needs its query groups
padded to 16 rows (an XLA fusion before it) and splits each sequence into parts combined after it
(a fusion after it), and the cache's two writes are scatters of their own; at the SmolLM2 shape
on an H100 a layer was 13 kernels, 5 of them these, and the step was bound by its kernel count,
not by memory (``bench/results/h100-2026-11-27-8a1f9a5``). Here they are one kernel:

  * the query heads of a K/V head are read one by one (``G`` rows of ``D``): no padding, since the
    scores are elementwise products summed over ``D`` (no ``tl.dot``, whose rows must be >= 16);
    a decode step's attention should be bound by reading the pages, not by these products. Should
    they cost more than the reads (reductions across a warp's threads on the CUDA cores, 6 query
    heads a K/V head at the Qwen2.5-1.5B shape), ``dot`` pads the heads to a tile of 16 rows in
    registers (no XLA fusion) and computes a page's scores and output as tensor-core dots of the
    cache's dtype (``_tiles``), as JAX's kernel does: where pages and half heads are >= 16;
  * by default no parts: each (row, K/V head) reads its pages ``[0, pos)`` in one program, so
    nothing is combined after it (``B * K`` programs: 192 at the SmolLM2 shape, 256 at the
    Qwen2.5-1.5B one). Over long contexts one program a row would read thousands of positions
    one page after another on one core while most cores idle, so ``parts`` cuts each row's pages
    into that many runs read by programs of their own (``B * K * parts``), each returning its
    softmax's partial output and log-sum-exp, combined after the kernel by one XLA fusion
    (``combine``); the automatic choice (``auto_parts``) keeps one part up to 16 pages of the
    kv bound (every shape ``bench`` times so far), then parts of at most 16 pages, at most 16;
    on an H200 one part was the fastest at both decode shapes ``bench`` times (2 and 4 parts
    13-30% slower with dots: ``bench/results/h200-2026-11-30-2b4ab86``); long rows: not measured on
    a GPU yet;
  * a program's loop reads ``block_pages`` pages a step (1 by default): a block's loads are
    independent of its scores, so Triton's pipelined loop issues them together (a row of up to
    that many pages in one round trip; the PTX of an H100 compile,
    ``bench/results/cpu-aot-h100-2026-11-30-762b89e``); a block's pages past the row's (or the
    part's) last are its first again, every position masked;
  * the new key and value are stored into the pool (aliased in place) and counted into the softmax
    from registers: the program uses no position it writes (its page is read whole, that position
    masked);
  * given the layer's fused projection before rope and the rows' rope tables, it rotates the
    queries and key itself, so the projection's output reaches it as it is (no fusion between the
    matmul and the kernel). Compiled for an H100 (``bench/aot_decode.py``, no GPU): 8 kernels a
    layer against 13 at the SmolLM2 shape (9 with the rotation in XLA).

Exact: softmax attention over positions ``0..pos`` of the row after the write, as the scatter
followed by ``pallas_attention.paged`` computes (the dot form rounds the queries and probabilities
to the cache's dtype before its dots, as that kernel does; in parts, rounding differs in the last
places). Pages are read whole and masked past ``pos``;
rows that write nothing write into the trash page (``sampler/pages.py``), which no read uses.

Runs in Pallas interpret mode on a CPU device (tests); its speed on a GPU is ``bench``'s to say.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_GROUP = 16  # query heads per K/V head read one by one; past it the kernel is not offered
TILE = 16  # rows of the dot form's query tile (the GPU's tensor-core dot takes at least 16)
PART_PAGES = 16  # the automatic choice: one part up to this many pages of the bound, then parts
MAX_PARTS = 16   # of at most this many pages, at most this many parts
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # a score that is never the maximum


def usable(group: int, page: int, head_dim: int) -> bool:
  """Whether the kernel takes ``group`` query heads per K/V head, pages of ``page`` positions and
  heads of ``head_dim`` (Triton's loads: powers of two)."""
  pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
  return 1 <= group <= MAX_GROUP and pow2(page) and pow2(head_dim) and head_dim >= 2


def dot_usable(page: int, head_dim: int) -> bool:
  """Whether the dot form (``dot``) takes pages of ``page`` positions and heads of ``head_dim``:
  its products' sides (a page, half a head for the rope's halves) at least 16."""
  return page >= TILE and head_dim // 2 >= TILE


def auto_parts(max_pages: int) -> int:
  """Parts a row's pages are cut into when the launch leaves it to the kernel (``parts=0``): one
  up to ``PART_PAGES`` pages of the kv bound, then enough for at most ``PART_PAGES`` pages a part,
  at most ``MAX_PARTS``."""
  return 1 if max_pages <= PART_PAGES else min(MAX_PARTS, -(-max_pages // PART_PAGES))


def _kernel(base_ref, pos_ref, write_page_ref, offset_ref, table_ref, qkv_ref, cos_ref, sin_ref,
            k_in_ref, v_in_ref, o_ref, k_out_ref, v_out_ref, lse_ref=None, *, group: int,
            max_pages: int, scale: float, parts: int = 1, dot: bool = False,
            block: int = 1):
  base, pos = base_ref[0], pos_ref[0]
  part = pl.program_id(2) if parts > 1 else 0
  first = part == 0  # the part that writes and counts pos
  page, d = k_in_ref.shape[1:]
  halves = _halves(d)

  def rows(r):
    """Row ``r`` of the projections as its two halves; rotated when the rope is the kernel's,
    and then rounded to the projections' dtype, as the model's rope rounds them."""
    x1, x2 = (qkv_ref[r, h].astype(jnp.float32) for h in halves)
    if cos_ref is None:
      return x1, x2
    cos, sin = cos_ref[...], sin_ref[...]
    return tuple(y.astype(qkv_ref.dtype).astype(jnp.float32)
                 for y in (x1 * cos - x2 * sin, x2 * cos + x1 * sin))

  k_new, v_new = rows(group), qkv_ref[group + 1, :]
  target, offset = base + write_page_ref[0], offset_ref[0]

  def write():
    for h, k_h in zip(halves, k_new):
      k_out_ref[target, offset, h] = k_h.astype(k_out_ref.dtype)
    v_out_ref[target, offset, :] = v_new.astype(v_out_ref.dtype)

  write() if parts == 1 else pl.when(first)(write)

  # the new key and value as the cache holds them, so the result is the write's then the read's
  k_new = [k_h.astype(k_out_ref.dtype).astype(jnp.float32) for k_h in k_new]
  v_new = v_new.astype(v_out_ref.dtype).astype(jnp.float32)
  q = [[q_h * scale for q_h in rows(g)] for g in range(group)]
  form = _tiles if dot else _rows
  init, block_step, unpack = form(q, k_new, v_new, k_in_ref, v_in_ref)
  m, l, acc = init
  if parts > 1:  # the other parts start empty (their first page holds a position before pos)
    m, l, acc = (jax.tree.map(lambda x: jnp.where(first, x, empty), x)
                 for x, empty in ((m, _MASK), (l, 0.0), (acc, 0.0)))

  def read(lo, end, carry):
    """The pages ``[lo, end)`` of the row, ``block`` a step of the loop: a block's pages past
    ``end`` read the block's first page again, every position of it masked."""
    def body(i, carry):
      j0 = lo + i * block
      pages_read = []
      for t in range(block):
        j = j0 + t
        before_P = j * page + lax.broadcasted_iota(jnp.int32, (page,), 0) < pos
        if block > 1:  # a page past the run: the block's first read again, every position masked
          inside = j < end
          j, before_P = jnp.where(inside, j, j0), before_P & inside
        pages_read.append((base + table_ref[j], before_P))
      return block_step(pages_read, carry)
    return unpack(*lax.fori_loop(0, pl.cdiv(end - lo, block), body, carry))

  pages = jnp.minimum(pl.cdiv(pos, page), max_pages)
  if parts == 1:
    m, l, acc = read(0, pages, (m, l, acc))
    for g in range(group):
      o_ref[g, :] = (acc[g] / l[g]).astype(o_ref.dtype)
    return
  # this part's run of the row's pages; runs past the row's last page are empty
  run = pl.cdiv(pages, parts)
  start = jnp.minimum(part * run, pages)
  m, l, acc = read(start, jnp.minimum(start + run, pages), (m, l, acc))
  lse = jnp.full(lse_ref.shape, _MASK, jnp.float32)
  heads = lax.broadcasted_iota(jnp.int32, lse_ref.shape, 0)
  for g in range(group):  # an empty part: output 0, log-sum-exp never the maximum
    some = l[g] > 0
    l_g = jnp.where(some, l[g], 1.0)
    o_ref[g, :] = jnp.where(some, acc[g] / l_g, 0.0)
    lse = jnp.where((heads == g) & some, m[g] + jnp.log(l_g), lse)
  lse_ref[...] = lse


def _total(xs):
  """A block's pages' terms added (a block of one page: that term alone, no addition)."""
  return functools.reduce(operator.add, xs)


def _halves(d: int):
  return pl.ds(0, d // 2), pl.ds(d // 2, d // 2)  # rope's rotated halves


def _rows(q, k_new, v_new, k_in_ref, v_in_ref):
  """The elementwise form: per query head its running maximum, sum and output row, each page's
  scores as products summed over the head's features. Returns ``(m, l, acc)`` from the new
  position alone, the loop's step over a block of pages (``[(page id, mask of the positions
  read)]``: one running maximum over the block, then its pages' sums), and what turns the
  loop's carry into per-head lists (here: itself)."""
  d = k_in_ref.shape[2]
  # the new position first: every running maximum is a real score from the start
  m = [sum(jnp.sum(q_h * k_h) for q_h, k_h in zip(q_g, k_new)) for q_g in q]
  init = m, [jnp.float32(1.0)] * len(q), [v_new] * len(q)

  def block_step(pages_read, carry):
    m, l, acc = carry
    loaded = [([k_in_ref[page_id, :, h].astype(jnp.float32) for h in _halves(d)],
               v_in_ref[page_id, :, :].astype(jnp.float32), before_P)
              for page_id, before_P in pages_read]
    out = ([], [], [])
    for m_g, l_g, acc_g, q_g in zip(m, l, acc, q):
      s = [jnp.where(before_P, sum(jnp.sum(k_h * q_h[None, :], axis=1)
                                   for k_h, q_h in zip(k_PxD, q_g)), _MASK)
           for k_PxD, _, before_P in loaded]
      m_next = functools.reduce(jnp.maximum, [jnp.max(s_P) for s_P in s], m_g)
      p = [jnp.exp(s_P - m_next) for s_P in s]
      correction = jnp.exp(m_g - m_next)
      out[0].append(m_next)
      out[1].append(l_g * correction + _total(jnp.sum(p_P) for p_P in p))
      out[2].append(acc_g * correction + _total(jnp.sum(p_P[:, None] * v_PxD, axis=0)
                                                for p_P, (_, v_PxD, _) in zip(p, loaded)))
    return out

  return init, block_step, lambda m, l, acc: (m, l, acc)


def _tiles(q, k_new, v_new, k_in_ref, v_in_ref):
  """The dot form: the query heads padded to a tile of ``TILE`` rows (in registers), each page's
  scores and output products as tensor-core dots of the cache's dtype accumulating in float32
  (the queries and the probabilities rounded to that dtype first, as JAX's kernel does). Returns
  what ``_rows`` does; its carry is the tiles, unpacked per head at the end."""
  d = k_in_ref.shape[2]
  dt, f32 = k_in_ref.dtype, jnp.float32
  rid = lax.broadcasted_iota(jnp.int32, (TILE, 1), 0)
  # [TILE, D/2] a half: row g query head g's, rows past the heads zeros
  q_T = [sum(jnp.where(rid == g, q_g[i][None, :], 0.0) for g, q_g in enumerate(q)).astype(dt)
         for i in (0, 1)]
  m = sum(jnp.sum(q_h.astype(f32) * k_h[None, :], axis=1) for q_h, k_h in zip(q_T, k_new))
  init = m, jnp.ones((TILE,), f32), jnp.broadcast_to(v_new[None, :], (TILE, d))
  contract_features = (((1,), (1,)), ((), ()))

  def block_step(pages_read, carry):
    m, l, acc = carry
    s = [jnp.where(before_P[None, :],
                   sum(lax.dot_general(q_h, k_in_ref[page_id, :, h], contract_features,
                                       preferred_element_type=f32)
                       for q_h, h in zip(q_T, _halves(d))), _MASK)
         for page_id, before_P in pages_read]
    m_next = functools.reduce(jnp.maximum, [jnp.max(s_TxP, axis=1) for s_TxP in s], m)
    p = [jnp.exp(s_TxP - m_next[:, None]) for s_TxP in s]
    correction = jnp.exp(m - m_next)
    pv_TxD = _total(jnp.dot(p_TxP.astype(dt), v_in_ref[page_id, :, :], preferred_element_type=f32)
                    for p_TxP, (page_id, _) in zip(p, pages_read))
    return (m_next, l * correction + _total(jnp.sum(p_TxP, axis=1) for p_TxP in p),
            acc * correction[:, None] + pv_TxD)

  def unpack(m, l, acc):
    heads = range(len(q))
    pick = lambda x, g: jnp.sum(jnp.where(rid[:, 0] == g, x, 0.0))  # noqa: E731
    return ([pick(m, g) for g in heads], [pick(l, g) for g in heads],
            [jnp.sum(jnp.where(rid == g, acc, 0.0), axis=0) for g in heads])

  return init, block_step, unpack


def combine(out_BxKxRxGxD, lse_BxKxRxG):
  """The output of a softmax over a row's positions from its ``R`` parts' outputs (each over its
  own positions) and log-sum-exps (an empty part's never the largest: part 0 holds ``pos``).
  Written part by part, elementwise (no reduction over the parts), so XLA makes it one fusion."""
  parts = range(lse_BxKxRxG.shape[2])
  lse = [lse_BxKxRxG[:, :, r, :, None] for r in parts]
  top = functools.reduce(jnp.maximum, lse)
  w = [jnp.exp(x - top) for x in lse]
  return sum(w[r] * out_BxKxRxGxD[:, :, r] for r in parts) / sum(w)


# (jitted: a program's layers share one trace of the kernel, rather than one each)
@functools.partial(jax.jit,
                   static_argnames=("bound", "warps", "stages", "interpret", "scale", "parts",
                                    "dot", "block_pages"))
def step(qkv_BxKxSxD, k_pool, v_pool, base, table_BxN, pos_B, write_page_B, offset_B,
         bound: int, warps: int = 4, stages: int = 2, interpret: bool = False,
         scale: float | None = None, rope=None, parts: int = 0, dot: bool = False,
         block_pages: int = 1):
  """Per row and K/V head its ``G = S - 2`` queries, then its new key and value, ``[B, K, S, D]``
  (as a layer's fused projection gives them; queries scaled in the kernel by ``scale``, None:
  ``D ** -0.5``), over pools ``[K, pages, P, D]``: writes row ``b``'s new key and value at page
  ``base + write_page_B[b]``, offset ``offset_B[b]``, and returns ``(out, k_pool, v_pool)``:
  ``out`` ``[B, K, G, D]`` in the projections' dtype, row ``b`` attending to its positions
  ``0..pos_B[b]`` (``pos_B[b]`` the new one; the older ones at pages ``base + table_BxN[b, j]``);
  the pools updated in place (aliased). ``rope``: None when the queries and key come rotated,
  else ``(cos_BxF, sin_BxF)`` (``transformer.rope_tables`` of the rows' positions, ``F = D/2``)
  and the kernel rotates them as ``transformer.rope`` does. ``base``: int32 ``[1]``, the layer's
  first page; ``bound``: the static kv bound (no row reads past it); ``parts``: programs a row's
  pages are read by (0: ``auto_parts``), combined after the kernel when more than one; ``dot``:
  the dot form (``_tiles``) where ``dot_usable``, else the elementwise one (``_rows``);
  ``block_pages``: pages a step of a program's loop reads (at most a part's), their loads
  independent of one another's scores."""
  b, kv, s, d = qkv_BxKxSxD.shape
  n_pages, page = k_pool.shape[1:3]
  max_pages = max(1, min(-(-bound // page), table_BxN.shape[1]))
  parts = min(parts or auto_parts(max_pages), max_pages)
  if parts < 1:
    raise ValueError(f"parts={parts}: expected >= 0 (0: automatic)")
  if block_pages < 1:
    raise ValueError(f"block_pages={block_pages}: expected >= 1")
  kernel = functools.partial(_kernel, group=s - 2, max_pages=max_pages,
                             scale=d ** -0.5 if scale is None else scale, parts=parts,
                             dot=dot and dot_usable(page, d),
                             block=min(block_pages, -(-max_pages // parts)))
  row = lambda i, h, *_: (i,)  # noqa: E731
  rope_spec = None if rope is None else pl.BlockSpec((None, d // 2), lambda i, h, *_: (i, 0))
  pool_spec = pl.BlockSpec((None, n_pages, page, d), lambda i, h, *_: (h, 0, 0, 0))
  cos_BxF, sin_BxF = (None, None) if rope is None else (x.astype(jnp.float32) for x in rope)
  pools = 6 if rope is None else 8  # the pools' place among the inputs
  g = s - 2
  if parts == 1:  # the output itself, in the projections' dtype
    out_specs = [pl.BlockSpec((None, None, g, d), lambda i, h: (i, h, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kv, g, d), qkv_BxKxSxD.dtype)]
  else:  # each part's output and log-sum-exps (float32; heads padded to a power of two)
    heads = 1 << max(g - 1, 0).bit_length()
    out_specs = [pl.BlockSpec((None, None, None, g, d), lambda i, h, r: (i, h, r, 0, 0)),
                 pl.BlockSpec((None, None, None, heads), lambda i, h, r: (i, h, r, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, kv, parts, g, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv, parts, heads), jnp.float32)]
  pools_out = [jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
               jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)]
  results = pl.pallas_call(
      kernel,
      grid=(b, kv) if parts == 1 else (b, kv, parts),
      in_specs=[pl.BlockSpec((1,), lambda i, h, *_: (0,)), pl.BlockSpec((1,), row),
                pl.BlockSpec((1,), row), pl.BlockSpec((1,), row),
                pl.BlockSpec((None, table_BxN.shape[1]), lambda i, h, *_: (i, 0)),
                pl.BlockSpec((None, None, s, d), lambda i, h, *_: (i, h, 0, 0)),
                rope_spec, rope_spec, pool_spec, pool_spec],
      # the pools right after the output (the kernel's refs: o, k, v, then the log-sum-exps)
      out_specs=[out_specs[0], pool_spec, pool_spec, *out_specs[1:]],
      out_shape=[out_shape[0], *pools_out, *out_shape[1:]],
      input_output_aliases={pools: 1, pools + 1: 2},  # (None inputs are not counted)
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret,
      name="paged_decode_step",
  )(base.astype(jnp.int32), pos_B.astype(jnp.int32), write_page_B.astype(jnp.int32),
    offset_B.astype(jnp.int32), table_BxN.astype(jnp.int32), qkv_BxKxSxD, cos_BxF, sin_BxF,
    k_pool, v_pool)
  if parts == 1:
    return results
  out, k_pool, v_pool, lse = results
  return combine(out, lse[..., :g]).astype(qkv_BxKxSxD.dtype), k_pool, v_pool
