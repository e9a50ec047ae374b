// CUDA kernels of cache_attention: attention of a few queries per row (a decode step, or a verification pass over
// K + 1 positions) over a static KV cache, reading each row's live columns only (flash-decoding: Dao et al. 2023,
// "Flash-Decoding for long-context inference"). Torch-free (compiled by nvcc alone in CI).
//
// Pass 1, one block per (chunk of kChunk columns, KV head, row): the block's warps take the queries of the query
// heads that share the KV head (grouped-query attention: the group's keys and values are read by one block), each
// query by one warp, its head dimension spread over the lanes; for each column the query may see, the score
// q.k * scale (a warp reduction), an online softmax (running max m, normaliser l, accumulator acc; Milakov and
// Gimelshein 2018) and acc += exp(s - m) v. The chunk's (m, l, acc) go to the workspace; a chunk that starts past
// every query's last column writes m = -inf at once. Pass 2, one block per (row, query, head): the chunks'
// partials merged by their maxima, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s; a query that sees no
// column gets zeros. float32 accumulation for every input dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cfloat>

#include "cuda/launchers.h"

namespace specdec {
namespace cuda {
namespace {

constexpr int kWarps = 4;                   // warps per block of pass 1
constexpr int kChunk = 128;                 // columns per block of pass 1
constexpr int kMaxPerLane = 8;              // head dimension up to 32 * 8 = 256
constexpr int kMergeThreads = 128;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The chunks (pass 1's blocks along x) for C columns.
__host__ __device__ __forceinline__ int64_t chunks_of(int64_t C) { return (C + kChunk - 1) / kChunk; }

// Workspace layout: for every (row b, head h, query i, chunk s) the floats m, l, then acc[0 .. D - 1].
__host__ __device__ __forceinline__ int64_t partial_at(const CacheAttentionArgs& a, int64_t b, int64_t h, int64_t i,
                                                      int64_t s) {
  return (((b * a.q_heads + h) * a.queries + i) * chunks_of(a.columns) + s) * (a.head_dim + 2);
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) attend_chunks(CacheAttentionArgs a) {
  const int64_t s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t group = a.q_heads / a.kv_heads, n = a.queries, D = a.head_dim;
  const int64_t c0 = s * kChunk, c_end = c0 + kChunk < a.columns ? c0 + kChunk : a.columns;
  const int64_t start = a.starts[b];
  const T* q_base = static_cast<const T*>(a.q) + b * a.q_stride[0];
  const T* k_base = static_cast<const T*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[1];
  const T* v_base = static_cast<const T*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[1];
  for (int64_t j = warp; j < group * n; j += kWarps) {  // query (head g of the group, position i)
    const int64_t h = kvh * group + j / n, i = j % n;
    const int64_t last = start + i;  // the last column it sees (clamped below to the cache)
    const int64_t hi = last + 1 < c_end ? last + 1 : c_end;
    float q[kMaxPerLane], acc[kMaxPerLane];
    const T* qrow = q_base + h * a.q_stride[1] + i * a.q_stride[2];
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t d = lane + 32 * e;
      q[e] = d < D ? to_f(qrow[d]) * a.scale : 0.0f;
      acc[e] = 0.0f;
    }
    float m = -FLT_MAX, l = 0.0f;
    bool seen = false;
    for (int64_t c = c0; c < hi; ++c) {
      const T* krow = k_base + c * a.k_stride[2];
      float part = 0.0f;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int64_t d = lane + 32 * e;
        if (d < D) part += q[e] * to_f(krow[d]);
      }
      const float score = warp_sum(part);
      const float m_new = score > m ? score : m;
      const float keep = seen ? __expf(m - m_new) : 0.0f;
      const float w = __expf(score - m_new);
      const T* vrow = v_base + c * a.v_stride[2];
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int64_t d = lane + 32 * e;
        if (d < D) acc[e] = acc[e] * keep + w * to_f(vrow[d]);
      }
      l = l * keep + w;
      m = m_new;
      seen = true;
    }
    float* out = a.workspace + partial_at(a, b, h, i, s);
    if (lane == 0) {
      out[0] = seen ? m : -FLT_MAX;
      out[1] = l;  // 0 where the chunk holds no column the query sees
    }
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int64_t d = lane + 32 * e;
      if (d < D) out[2 + d] = acc[e];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_chunks(CacheAttentionArgs a) {
  const int64_t h = blockIdx.x, i = blockIdx.y, b = blockIdx.z;
  const int64_t S = chunks_of(a.columns), D = a.head_dim;
  float M = -FLT_MAX;
  for (int64_t s = 0; s < S; ++s) {
    const float* p = a.workspace + partial_at(a, b, h, i, s);
    if (p[1] > 0.0f && p[0] > M) M = p[0];
  }
  float L = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const float* p = a.workspace + partial_at(a, b, h, i, s);
    if (p[1] > 0.0f) L += __expf(p[0] - M) * p[1];
  }
  T* out = static_cast<T*>(a.out) + ((b * a.queries + i) * a.q_heads + h) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float x = 0.0f;
    if (L > 0.0f) {
      for (int64_t s = 0; s < S; ++s) {
        const float* p = a.workspace + partial_at(a, b, h, i, s);
        if (p[1] > 0.0f) x += __expf(p[0] - M) * p[2 + d];
      }
      x /= L;
    }
    out[d] = from_f<T>(x);
  }
}

template <typename T>
cudaError_t launch(const CacheAttentionArgs& a, cudaStream_t stream) {
  const dim3 chunks(static_cast<unsigned>(chunks_of(a.columns)), static_cast<unsigned>(a.kv_heads),
                    static_cast<unsigned>(a.batch));
  attend_chunks<T><<<chunks, kWarps * 32, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 rows(static_cast<unsigned>(a.q_heads), static_cast<unsigned>(a.queries), static_cast<unsigned>(a.batch));
  merge_chunks<T><<<rows, kMergeThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

int64_t cache_attention_workspace(int64_t batch, int64_t q_heads, int64_t queries, int64_t columns, int64_t head_dim) {
  return batch * q_heads * queries * chunks_of(columns) * (head_dim + 2);
}

cudaError_t cache_attention(const CacheAttentionArgs& a, cudaStream_t stream) {
  if (a.head_dim > 32 * kMaxPerLane || a.kv_heads < 1 || a.q_heads % a.kv_heads != 0) return cudaErrorInvalidValue;
  if (a.batch == 0 || a.queries == 0 || a.q_heads == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat32: return launch<float>(a, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(a, stream);
    case DType::kFloat16: return launch<__half>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace specdec
