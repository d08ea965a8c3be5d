// Matmul against a packed weight for XLA:CPU, called through the XLA FFI (see cpu_matmul.py).
//
// y[M, N] = x[M, K] @ W, the weight packed as wp[G, K, NR] with wp[g, k, j] = W[k, g * NR + j]
// (N = G * NR). For a group of NR output columns the kernel keeps a block of up to kBlock rows of y
// in registers (NR x kR vectors) and walks k once: per k it loads kR vectors of the transposed
// block of x and broadcasts the group's NR weights. Every weight is read exactly once per block of
// rows, front to back, and prefetched kPrefetch k-steps ahead, so the weights stream from memory at
// an even rate while the FMA units stay busy. Groups are handed out in chunks over XLA's intra-op
// thread pool; a chunk loops over all row blocks while its weights are cached. x is transposed per
// block of rows on the way in, and each block of y on the way out, 16 x 16 floats at a time.
//
// x: f32[M, K]; wp: f32[G, K, NR] with NR in {4, 6}; y: f32[M, G * NR]. Needs AVX-512.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include <immintrin.h>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifndef __AVX512F__
#error "cpu_matmul.cc needs AVX-512 (cpu_matmul.available() is then False)"
#endif
constexpr int64_t kLanes = 16, kMaxR = 4;  // 32 registers: NR * 4 accumulators, 4 of x, one weight
constexpr int64_t kBlock = kLanes * kMaxR;  // rows of y per register block
constexpr int64_t kChunkCols = 96;          // output columns per work item (multiple of 4 and 6)
constexpr int64_t kPrefetch = 128;          // k-steps the weights are prefetched ahead (measured:
                                            // 32 to 512 alike; none: ~30% slower from memory)

// 16 x 16 floats: dst[j * ld_dst + i] = src[i * ld_src + j], in registers.
inline void Transpose16(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane L: elements 4L.. of rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + s], lane L: column 4L + s of rows i..i + 3
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int s = 0; s < 4; ++s) {  // column 4L + s: lane L of r[s], r[4 + s], r[8 + s], r[12 + s]
    const __m512 lo01 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x44), hi01 = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xEE);
    const __m512 lo23 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x44), hi23 = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xEE);
    _mm512_storeu_ps(dst + (0 + s) * ld_dst, _mm512_shuffle_f32x4(lo01, lo23, 0x88));
    _mm512_storeu_ps(dst + (4 + s) * ld_dst, _mm512_shuffle_f32x4(lo01, lo23, 0xDD));
    _mm512_storeu_ps(dst + (8 + s) * ld_dst, _mm512_shuffle_f32x4(hi01, hi23, 0x88));
    _mm512_storeu_ps(dst + (12 + s) * ld_dst, _mm512_shuffle_f32x4(hi01, hi23, 0xDD));
  }
}

struct Job {
  const float* xt;  // [blocks, K, kBlock]: x transposed per block of rows, zero-padded
  const float* wp;
  float* y;
  int64_t m, k, groups, nr, chunk_groups, chunks;
  std::atomic<int64_t> next{0};  // next chunk to claim
  std::atomic<int64_t> done{0};  // chunks finished
};

// One group of NR columns for one block of up to kLanes * R rows, stored into y.
template <int64_t NR, int64_t R>
void Tile(const Job& job, int64_t g, int64_t block, float* ct) {
  const int64_t K = job.k;
  const float* w = job.wp + g * K * NR;
  const float* x = job.xt + block * K * kBlock;
  __m512 acc[NR][R];
  for (int64_t j = 0; j < NR; ++j) for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 7) == 0)  // the lines of the weights 8 k-steps use, kPrefetch k-steps ahead
      for (int64_t l = 0; l < NR * 8; l += 16)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetch) * NR + l), _MM_HINT_T0);
    __m512 xv[R];
    for (int64_t r = 0; r < R; ++r) xv[r] = _mm512_load_ps(x + k * kBlock + r * kLanes);
    for (int64_t j = 0; j < NR; ++j) {
      const __m512 b = _mm512_set1_ps(w[k * NR + j]);
      for (int64_t r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(b, xv[r], acc[j][r]);
    }
  }
  for (int64_t j = 0; j < NR; ++j)
    for (int64_t r = 0; r < R; ++r) _mm512_store_ps(ct + j * kBlock + r * kLanes, acc[j][r]);
}

template <int64_t NR>
void Chunk(const Job& job, int64_t c) {
  const int64_t g0 = c * job.chunk_groups, g1 = std::min(job.groups, g0 + job.chunk_groups);
  alignas(64) float ct[kChunkCols * kBlock];
  const int64_t N = job.groups * NR;
  for (int64_t block = 0; block * kBlock < job.m; ++block) {
    const int64_t r = std::min(kMaxR, (job.m - block * kBlock + kLanes - 1) / kLanes);
    auto tile = r == 1 ? Tile<NR, 1> : r == 2 ? Tile<NR, 2> : r == 3 ? Tile<NR, 3> : Tile<NR, kMaxR>;
    for (int64_t g = g0; g < g1; ++g) tile(job, g, block, ct + (g - g0) * NR * kBlock);
    const int64_t row0 = block * kBlock, rows = std::min(kBlock, job.m - row0), cols = (g1 - g0) * NR;
    float* y = job.y + row0 * N + g0 * NR;
    const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
    for (int64_t i = 0; i < rows16; i += 16)
      for (int64_t c = 0; c < cols16; c += 16) Transpose16(ct + c * kBlock + i, kBlock, y + i * N + c, N);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = i < rows16 ? cols16 : 0; c < cols; ++c) y[i * N + c] = ct[c * kBlock + i];
  }
}

// Claims chunks until none are left.
void Work(Job& job) {
  auto chunk = job.nr == 6 ? Chunk<6> : Chunk<4>;
  for (int64_t c; (c = job.next.fetch_add(1)) < job.chunks;) {
    chunk(job, c);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> wp, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || yd[0] != xd[0] ||
      (wd[2] != 4 && wd[2] != 6) || yd[1] != wd[0] * wd[2])
    return ffi::Error::InvalidArgument("packed_matmul: inconsistent shapes");
  const int64_t M = xd[0], K = xd[1], blocks = (M + kBlock - 1) / kBlock;
  if (M == 0) return ffi::Error::Success();
  // x transposed per block of rows, zero-padded: the caller's, reused across calls (allocating it
  // anew per call costs page faults). Helpers never touch it after the last chunk is done.
  thread_local std::vector<float> scratch;
  scratch.resize(std::max<size_t>(scratch.size(), blocks * K * kBlock + 16));
  float* xtp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  const float* xs = x.typed_data();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = std::min(kBlock, M - b * kBlock);
    float* dst = xtp + b * K * kBlock;
    const int64_t rows16 = rows / 16 * 16, k16 = K / 16 * 16;
    const float* src = xs + b * kBlock * K;
    for (int64_t i = 0; i < rows16; i += 16)
      for (int64_t k = 0; k < k16; k += 16) Transpose16(src + i * K + k, K, dst + k * kBlock + i, kBlock);
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = k < k16 ? rows16 : 0; i < rows; ++i) dst[k * kBlock + i] = src[i * K + k];
      for (int64_t i = rows; i < kBlock; ++i) dst[k * kBlock + i] = 0.f;
    }
  }
  auto job = std::make_shared<Job>();
  job->xt = xtp;
  job->wp = wp.typed_data();
  job->y = y->typed_data();
  job->m = M;
  job->k = K;
  job->groups = wd[0];
  job->nr = wd[2];
  job->chunk_groups = kChunkCols / job->nr;
  job->chunks = (job->groups + job->chunk_groups - 1) / job->chunk_groups;
  // helpers share the job by reference count: one that starts after the last chunk was claimed
  // returns without touching the buffers, which may be gone by then
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
