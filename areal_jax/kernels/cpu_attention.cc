// Decode attention for XLA:CPU, called through the XLA FFI (see cpu_attention.py).
//
// One query per cache row attends to that row's positions 0..pos[b]: the row's keys, then its
// values, are read once each, front to back, as the contiguous block they are in a [R, T, K, D]
// cache, with the next positions prefetched. Rows are shared out over XLA's intra-op thread pool.
// XLA:CPU's own loops over a cache read it at a few GB/s; this reads it several times faster.
//
// q: f32[B, H, D] (pre-scaled, heads kv-major: head h uses kv head h / (H / K));
// k, v: f32[R, T, K, D] with R >= B (rows [0, B) are read); pos: s32[B]; out: f32[B, H, D].
// Attribute kv_len: positions at or past it are never read (pos is clamped to kv_len - 1).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Job {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* pos;
  float* out;
  int64_t rows, heads, kv_heads, dim, cache_len, kv_len;
  std::atomic<int64_t> next{0};  // next row to claim
  std::atomic<int64_t> done{0};  // rows finished
};

// 16 floats, lowered to the CPU's vector registers (two AVX2 ones, one AVX-512 one, four NEON ones).
typedef float V16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;
constexpr int64_t kPrefetch = 4;  // positions read ahead (measured: ~10% faster than none; farther no better)

inline V16 Load(const float* p) { return *reinterpret_cast<const V16*>(p); }

typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

inline float Sum(V16 x) {  // halving: a few shuffles and adds, not 16 lane extractions
  const V8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Head size kD, a multiple of kLanes; 0: any size (plain loops, for the odd model).
template <int64_t kD>
struct Head {
  static constexpr int64_t kV = kD / kLanes;
  V16 x[kV];
  explicit Head(int64_t) {}
  void Load(const float* p) {
    for (int64_t j = 0; j < kV; ++j) x[j] = ::Load(p + j * kLanes);
  }
  float Dot(const float* q) const {
    V16 a = {};
    for (int64_t j = 0; j < kV; ++j) a += x[j] * ::Load(q + j * kLanes);
    return Sum(a);
  }
  void AddTo(float p, float* acc) const {
    for (int64_t j = 0; j < kV; ++j) *reinterpret_cast<V16*>(acc + j * kLanes) += p * x[j];
  }
};

template <>
struct Head<0> {
  const float* x = nullptr;
  int64_t d;
  explicit Head(int64_t d) : d(d) {}
  void Load(const float* p) { x = p; }
  float Dot(const float* q) const {
    float a = 0.f;
    for (int64_t i = 0; i < d; ++i) a += x[i] * q[i];
    return a;
  }
  void AddTo(float p, float* acc) const {
    for (int64_t i = 0; i < d; ++i) acc[i] += p * x[i];
  }
};

// One cache row: scores over its keys, softmax, then the mix of its values, added straight into the
// row's output. Keys and values are each read front to back, once; `scratch` holds the scores
// ([n, H], then unnormalised probabilities), their maxima and the softmax normalisers.
template <int64_t kD>
void Row(const Job& job, int64_t b, std::vector<float>& scratch) {
  const int64_t H = job.heads, K = job.kv_heads, D = job.dim, G = H / K, step = K * D;
  const int64_t n = std::clamp<int64_t>(job.pos[b], 0, job.kv_len - 1) + 1;
  const int64_t lines = (step * int64_t{sizeof(float)} + 63) / 64;
  const float* q = job.q + b * H * D;
  const float* k = job.k + b * job.cache_len * step;
  const float* v = job.v + b * job.cache_len * step;
  float* out = job.out + b * H * D;
  scratch.resize(H * n + 2 * H);
  float* s = scratch.data();
  float *max = s + H * n, *norm = max + H;
  Head<kD> head(D);
  std::fill(max, max + H, -INFINITY);
  std::fill(norm, norm + H, 0.f);
  std::fill(out, out + H * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(k + (t + kPrefetch) * step + i * 16);
    for (int64_t kk = 0; kk < K; ++kk) {
      head.Load(k + t * step + kk * D);
      for (int64_t h = kk * G; h < (kk + 1) * G; ++h) {
        s[t * H + h] = head.Dot(q + h * D);
        max[h] = std::max(max[h], s[t * H + h]);
      }
    }
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h) norm[h] += (s[t * H + h] = std::exp(s[t * H + h] - max[h]));
  for (int64_t h = 0; h < H; ++h) norm[h] = 1.f / norm[h];
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < lines; ++i) __builtin_prefetch(v + (t + kPrefetch) * step + i * 16);
    for (int64_t kk = 0; kk < K; ++kk) {
      head.Load(v + t * step + kk * D);
      for (int64_t h = kk * G; h < (kk + 1) * G; ++h) head.AddTo(s[t * H + h] * norm[h], out + h * D);
    }
  }
}

// Claims rows until none are left.
void Work(Job& job) {
  std::vector<float> scratch;
  auto row = job.dim == 64 ? Row<64> : job.dim == 128 ? Row<128> : Row<0>;
  for (int64_t b; (b = job.next.fetch_add(1)) < job.rows;) {
    row(job, b, scratch);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                               ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                               int64_t kv_len) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || pos.element_count() != qd[0] ||
      kd[0] < qd[0] || kd[3] != qd[2] || qd[1] % kd[2] != 0 || kv_len < 1 || kv_len > kd[1])
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes or kv_len");
  auto job = std::make_shared<Job>();
  job->q = q.typed_data();
  job->k = k.typed_data();
  job->v = v.typed_data();
  job->pos = pos.typed_data();
  job->out = out->typed_data();
  job->rows = qd[0];
  job->heads = qd[1];
  job->dim = qd[2];
  job->cache_len = kd[1];
  job->kv_heads = kd[2];
  job->kv_len = kv_len;
  // helpers share the job by reference count: one that starts after the last row was claimed
  // returns without touching the buffers, which may be gone by then
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->rows) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->rows) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kv_len"));
