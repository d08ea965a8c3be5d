"""Decoder-only transformer (Llama, Qwen2 and Qwen3 dense families) in Flax NNX.

One set of weights, two entry points:
  * ``model(tokens_BxL, positions_BxL, segment_ids_BxL) -> logits_BxLxV``: the full causal forward
    used for training (packed rows: attention stays inside a segment, positions restart per segment).
  * ``model.extend(tokens_BxL, start_B, cache, kv_len) -> (logits_BxLxV, cache)``: writes the keys and
    values of L new tokens at positions ``start_B + [0, L)`` of a KV cache and attends to everything
    before them. Prefill is ``start_B = 0``; one decode step is ``L = 1``; re-prefilling generated
    tokens under new weights is any other start. ``kv_len`` (static) bounds how much of the cache is
    read, so short sequences do not pay for the whole cache; a single-token step (decode) reads only
    the cache chunks each group of rows needs (``decode_attention``).

Every parameter carries logical axis names in its ``axes`` metadata; activations are constrained
with logical names too (see ``areal_jax.sharding``). The model knows nothing of sampling or training.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax import sharding
from areal_jax.models import cpu_attention, cpu_matmul

Cache = list[dict[str, jax.Array]]  # per layer: {"k": [B, T, Hkv, D], "v": [B, T, Hkv, D]}


ARCHS = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture hyper-parameters (names follow the Hugging Face config where they exist)."""

  arch: str = "llama"  # "llama" | "qwen2" | "qwen3"
  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 16
  d_ff: int = 128
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  qkv_bias: bool = False  # True for Qwen2
  qk_norm: bool = False  # True for Qwen3: RMSNorm over head_dim on each query and key head, pre-rope
  tie_embeddings: bool = True
  max_position: int = 4096
  dtype: str = "float32"  # compute dtype; parameters stay float32
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.arch not in ARCHS:
      raise ValueError(f"unknown architecture {self.arch!r}: expected one of {ARCHS}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self) -> int:
    d, f, h, kv, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
    attn = d * h * hd * 2 + d * kv * hd * 2 + (h * hd + 2 * kv * hd if self.qkv_bias else 0)
    per_layer = attn + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0)
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.n_layers * per_layer + embed + d


def _param(rngs: nnx.Rngs, shape, axes, scale: float | None = None) -> nnx.Param:
  scale = (1.0 / shape[0]) ** 0.5 if scale is None else scale
  value = jax.random.normal(rngs.params(), shape, jnp.float32) * scale
  return nnx.Param(value, axes=axes)


def _zeros(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


def _ones(shape, axes) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = _ones((dim,), ("norm",))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def linear(x_NxI, w, transpose_w: bool = False, out_dtype=None):
  """``x @ w`` (``w`` is ``[I, O]``), or ``x @ w.T`` with ``transpose_w`` (``w`` is ``[O, I]``, e.g.
  a tied embedding as the LM head), over the last axis of ``x``, returned as ``out_dtype`` (default:
  ``x``'s). A 3-D ``w`` is a weight the sampler packed for the CPU kernel (``cpu_matmul.pack``,
  which already took ``transpose_w`` into account): inference only. A ``w`` with ``apply_linear``
  is a frozen weight with LoRA adapters (``lora.LoraWeight``, training only): its own forward."""
  apply = getattr(w, "apply_linear", None)
  if apply is not None:
    return apply(x_NxI, out_dtype)
  if w.ndim == 3:
    return cpu_matmul.matmul(x_NxI, w).astype(out_dtype or x_NxI.dtype)
  return _dense(x_NxI, w, transpose_w, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x_NxI, w, transpose_w, out_dtype):
  """``linear`` with a hand-written backward.

  The gradients are autodiff's; what differs is their form. For autodiff's form of the weight
  gradient XLA:CPU transposes the *output* gradient (activation-sized: for the LM head
  tokens x vocabulary) and fuses that transpose into the elementwise work producing it (the SiLU
  gradient, the softmax gradient), which ran several times slower than the matmuls themselves.
  Here the weight gradient is always ``x^T g`` (only the input, d_model or d_ff wide, is
  transposed); for ``transpose_w`` its weight-sized result is transposed afterwards. On the
  learner's step (SmolLM2 shapes, 2 x 768 tokens, CPU) a layer went from 0.35 to 0.20 s."""
  return _dense_fwd(x_NxI, w, transpose_w, out_dtype)[0]


def _dense_fwd(x_NxI, w, transpose_w, out_dtype):
  y = jnp.einsum("...i,oi->...o" if transpose_w else "...i,io->...o", x_NxI, w,
                 preferred_element_type=out_dtype)
  return y, (x_NxI, w)


def _dense_bwd(transpose_w, out_dtype, res, g_NxO):
  x_NxI, w = res
  g_NxO = g_NxO.astype(x_NxI.dtype)
  dx = jnp.einsum("...o,oi->...i" if transpose_w else "...o,io->...i", g_NxO, w)
  dw_IxO = jnp.einsum("...i,...o->io", x_NxI, g_NxO)
  return dx.astype(x_NxI.dtype), (dw_IxO.T if transpose_w else dw_IxO).astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def rope_tables(positions_BxL, head_dim: int, theta: float):
  """``(cos, sin)`` of the rotary angles, each ``[B, L, head_dim // 2]``, computed once per forward
  and shared by every layer.

  XLA fuses elementwise producers into their consumers, so left alone it re-evaluates ``cos`` and
  ``sin`` for every head inside every layer's q and k fusions (4.6 ms of a 64-slot SmolLM2 decode
  step on CPU; 0.5 ms with the tables read instead). An optimization barrier does not stop it (XLA:CPU
  removes barriers before fusion); a product with the identity does: the matmul's output is a
  buffer the layers read. ``Precision.HIGHEST`` keeps it exact on accelerators too."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_BxLxF = positions_BxL[..., None].astype(jnp.float32) * inv_freq
  cs_BxLx2F = jnp.concatenate([jnp.cos(angles_BxLxF), jnp.sin(angles_BxLxF)], axis=-1)
  cs_BxLx2F = jnp.matmul(cs_BxLx2F, jnp.eye(head_dim, dtype=jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
  return cs_BxLx2F[..., : head_dim // 2], cs_BxLx2F[..., head_dim // 2 :]


def rope(x_BxLxHxD, tables):
  """Rotary embedding in the 'rotate half' layout used by Hugging Face Llama and Qwen2;
  ``tables`` from ``rope_tables``."""
  d = x_BxLxHxD.shape[-1]
  cos, sin = (t[:, :, None, :] for t in tables)
  x = x_BxLxHxD.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxD.dtype)


def attention(q_BxLxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxLxT):
  """Grouped-query attention; K/V heads are shared by H // K query heads without copying."""
  b, l, h, d = q_BxLxHxD.shape
  kv = k_BxTxKxD.shape[2]
  q = q_BxLxHxD.reshape(b, l, kv, h // kv, d)
  scores = jnp.einsum("blkgd,btkd->bkglt", q, k_BxTxKxD, preferred_element_type=jnp.float32)
  scores = scores * (d**-0.5)
  scores = jnp.where(mask_BxLxT[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxTxKxD.dtype)
  out = jnp.einsum("bkglt,btkd->blkgd", probs, v_BxTxKxD)
  return out.reshape(b, l, h, d)


CAUSAL_BLOCK = 64  # query positions per block of ``causal_attention``


def causal_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxLxL, block: int | None = None):
  """``attention`` for a causal ``mask`` (query i never sees key j > i), without computing the
  upper triangle: queries are cut into blocks of ``block`` positions and block i attends only to
  keys ``[0, (i + 1) * block)``. That computes about half the scores of the dense form, in pieces
  small enough to stay in the CPU cache (a row of L positions costs (L / block + 1) / 2 query
  blocks' worth of dense work instead of L / block).
  Rows whose mask is all False (padding) get a uniform average over their block's keys, which
  differs from the dense form; their outputs are meaningless either way."""
  l, block = q_BxLxHxD.shape[1], block or CAUSAL_BLOCK
  if l <= block:
    return attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask_BxLxL)
  outs = []
  for start in range(0, l, block):
    end = min(start + block, l)
    outs.append(attention(q_BxLxHxD[:, start:end], k_BxLxKxD[:, :end], v_BxLxKxD[:, :end],
                          mask_BxLxL[:, start:end, :end]))
  return jnp.concatenate(outs, axis=1)


DECODE_CHUNK = 32  # cache positions per step of the decode attention loop
DECODE_GROUP = 16  # rows per group of the decode attention loop (rows sorted by position)


def decode_attention(q_Bx1xHxD, k_BxTxKxD, v_BxTxKxD, pos_B, kv_len: int | None = None,
                     chunk: int = DECODE_CHUNK, group: int = DECODE_GROUP):
  """One query per row (a decode step) attending to cache positions ``0..pos_B[b]``.

  Online softmax over chunks of ``chunk`` positions in a ``fori_loop`` whose trip count is dynamic:
  only the chunks up to the furthest row's position are read (never beyond ``kv_len``), straight
  from the cache buffer. A chunk is small enough to stay in the CPU cache, so the KV cache is read
  from memory once per step, without the copy a static ``cache[:, :kv_len]`` slice costs on XLA:CPU.

  Rows are sorted by position and cut into groups of ``group``, each with its own loop, so short
  rows stop at their own last chunk instead of the batch's furthest one (continuous batching mixes
  new and old sequences: about 3x less attention time on a long-tailed mix). Chosen at run time,
  when it skips at least a quarter of the chunks, and only when the rows are not split over devices
  (a row gather across devices would move the cache).

  On CPU this lowers to a C++ kernel instead when it is available (``cpu_attention``): the same
  result, each row read only up to its own position, several times faster than these loops.
  """
  b, _, h, d = q_Bx1xHxD.shape
  kv = k_BxTxKxD.shape[2]  # the cache may have more rows than b: rows [0, b) are read
  t = k_BxTxKxD.shape[1] if kv_len is None else min(kv_len, k_BxTxKxD.shape[1])
  q_BxKxGxD = q_Bx1xHxD.reshape(b, kv, h // kv, d).astype(jnp.float32) * (d**-0.5)
  xla = functools.partial(_decode_xla, k_BxTxKxD=k_BxTxKxD, v_BxTxKxD=v_BxTxKxD, pos_B=pos_B, t=t,
                          chunk=chunk, group=group)
  if cpu_attention.usable(q_BxKxGxD, k_BxTxKxD):
    cpu = lambda q: cpu_attention.decode_attention(q, k_BxTxKxD, v_BxTxKxD, pos_B, t)
    out_BxKxGxD = jax.lax.platform_dependent(q_BxKxGxD, cpu=cpu, default=xla)
  else:
    out_BxKxGxD = xla(q_BxKxGxD)
  return out_BxKxGxD.reshape(b, 1, h, d).astype(v_BxTxKxD.dtype)


def _decode_xla(q_BxKxGxD, k_BxTxKxD, v_BxTxKxD, pos_B, t: int, chunk: int, group: int):
  """``decode_attention`` in XLA ops (queries pre-scaled): chunked rows, grouped by position."""
  b = q_BxKxGxD.shape[0]
  c = min(chunk, t)
  attend = functools.partial(_decode_rows, k_BxTxKxD=k_BxTxKxD, v_BxTxKxD=v_BxTxKxD, t=t, c=c)
  if b <= group or sharding.num_shards("cache_batch", b) > 1:
    return attend(q_BxKxGxD, None, pos_B)
  order_B = jnp.argsort(pos_B)

  def grouped(q_BxKxGxD):
    outs = [attend(q_BxKxGxD[rows_N], rows_N, pos_B[rows_N])
            for rows_N in (order_B[i:i + group] for i in range(0, b, group))]
    return jnp.zeros_like(q_BxKxGxD).at[order_B].set(jnp.concatenate(outs))

  # groups pay off when they skip at least a quarter of the chunks (not when all rows are alike)
  chunks_GxN = jnp.pad((jnp.minimum(pos_B[order_B], t - 1) + c) // c, (0, -b % group))
  chunks_GxN = chunks_GxN.reshape(-1, group)  # per group of sorted rows (padded with zeros)
  need, flat = jnp.sum(jnp.max(chunks_GxN, axis=1)), chunks_GxN.shape[0] * jnp.max(chunks_GxN)
  return jax.lax.cond(4 * need <= 3 * flat, grouped,
                      lambda q_BxKxGxD: attend(q_BxKxGxD, None, pos_B), q_BxKxGxD)


def _decode_rows(q_NxKxGxD, rows_N, pos_N, k_BxTxKxD, v_BxTxKxD, t: int, c: int):
  """``decode_attention`` of cache rows ``rows_N`` (None: rows ``[0, N)``), queries pre-scaled."""
  n, kv, g, d = q_NxKxGxD.shape
  n_chunks = (jnp.minimum(jnp.max(pos_N), t - 1) + c) // c

  def read(cache, begin):
    if rows_N is None:
      return jax.lax.dynamic_slice(cache, (0, begin, 0, 0), (n, c, kv, d)).astype(jnp.float32)
    return cache[rows_N[:, None], begin + jnp.arange(c)[None, :]].astype(jnp.float32)

  def body(i, carry):
    m_NxKxG, l_NxKxG, acc_NxKxGxD = carry
    # when c does not divide t the last chunk overlaps its predecessor: positions < i * c are masked
    begin = jnp.minimum(i * c, t - c)
    k_NxCxKxD, v_NxCxKxD = read(k_BxTxKxD, begin), read(v_BxTxKxD, begin)
    positions_C = begin + jnp.arange(c)
    valid_NxC = (positions_C[None] <= pos_N[:, None]) & (positions_C[None] >= i * c)
    s_NxKxGxC = jnp.einsum("nkgd,nckd->nkgc", q_NxKxGxD, k_NxCxKxD)
    s_NxKxGxC = jnp.where(valid_NxC[:, None, None], s_NxKxGxC, -jnp.inf)
    m_new = jnp.maximum(m_NxKxG, jnp.max(s_NxKxGxC, axis=-1))  # finite: position 0 is in chunk 0
    alpha = jnp.exp(m_NxKxG - m_new)
    p_NxKxGxC = jnp.exp(s_NxKxGxC - m_new[..., None])
    l_NxKxG = l_NxKxG * alpha + jnp.sum(p_NxKxGxC, axis=-1)
    pv = jnp.einsum("nkgc,nckd->nkgd", p_NxKxGxC, v_NxCxKxD)
    return m_new, l_NxKxG, acc_NxKxGxD * alpha[..., None] + pv

  init = (jnp.full((n, kv, g), -jnp.inf, jnp.float32), jnp.zeros((n, kv, g), jnp.float32),
          jnp.zeros((n, kv, g, d), jnp.float32))
  _, l_NxKxG, acc_NxKxGxD = jax.lax.fori_loop(0, n_chunks, body, init)
  return acc_NxKxGxD / l_NxKxG[..., None]


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.q = _param(rngs, (d, h * hd), ("embed", "heads"))
    self.k = _param(rngs, (d, kv * hd), ("embed", "kv_heads"))
    self.v = _param(rngs, (d, kv * hd), ("embed", "kv_heads"))
    self.o = _param(rngs, (h * hd, d), ("heads", "embed"))
    if cfg.qkv_bias:
      self.q_bias = _zeros((h * hd,), ("heads",))
      self.k_bias = _zeros((kv * hd,), ("kv_heads",))
      self.v_bias = _zeros((kv * hd,), ("kv_heads",))
    if cfg.qk_norm:  # Qwen3: one scale over head_dim, shared by all query (key) heads
      self.q_norm = RMSNorm(hd, cfg.norm_eps)
      self.k_norm = RMSNorm(hd, cfg.norm_eps)

  def project_qkv(self, x_BxLxE, rope_BxLxF):
    cfg, dt = self.cfg, self.cfg.compute_dtype
    b, l, _ = x_BxLxE.shape

    def proj(name, heads):
      y = linear(x_BxLxE, getattr(self, name)[...].astype(dt))
      if cfg.qkv_bias:
        y = y + getattr(self, name + "_bias")[...].astype(dt)
      return y.reshape(b, l, heads, cfg.head_dim)

    q, k = proj("q", cfg.n_heads), proj("k", cfg.n_kv_heads)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, rope_BxLxF), rope(k, rope_BxLxF)
    v = proj("v", cfg.n_kv_heads)
    q = sharding.constrain(q, ("batch", "length", "act_heads", None))
    return q, k, v

  def output(self, out_BxLxHxD):
    b, l = out_BxLxHxD.shape[:2]
    return linear(out_BxLxHxD.reshape(b, l, -1), self.o[...].astype(self.cfg.compute_dtype))


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.dtype = cfg.compute_dtype
    self.gate = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
    self.up = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
    self.down = _param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"))

  def __call__(self, x):
    dt = self.dtype
    h = jax.nn.silu(linear(x, self.gate[...].astype(dt))) * linear(x, self.up[...].astype(dt))
    h = sharding.constrain(h, ("batch", "length", "act_mlp"))
    return linear(h, self.down[...].astype(dt))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BxLxE, rope_BxLxF, attend):
    """``attend(q, k, v) -> out_BxLxHxD`` decides what the queries attend to (and may cache k, v);
    ``rope_BxLxF`` are the ``rope_tables`` of the tokens' positions."""
    q, k, v = self.attn.project_qkv(self.attn_norm(x_BxLxE), rope_BxLxF)
    x = x_BxLxE + self.attn.output(attend(q, k, v))
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    x = x + self.mlp(self.mlp_norm(x))
    return sharding.constrain(x, ("batch", "length", "act_embed"))


class Transformer(nnx.Module):
  """Llama / Qwen2 / Qwen3 decoder. ``model(tokens_BxL) -> logits_BxLxV``."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), scale=0.02)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

  def _embed(self, tokens_BxL):
    embed = self.embed[...]
    if embed.ndim == 3:  # packed as the LM head's weight (see ``linear``)
      x = cpu_matmul.take_rows(embed, tokens_BxL).astype(self.cfg.compute_dtype)
    else:
      x = jnp.take(embed, tokens_BxL, axis=0).astype(self.cfg.compute_dtype)
    return sharding.constrain(x, ("batch", "length", "act_embed"))

  def _logits(self, x_BxLxE):
    x = self.final_norm(x_BxLxE)
    if self.cfg.tie_embeddings:  # the embedding [V, E] is the head's weight, transposed
      logits = linear(x, self.embed[...].astype(self.cfg.compute_dtype), transpose_w=True,
                      out_dtype=jnp.float32)
    else:
      logits = linear(x, self.lm_head[...].astype(self.cfg.compute_dtype), out_dtype=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "act_vocab"))

  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None):
    b, l = tokens_BxL.shape
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    causal_LxL = jnp.tril(jnp.ones((l, l), jnp.bool_))
    mask_BxLxL = jnp.broadcast_to(causal_LxL, (b, l, l))
    if segment_ids_BxL is not None:
      same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
      mask_BxLxL = mask_BxLxL & same & (segment_ids_BxL[:, None, :] > 0)
    x = self._embed(tokens_BxL)
    rope_BxLxF = rope_tables(positions_BxL, self.cfg.head_dim, self.cfg.rope_theta)
    for block in self.layers:
      x = block(x, rope_BxLxF, lambda q, k, v: causal_attention(q, k, v, mask_BxLxL))
    return self._logits(x)

  def extend(self, tokens_BxL, start_B, cache: Cache, kv_len: int | None = None):
    """Append L tokens per row at ``start_B`` to ``cache``; returns logits and the updated cache.

    The cache may have more rows than ``tokens_BxL``: row b of the tokens uses cache row b and rows
    from B on are left as they are (a decode step over the first B slots of a bigger cache)."""
    b, l = tokens_BxL.shape
    rows = cache[0]["k"].shape[0]
    positions_BxL = start_B[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
    t = cache[0]["k"].shape[1] if kv_len is None else kv_len
    mask_BxLxT = jnp.arange(t)[None, None, :] <= positions_BxL[:, :, None]
    x = self._embed(tokens_BxL)
    rope_BxLxF = rope_tables(positions_BxL, self.cfg.head_dim, self.cfg.rope_theta)
    new_cache = []
    for block, layer_cache in zip(self.layers, cache):
      updated = {}

      def attend(q, k, v, layer_cache=layer_cache, updated=updated):
        for name, new in (("k", k), ("v", v)):
          new = new.astype(layer_cache[name].dtype)
          if rows == b:
            full = _write_rows(layer_cache[name], new, start_B)
          else:  # scatter into rows [0, b), in place
            full = layer_cache[name].at[jnp.arange(b)[:, None], positions_BxL].set(new)
          updated[name] = sharding.constrain(full, ("cache_batch", None, "cache_heads", None))
        if l == 1:  # decode: a dynamic loop over the needed cache chunks (no copy of the cache)
          return decode_attention(q, updated["k"], updated["v"], start_B, t)
        return attention(q, updated["k"][:b, :t], updated["v"][:b, :t], mask_BxLxT)

      x = block(x, rope_BxLxF, attend)
      new_cache.append(updated)
    return self._logits(x), new_cache


def _write_rows(cache_BxTxKxD, new_BxLxKxD, start_B):
  write = lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0))
  return jax.vmap(write)(cache_BxTxKxD, new_BxLxKxD, start_B)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> Cache:
  """An empty KV cache of ``batch`` rows and ``max_len`` positions."""
  shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.compute_dtype
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layers)]
