"""Decoder-only transformer (Llama, Qwen2 and Qwen3 dense families) in Flax NNX.

One set of weights, two entry points:
  * ``model(tokens_BxL, positions_BxL, segment_ids_BxL) -> logits_BxLxV``: the full causal forward
    used for training (packed rows: attention stays inside a segment, positions restart per segment).
  * ``model.extend(tokens_BxL, start_B, cache, kv_len) -> (logits_BxLxV, cache)``: writes the keys and
    values of L new tokens at positions ``start_B + [0, L)`` of a KV cache and attends to everything
    before them. Prefill is ``start_B = 0``; one decode step is ``L = 1``; re-prefilling generated
    tokens under new weights is any other start. ``kv_len`` (static) bounds how much of the cache is
    read, so short sequences do not pay for the whole cache; a single-token step (decode) runs the
    decode attention the kernels package picks for the platform (``decode_attention``).

The attention forms and RoPE the layers call are in ``attention_forms`` (re-exported here).

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
from areal_jax.kernels import choice, cpu_matmul, pallas_norm_matmul
# the attention forms and RoPE, part of the model's API as before (``attention_forms``)
from areal_jax.models.attention_forms import (  # noqa: F401
    CAUSAL_BLOCK, CAUSAL_BLOCKS, DECODE_CHUNK, DECODE_GROUP, attention, causal_attention,
    decode_attention, decode_step_paged, decode_step_rotating, packed_mask,
    prefill_kernel_attention, rope, rope_tables, row_attention)

Cache = list[dict[str, jax.Array]]  # per layer: {"k": [B, T, Hkv, D], "v": [B, T, Hkv, D]}
CACHE_AXES = ("cache_batch", None, "cache_heads", None)  # logical axes of a layer's cache
CACHE_AXES_HEADS_MAJOR = ("cache_batch", "cache_heads", None, None)  # ... held heads-major


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
  # q, k, v as one weight ``qkv`` and gate, up as one ``gate_up`` (``fuse_projections``' layout):
  # fewer, larger matmuls; the sampler's choice for its own copy of the weights
  fused_projections: bool = False
  # the LM head as head weight x activations, so the logits' vocabulary axis comes out major (the
  # same values): what a TPU's reductions over the vocabulary read without relaying the logits
  # out first (``kernels.choice.vocab_major_logits``); the sampler's choice for its own copy
  vocab_major_logits: bool = False
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


def rms_norm(x, scale, eps: float):
  """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, in float32, returned in ``x``'s
  dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = _ones((dim,), ("norm",))
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


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


def _norm_matmul(norm: RMSNorm | None, x_BxLxE, w, bias=None, glu: bool = False):
  """``norm(x) @ w`` (+ ``bias``; ``glu``: ``silu(gate) * up`` of ``w``'s interleaved gate/up
  columns) as one kernel, inside a decode program that fuses them (``choice.fused_norms``), or
  None where it does not (no norm, a packed or LoRA weight, a shape the kernel does not take)."""
  tuning = choice.fused_norms()
  if tuning is None or norm is None or not isinstance(w, jax.Array) or w.ndim != 2:
    return None
  b, l, e = x_BxLxE.shape
  out = w.shape[1] // 2 if glu else w.shape[1]
  if not pallas_norm_matmul.usable(e, out):
    return None
  y = pallas_norm_matmul.norm_matmul(x_BxLxE.reshape(b * l, e), norm.scale[...], w, bias,
                                     eps=norm.eps, glu=glu, tuning=tuning,
                                     interpret=choice.interpret())
  return y.reshape(b, l, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x_NxI, w, transpose_w, out_dtype):
  """``linear`` with a hand-written backward.

  The gradients are autodiff's; what differs is their form. For autodiff's form of the weight
  gradient XLA:CPU transposes the *output* gradient (activation-sized: for the LM head
  tokens x vocabulary) and fuses that transpose into the elementwise work producing it (the SiLU
  gradient, the softmax gradient), which ran several times slower than the matmuls themselves.
  Here the weight gradient is always ``x^T g`` (only the input, d_model or d_ff wide, is
  transposed); for ``transpose_w`` its weight-sized result is transposed afterwards (a learner's
  step at SmolLM2 shapes on CPU, 2 x 768 tokens: 0.20 s a layer against 0.35 s in autodiff's
  form)."""
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


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.cfg = cfg
    if cfg.fused_projections:  # per KV head its query heads, key, value (``fuse_projections``)
      self.qkv = _param(rngs, (d, (h + 2 * kv) * hd), ("embed", "kv_heads"))
      if cfg.qkv_bias:
        self.qkv_bias = _zeros(((h + 2 * kv) * hd,), ("kv_heads",))
    else:
      self.q = _param(rngs, (d, h * hd), ("embed", "heads"))
      self.k = _param(rngs, (d, kv * hd), ("embed", "kv_heads"))
      self.v = _param(rngs, (d, kv * hd), ("embed", "kv_heads"))
      if cfg.qkv_bias:
        self.q_bias = _zeros((h * hd,), ("heads",))
        self.k_bias = _zeros((kv * hd,), ("kv_heads",))
        self.v_bias = _zeros((kv * hd,), ("kv_heads",))
    self.o = _param(rngs, (h * hd, d), ("heads", "embed"))
    if cfg.qk_norm:  # Qwen3: one scale over head_dim, shared by all query (key) heads
      self.q_norm = RMSNorm(hd, cfg.norm_eps)
      self.k_norm = RMSNorm(hd, cfg.norm_eps)

  def hands_raw_qkv(self) -> bool:
    """Whether ``fused_qkv`` is all the queries, keys and values need besides rope: fused
    projections and no query/key norm."""
    return self.cfg.fused_projections and not self.cfg.qk_norm

  def fused_qkv(self, x_BxLxE, norm: RMSNorm | None = None):
    """The fused projection's output (bias added, before rope) ``[B, L, K, G + 2, D]``: per K/V
    head its ``G`` query heads, its key, its value; of ``norm(x)`` when a norm is given."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    b, l, _ = x_BxLxE.shape
    w = self.qkv[...].astype(dt)
    bias = self.qkv_bias[...].astype(dt) if cfg.qkv_bias else None
    y = _norm_matmul(norm, x_BxLxE, w, bias)
    if y is None:
      y = linear(x_BxLxE if norm is None else norm(x_BxLxE), w)
      y = y if bias is None else y + bias
    return y.reshape(b, l, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads + 2, cfg.head_dim)

  def project_qkv(self, x_BxLxE, rope_BxLxF, norm: RMSNorm | None = None):
    """Queries, keys and values, rotated, of ``x`` (of ``norm(x)`` when a norm is given)."""
    cfg, dt = self.cfg, self.cfg.compute_dtype
    b, l, _ = x_BxLxE.shape
    if norm is not None and not cfg.fused_projections:
      x_BxLxE, norm = norm(x_BxLxE), None

    def proj(name, heads):
      y = linear(x_BxLxE, getattr(self, name)[...].astype(dt))
      if cfg.qkv_bias:
        y = y + getattr(self, name + "_bias")[...].astype(dt)
      return y.reshape(b, l, heads, cfg.head_dim)

    if cfg.fused_projections:  # one matmul; [.., kv, g + 2, D]: g query heads, key, value
      g = cfg.n_heads // cfg.n_kv_heads
      qkv = self.fused_qkv(x_BxLxE, norm)
      q = qkv[:, :, :, :g].reshape(b, l, cfg.n_heads, cfg.head_dim)
      k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    else:
      q, k, v = proj("q", cfg.n_heads), proj("k", cfg.n_kv_heads), proj("v", cfg.n_kv_heads)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, rope_BxLxF), rope(k, rope_BxLxF)
    q = sharding.constrain(q, ("batch", "length", "act_heads", None))
    return q, k, v

  def output(self, out_BxLxHxD):
    b, l = out_BxLxHxD.shape[:2]
    return linear(out_BxLxHxD.reshape(b, l, -1), self.o[...].astype(self.cfg.compute_dtype))


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.dtype, self.fused = cfg.compute_dtype, cfg.fused_projections
    if self.fused:  # gate and up interleaved per hidden unit (``fuse_projections``)
      self.gate_up = _param(rngs, (cfg.d_model, 2 * cfg.d_ff), ("embed", "mlp"))
    else:
      self.gate = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
      self.up = _param(rngs, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
    self.down = _param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"))

  def __call__(self, x, norm: RMSNorm | None = None):
    """The MLP of ``x`` (of ``norm(x)`` when a norm is given)."""
    dt = self.dtype
    h = _norm_matmul(norm, x, self.gate_up[...].astype(dt), glu=True) if self.fused else None
    if h is None:
      x = x if norm is None else norm(x)
      if self.fused:
        gate_up = linear(x, self.gate_up[...].astype(dt))
        gate_up = gate_up.reshape(gate_up.shape[:-1] + (gate_up.shape[-1] // 2, 2))
        gate, up = gate_up[..., 0], gate_up[..., 1]
      else:
        gate, up = linear(x, self.gate[...].astype(dt)), linear(x, self.up[...].astype(dt))
      h = jax.nn.silu(gate) * up
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
    ``rope_BxLxF`` are the ``rope_tables`` of the tokens' positions. An ``attend`` with a
    ``rotates(qkv, rope_BxLxF)`` attribute (a kernel that applies rope itself) gets the fused
    projection before rope instead (``Attention.fused_qkv``), where the model can hand it over
    (``Attention.hands_raw_qkv``)."""
    rotates = getattr(attend, "rotates", None)
    if rotates is not None and self.attn.hands_raw_qkv():
      out = rotates(self.attn.fused_qkv(x_BxLxE, self.attn_norm), rope_BxLxF)
    else:
      out = attend(*self.attn.project_qkv(x_BxLxE, rope_BxLxF, self.attn_norm))
    x = x_BxLxE + self.attn.output(out)
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    x = x + self.mlp(x, self.mlp_norm)
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
    dt = self.cfg.compute_dtype
    tied = self.cfg.tie_embeddings  # the embedding [V, E] is the head's weight, transposed
    w = self.embed[...] if tied else self.lm_head[...]
    if self.cfg.vocab_major_logits and w.ndim == 2 and not hasattr(w, "apply_linear"):
      # [V, B, L] from the head's product with the activations, then viewed as [B, L, V]
      logits = jnp.moveaxis(jnp.einsum("ve,...e->v..." if tied else "ev,...e->v...",
                                       w.astype(dt), x, preferred_element_type=jnp.float32), 0, -1)
    else:
      logits = linear(x, w.astype(dt), transpose_w=tied, out_dtype=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "act_vocab"))

  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None,
               attention: str = "auto"):
    """Logits ``[B, L, V]`` of packed rows (``segment_ids_BxL``: a segment per sequence, 0 for
    padding; positions restart per segment). ``attention``: ``kernels.choice.CAUSAL`` or
    ``"auto"`` (``row_attention``)."""
    b, l = tokens_BxL.shape
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    attend_with, seen = row_attention(segment_ids_BxL, b, l, self.cfg.head_dim, attention)
    x = self._embed(tokens_BxL)
    rope_BxLxF = rope_tables(positions_BxL, self.cfg.head_dim, self.cfg.rope_theta)
    for block in self.layers:
      x = block(x, rope_BxLxF, attend_with(seen))
    return self._logits(x)

  def extend(self, tokens_BxL, start_B, cache: Cache, kv_len: int | None = None,
             attention_impl: str | None = None, heads_major: bool = False,
             scatter_writes: bool = False, prefill_attention: str | None = None):
    """Append L tokens per row at ``start_B`` to ``cache``; returns logits and the updated cache.

    The cache may have more rows than ``tokens_BxL``: row b of the tokens uses cache row b and rows
    from B on are left as they are (a decode step over the first B slots of a bigger cache).
    ``attention_impl``: the decode attention a single-token step runs (``decode_attention``).
    ``heads_major``: each layer's cache is ``[rows, kv_heads, T, D]`` (``init_cache``'s
    ``heads_major``) instead of ``[rows, T, kv_heads, D]``.
    ``scatter_writes``: the new keys and values go into each layer's cache by one scatter even when
    the call covers every row (else there a per-row update, one ``dynamic_update_slice`` per row,
    which a TPU compiles into a loop over the rows).
    ``prefill_attention``: the call is a prefill (every row from position 0, ``kv_len`` equal to
    L): its attention runs over the new keys and values as that causal kernel
    (``kernels.choice.CAUSAL``) instead of a masked read of the cache (None or ``"dense"``)."""
    b, l = tokens_BxL.shape
    rows = cache[0]["k"].shape[0]
    t_axis = 2 if heads_major else 1
    positions_BxL = start_B[:, None] + jnp.arange(l, dtype=jnp.int32)[None, :]
    t = cache[0]["k"].shape[t_axis] if kv_len is None else kv_len
    mask_BxLxT = jnp.arange(t)[None, None, :] <= positions_BxL[:, :, None]
    axes = CACHE_AXES_HEADS_MAJOR if heads_major else CACHE_AXES
    x = self._embed(tokens_BxL)
    rope_BxLxF = rope_tables(positions_BxL, self.cfg.head_dim, self.cfg.rope_theta)
    new_cache = []
    for block, layer_cache in zip(self.layers, cache):
      updated = {}

      def attend(q, k, v, layer_cache=layer_cache, updated=updated):
        for name, new in (("k", k), ("v", v)):
          new = new.astype(layer_cache[name].dtype)
          if rows == b and not scatter_writes:
            full = _write_rows(layer_cache[name], new, start_B, heads_major)
          elif heads_major:  # scatter into rows [0, b), in place ([B, L] lead the value; each
            # (row, position) once: said, XLA:GPU stores where it would compare-and-swap)
            full = layer_cache[name].at[jnp.arange(b)[:, None], :, positions_BxL].set(
                new, unique_indices=True)
          else:
            full = layer_cache[name].at[jnp.arange(b)[:, None], positions_BxL].set(
                new, unique_indices=True)
          updated[name] = sharding.constrain(full, axes)
        if l == 1:  # decode: the kernels' choice how to read the cache
          return decode_attention(q, updated["k"], updated["v"], start_B, t,
                                  impl=attention_impl, heads_major=heads_major)
        if prefill_attention not in (None, "dense"):
          return prefill_kernel_attention(q, k, v, updated["k"].dtype, prefill_attention)
        k_all, v_all = updated["k"][:b], updated["v"][:b]
        if heads_major:  # the prompt attention's [B, T, K, D]
          k_all, v_all = jnp.swapaxes(k_all, 1, 2), jnp.swapaxes(v_all, 1, 2)
        return attention(q, k_all[:, :t], v_all[:, :t], mask_BxLxT)

      x = block(x, rope_BxLxF, attend)
      new_cache.append(updated)
    return self._logits(x), new_cache


def _write_rows(cache_BxTxKxD, new_BxLxKxD, start_B, heads_major: bool = False):
  if heads_major:  # the cache [B, K, T, D]
    write = lambda c, n, s: jax.lax.dynamic_update_slice(c, jnp.swapaxes(n, 0, 1), (0, s, 0))
  else:
    write = lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0))
  return jax.vmap(write)(cache_BxTxKxD, new_BxLxKxD, start_B)


def fuse_projections(params: dict, cfg: ModelConfig) -> dict:
  """A pure parameter dict of ``cfg``'s model in the layout of the same model with
  ``fused_projections``: per layer, q, k and v (and their biases) become one ``qkv`` whose output
  is grouped per KV head (that head's query heads, then its key, then its value), gate and up one
  ``gate_up`` interleaved per hidden unit. Each group (hidden unit) is contiguous, so splitting the
  fused output axis over the mesh's tensor axis keeps whole KV heads (hidden units) on a device,
  as the separate weights' "kv_heads" ("mlp") sharding does; the model then splits a fused output
  without moving data between devices."""
  kv, g, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim

  def grouped(q, k, v):  # [..., h * hd], [..., kv * hd] x 2 -> [..., kv * (g + 2) * hd]
    lead = q.shape[:-1]
    parts = (q.reshape(lead + (kv, g, hd)), k.reshape(lead + (kv, 1, hd)),
             v.reshape(lead + (kv, 1, hd)))
    return jnp.concatenate(parts, axis=-2).reshape(lead + (-1,))

  def layer(p):
    attn = {n: w for n, w in p["attn"].items() if n not in ("q", "k", "v", "q_bias", "k_bias",
                                                             "v_bias")}
    attn["qkv"] = grouped(*(p["attn"][n] for n in "qkv"))
    if "q_bias" in p["attn"]:
      attn["qkv_bias"] = grouped(*(p["attn"][n + "_bias"] for n in "qkv"))
    mlp = {"gate_up": jnp.stack([p["mlp"]["gate"], p["mlp"]["up"]], -1).reshape(
        p["mlp"]["gate"].shape[:-1] + (-1,)), "down": p["mlp"]["down"]}
    return {**p, "attn": attn, "mlp": mlp}

  layers = params["layers"]
  layers = ({i: layer(p) for i, p in layers.items()} if isinstance(layers, dict)
            else [layer(p) for p in layers])
  return {**params, "layers": layers}


def cast_weights(params, dtype):
  """A pure parameter dict with its matmul weights and embedding (every leaf of two or more
  dimensions) and biases in ``dtype`` (the compute dtype: the model casts a bias to it before
  adding it, so holding it cast changes nothing but a conversion kernel per layer and step on a
  GPU); norm scales (applied in float32) stay as they are."""
  dtype = jnp.dtype(dtype)

  def cast(path, x):
    last = path[-1] if path else None
    bias = str(getattr(last, "key", getattr(last, "name", ""))).endswith("bias")
    return x.astype(dtype) if x.ndim >= 2 or bias else x
  return jax.tree_util.tree_map_with_path(cast, params)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None,
               heads_major: bool = False) -> Cache:
  """An empty KV cache of ``batch`` rows and ``max_len`` positions: per layer ``{"k", "v"}`` of
  ``[batch, max_len, kv_heads, head_dim]`` (``heads_major``: ``[batch, kv_heads, max_len,
  head_dim]``, what a GPU's decode attention reads without a transposed copy)."""
  shape = ((batch, cfg.n_kv_heads, max_len, cfg.head_dim) if heads_major
           else (batch, max_len, cfg.n_kv_heads, cfg.head_dim))
  dtype = dtype or cfg.compute_dtype
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layers)]
