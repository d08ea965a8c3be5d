"""Our Pallas GPU kernel for a paged decode step (interpret mode on CPU): it writes each row's new
key and value where the page table says and attends over positions ``0..pos`` as NumPy does after
the write, through ``paged_attention.decode_step_paged`` as the engine calls it, split over a
mesh's K/V heads too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax import sharding
from areal_jax.kernels import choice, paged_attention, pallas_attention, pallas_paged_step

# K/V heads, layers, pages a layer (the trash page last), page size, head size, pages a row
K, L, M, P, D, N = 2, 2, 26, 8, 16, 4


def _case(rng, b, g, pos, dtype, P=P, D=D):  # noqa: N803  (the module's shape by default)
  pools = [rng.normal(size=(K, L, M, P, D)).astype(np.float32) for _ in range(2)]
  pools = [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in pools]  # as held
  q = rng.normal(size=(b, K, g, D)).astype(np.float32)
  k_new, v_new = (rng.normal(size=(b, K, D)).astype(np.float32) for _ in range(2))
  table = rng.permutation(M - 1)[:b * N].reshape(b, N).astype(np.int32)  # each row its pages
  pos = np.asarray(pos, np.int32)
  return q, k_new, v_new, pools, table, pos


def _reference(q, k_new, v_new, pools, layer, table, page, offset, pos, dtype):
  P, D = pools[0].shape[-2:]  # noqa: N806
  k_pool, v_pool = (x.copy() for x in pools)
  for b in range(len(pos)):
    k_pool[:, layer, page[b], offset[b]] = np.asarray(jnp.asarray(k_new[b], dtype), np.float32)
    v_pool[:, layer, page[b], offset[b]] = np.asarray(jnp.asarray(v_new[b], dtype), np.float32)
  out = np.zeros_like(q)
  for b in range(len(pos)):
    k_, v_ = (x[:, layer, table[b]].reshape(K, N * P, D)[:, :pos[b] + 1] for x in (k_pool, v_pool))
    s = np.einsum("kgd,ktd->kgt", q[b], k_) * D ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), v_)
  return out, k_pool, v_pool


@pytest.mark.parametrize("g,dtype,layer,parts,block", [
    (3, jnp.float32, 1, 0, 1), (1, jnp.float32, 0, 0, 1), (4, jnp.bfloat16, 1, 0, 1),
    (3, jnp.float32, 1, 2, 1), (3, jnp.float32, 0, 3, 1), (4, jnp.bfloat16, 1, 4, 1),
    (3, jnp.float32, 1, 0, 3), (2, jnp.float32, 0, 0, 4), (3, jnp.float32, 1, 2, 2)])
@pytest.mark.slow
def test_the_step_writes_then_attends_as_numpy_does(g, dtype, layer, parts, block):
  """Positions 0 (the new one alone), inside a page, at a page's start and end, the last page; the
  last row writes nothing (its key and value go to the trash page, which no read uses). Read in
  one program a row, or cut into ``parts`` (rows of fewer pages than parts leave parts empty);
  ``block`` pages a step of the loop (a row's last block part past its pages: 4 pages in blocks
  of 3, 1-3 pages in a block of 4, runs of 2 pages in blocks of 2)."""
  rng = np.random.default_rng(g)
  q, k_new, v_new, pools, table, pos = _case(rng, 6, g, [0, 5, 8, 15, 31, 20], dtype)
  page = table[np.arange(6), pos // P]
  page[-1] = M - 1  # the trash page
  offset = pos % P
  tuning = pallas_attention.PagedTuning(writes=True, warps=2, parts=parts, block_pages=block)
  out, k_pool, v_pool = paged_attention.decode_step_paged(
      jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(pools[0], dtype),
      jnp.asarray(pools[1], dtype), layer, jnp.asarray(table), jnp.asarray(page),
      jnp.asarray(offset), jnp.asarray(pos), N * P, "pallas_gpu", D ** -0.5, interpret=True,
      tuning=tuning)
  ref, k_ref, v_ref = _reference(q, k_new, v_new, pools, layer, table, page, offset, pos, dtype)
  np.testing.assert_array_equal(np.asarray(k_pool, np.float32), k_ref)
  np.testing.assert_array_equal(np.asarray(v_pool, np.float32), v_ref)
  # the last row read its own pages, whose position 20 it did not write: not compared
  np.testing.assert_allclose(np.asarray(out, np.float32)[:5], ref[:5], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("g,dtype,parts,rope,block", [(3, jnp.float32, 0, False, 1),
                                                      (6, jnp.float32, 3, True, 1),
                                                      (1, jnp.float32, 2, False, 1),
                                                      (4, jnp.bfloat16, 0, True, 1),
                                                      (3, jnp.float32, 0, True, 3),
                                                      (4, jnp.bfloat16, 2, False, 2)])
@pytest.mark.slow
def test_the_dot_form_attends_as_numpy_does(g, dtype, parts, rope, block):
  """``dot=1``: a page's scores and output as dots over the queries padded to 16 rows (pages of
  16, heads of 32: the least it takes), in one part or in parts, the rope the kernel's or not,
  ``block`` pages a step of the loop; in bfloat16 the queries and probabilities are rounded to
  it before the dots."""
  p, d = 16, 32
  assert pallas_paged_step.dot_usable(p, d) and not pallas_paged_step.dot_usable(8, 32)
  assert choice.pallas_gpu_tuning("writes=1,dot=1,parts=3") == pallas_attention.PagedTuning(
      writes=True, dot=True, parts=3)  # as $AREAL_JAX_PALLAS_GPU_PAGED spells it
  rng = np.random.default_rng(20 + g)
  q, k_new, v_new, pools, table, pos = _case(rng, 6, g, [0, 5, 16, 31, 63, 40], dtype, p, d)
  page, offset = table[np.arange(6), pos // p], pos % p
  tuning = pallas_attention.PagedTuning(writes=True, dot=True, parts=parts, block_pages=block)
  args = [jnp.asarray(pools[0], dtype), jnp.asarray(pools[1], dtype), 1, jnp.asarray(table),
          jnp.asarray(page), jnp.asarray(offset), jnp.asarray(pos), N * p]
  if rope:  # the queries and key given before rope; the reference rotates them itself
    angles = pos[:, None] * (1e4 ** -(np.arange(0, d, 2) / d))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    qkv = np.concatenate([q, k_new[:, :, None], v_new[:, :, None]], axis=2)
    out, k_pool, v_pool = paged_attention.decode_step_rotating(
        jnp.asarray(qkv, dtype), jnp.asarray(cos), jnp.asarray(sin), *args, d ** -0.5,
        interpret=True, tuning=tuning)
    q, k_new, v_new = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in (q, k_new, v_new))

    def rotated(x):
      c, s = (t.reshape(t.shape[:1] + (1,) * (x.ndim - 2) + t.shape[1:]) for t in (cos, sin))
      y = np.concatenate([x[..., :d // 2] * c - x[..., d // 2:] * s,
                          x[..., d // 2:] * c + x[..., :d // 2] * s], axis=-1)
      return np.asarray(jnp.asarray(y, dtype), np.float32)  # rounded as the model's rope

    q, k_new = rotated(q), rotated(k_new)
  else:
    out, k_pool, v_pool = paged_attention.decode_step_paged(
        jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), *args, "pallas_gpu", d ** -0.5,
        interpret=True, tuning=tuning)
  ref, k_ref, v_ref = _reference(q, k_new, v_new, pools, 1, table, page, offset, pos, dtype)
  np.testing.assert_allclose(np.asarray(k_pool, np.float32), k_ref, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(v_pool, np.float32), v_ref)
  tol = 2e-6 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("parts", [0, 2])
def test_split_over_the_mesh_k_v_heads_it_reads_and_writes_alike(parts):
  rng = np.random.default_rng(7)
  q, k_new, v_new, pools, table, pos = _case(rng, 4, 3, [3, 9, 16, 30], jnp.float32)
  page, offset = table[np.arange(4), pos // P], pos % P
  tuning = pallas_attention.PagedTuning(writes=True, parts=parts)
  mesh = sharding.make_mesh({"tensor": 2}, jax.devices()[:2])

  def run(q, k_new, v_new, k_pool, v_pool, table, page, offset, pos):
    return paged_attention.decode_step_paged(q, k_new, v_new, k_pool, v_pool, 1, table, page,
                                             offset, pos, N * P, "pallas_gpu", D ** -0.5,
                                             interpret=True, tuning=tuning)

  args = [jnp.asarray(x) for x in (q, k_new, v_new, *pools, table, page, offset, pos)]
  with sharding.use(mesh):
    out, k_pool, v_pool = jax.jit(run)(*args)
  ref, k_ref, v_ref = _reference(q, k_new, v_new, pools, 1, table, page, offset, pos, jnp.float32)
  np.testing.assert_array_equal(np.asarray(k_pool), k_ref)
  np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=2e-6)


def test_from_the_projections_before_rope_it_rotates_queries_and_key_as_the_model_does():
  """``decode_step_rotating``: per row and K/V head its queries, key and value as the fused
  projection gives them, and the rows' rope tables; the same as rotating them first (in the
  'rotate half' layout) and writing and attending."""
  rng = np.random.default_rng(11)
  q, k_new, v_new, pools, table, pos = _case(rng, 4, 3, [2, 8, 13, 30], jnp.float32)
  page, offset = table[np.arange(4), pos // P], pos % P
  angles = pos[:, None] * (1e4 ** -(np.arange(0, D, 2) / D))  # [B, D/2]
  cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

  def rotated(x):  # [B, K, ..., D]
    c, s = (t.reshape(t.shape[:1] + (1,) * (x.ndim - 2) + t.shape[1:]) for t in (cos, sin))
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

  qkv = np.concatenate([q, k_new[:, :, None], v_new[:, :, None]], axis=2)
  out, k_pool, _ = paged_attention.decode_step_rotating(
      jnp.asarray(qkv), jnp.asarray(cos), jnp.asarray(sin), *(jnp.asarray(x) for x in pools), 1,
      jnp.asarray(table), jnp.asarray(page), jnp.asarray(offset), jnp.asarray(pos), N * P,
      D ** -0.5, interpret=True, tuning=pallas_attention.PagedTuning(writes=True))
  ref, k_ref, _ = _reference(rotated(q), rotated(k_new), v_new, pools, 1, table, page, offset,
                             pos, jnp.float32)
  np.testing.assert_allclose(np.asarray(k_pool), k_ref, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("block", [1, 4])
def test_long_contexts_are_read_in_parts_combined_as_one_softmax(block):
  """The automatic choice cuts a kv bound of more than 16 pages into parts of at most 16 pages (at
  most 16 parts); over 40 pages of 8 positions a row (a bound of 320) the parts' combined output
  is NumPy's softmax over every position, rows ending in different parts. In blocks of 4 pages a
  run of 14 ends in a block of 2 pages of its own and 2 of the next part's, which it skips."""
  assert [pallas_paged_step.auto_parts(n) for n in (1, 16, 17, 40, 256, 2048)] == [
      1, 1, 2, 3, 16, 16]
  rng = np.random.default_rng(5)
  n, m, b = 40, 130, 3
  pools = [rng.normal(size=(K, 1, m, P, D)).astype(np.float32) for _ in range(2)]
  q = rng.normal(size=(b, K, 2, D)).astype(np.float32)
  k_new, v_new = (rng.normal(size=(b, K, D)).astype(np.float32) for _ in range(2))
  table = rng.permutation(m - 1)[:b * n].reshape(b, n).astype(np.int32)
  pos = np.asarray([319, 130, 9], np.int32)  # 40, 17 and 2 pages: 3 runs each (the last one empty)
  page, offset = table[np.arange(b), pos // P], pos % P
  out, k_pool, _ = paged_attention.decode_step_paged(
      *(jnp.asarray(x) for x in (q, k_new, v_new, *pools, )), 0, jnp.asarray(table),
      jnp.asarray(page), jnp.asarray(offset), jnp.asarray(pos), n * P, "pallas_gpu", D ** -0.5,
      interpret=True, tuning=pallas_attention.PagedTuning(writes=True, block_pages=block))
  k_ref, v_ref = (x.copy() for x in pools)
  ref = np.zeros_like(q)
  for r in range(b):
    k_ref[:, 0, page[r], offset[r]], v_ref[:, 0, page[r], offset[r]] = k_new[r], v_new[r]
    k_, v_ = (x[:, 0, table[r]].reshape(K, n * P, D)[:, :pos[r] + 1] for x in (k_ref, v_ref))
    s = np.einsum("kgd,ktd->kgt", q[r], k_) * D ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    ref[r] = np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), v_)
  np.testing.assert_array_equal(np.asarray(k_pool), k_ref)
  np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=2e-6)


def test_the_kernel_is_offered_where_its_loads_are_powers_of_two():
  assert pallas_paged_step.usable(3, 64, 64) and pallas_paged_step.usable(16, 16, 128)
  assert not pallas_paged_step.usable(17, 64, 64)  # past MAX_GROUP: JAX's kernel
  assert not pallas_paged_step.usable(3, 48, 64) and not pallas_paged_step.usable(3, 64, 80)


@pytest.mark.parametrize("launch", [{}, {"parts": 4}, {"dot": True}, {"dot": True, "parts": 2},
                                    {"dot": True, "block_pages": 2}, {"block_pages": 4}])
@pytest.mark.parametrize("b,k,g,d", [(64, 3, 3, 64), (128, 2, 6, 128)])  # SmolLM2, Qwen2.5-1.5B
def test_the_kernel_lowers_for_a_gpu_at_the_benchmark_shapes(launch, b, k, g, d):
  """Compiled, not interpreted, and lowered for a GPU (Triton) on this CPU: the rope the
  kernel's, pages of 64, the benchmark's kv bound (577: 10 pages), in one part or in parts, the
  elementwise or the dot form, a page or a block of pages a step."""
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  i32, f32 = jnp.int32, jnp.float32
  n, pages = 28, b * 28 + 1
  args = [spec(b, k, g + 2, d), spec(k, pages, 64, d), spec(k, pages, 64, d), spec(1, dt=i32),
          spec(b, n, dt=i32), spec(b, dt=i32), spec(b, dt=i32), spec(b, dt=i32)]
  rope = (spec(b, d // 2, dt=f32), spec(b, d // 2, dt=f32))
  fn = jax.jit(lambda *a: pallas_paged_step.step(*a[:8], 577, rope=a[8:], **launch))
  text = choice.lower(fn, (*args, *rope), "cuda").as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1 and "paged_decode_step" in text
