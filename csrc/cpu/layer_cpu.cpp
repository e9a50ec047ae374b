// CPU kernels of a decoding step's matrix-vector products (packed_linear) and of a whole decoder layer
// (decoder_layer), for float32 and bfloat16 weights (bfloat16 widened to float32 as it is read: a shift) and for int8
// weights with a float32 scale per output feature (weight-only quantization: each int8 widened to float32 as it is
// read, each output's sum multiplied by its scale once, at the end); weights in blocks of 32 (GGUF's Q4_1, Q8_0) go
// to csrc/cpu/blocks_cpu.cpp.
//
// Why: a decode step or a verification multiplies a few rows (1 to K + 1 tokens) by every weight of the model once,
// so its time is the time to read the weights; on a 2-core AMD EPYC oneDNN's packed matmul read them at 0.7-0.8x the
// rate torch.sum reads a buffer, and the ~50 small torch ops of each layer (norms, RoPE, cache writes, views, the
// attention call) cost as much again in dispatch (bench/scale_probe.py: 1,570 ops a step for SmolLM2-135M).
//
// packed_linear reads W [N, K] stored as panels of 16 output features, [P, K, 16]: each step of the reduction over
// k loads 16 weights (one cache line of float32) and multiplies them by x[m, k] for every row m, so the weight
// streams front to back with the next lines prefetched. An int8 panel is [K + 4, 16] bytes: the K lines of 16 int8
// weights, then the panel's 16 float32 scales (64 bytes), so the scales stream with their weights. Every output sums
// its K products in one chain in k order, whatever the number of rows: a row's result is the same in a one-token step
// and in a verification of K + 1 tokens.
//
// Activations are float32 inside a call; a bfloat16 layer rounds to bfloat16 where its tensors are stored: the keys
// and values written into the cache, the queries and attention output (the attention kernel reads one dtype), and the
// layer's output.
//
// decoder_layer runs a layer's whole forward in one call (llama.cpp's and gpt-fast's layer, without the
// dispatcher): RMS norm, the fused QKV product (+ bias), each head's q/k RMS norm (Qwen3), RoPE (rotate_half, as
// transformers' Llama), the keys and values written into the cache, attention (the decode_attention kernel, causal
// over each row's cache slot), the output product and its residual, then RMS norm, the gate/up product,
// SiLU(gate) * up, the down product and its residual. decoder_layers runs a stack of them in one parallel region, its
// threads a team (csrc/cpu/team.h): each computes its share of every product, of the heads' q/k norms, RoPE and cache
// writes and of attention, and the norms, residuals and SiLU itself, a sync after each shared step.
#include "cpu/layer_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/blocks_cpu.h"
#include "cpu/cpu_math.h"
#include "cpu/panels.h"
#include "cpu/team.h"

namespace specdec {
namespace cpu {
namespace {

// The weight types W of blocks of 32 inputs (csrc/cpu/blocks_cpu.cpp): the bytes of a PackedWeights kind and the
// product that reads them.
template <typename Byte, void (*Gemm)(const float*, int64_t, int64_t, int64_t, const Byte*, int64_t, float*, int64_t,
                                      const float*, const Team*)>
struct Blocks {
  Byte byte;
};
using Q4Blocks = Blocks<uint8_t, q4_gemm>;           // PackedWeights::kQ4Blocks
using Q8Blocks = Blocks<int8_t, q8_blocks_gemm>;     // kQ8Blocks
using Q4BlocksA8 = Blocks<uint8_t, q4_a8_gemm>;      // kQ4BlocksA8: for int8 activations
using Q8BlocksA8 = Blocks<int8_t, q8_a8_gemm>;       // kQ8BlocksA8

// Elements of W after each panel's K lines: an int8 panel's 16 float32 scales (64 bytes); none for float weights.
template <typename W>
constexpr int64_t kTail = std::is_same_v<W, int8_t> ? 64 : 0;

// Elements of W from one panel's start to the next's.
template <typename W>
SPECDEC_ALWAYS_INLINE int64_t panel_stride(int64_t K) { return K * kPanel + kTail<W>; }

// The 16 scales of the panel starting at wp (in K lines), or nullptr for float weights.
template <typename W>
SPECDEC_ALWAYS_INLINE const float* panel_scales(const W* wp, int64_t K) {
  if constexpr (std::is_same_v<W, int8_t>) return reinterpret_cast<const float*>(wp + K * kPanel);
  return nullptr;
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  uint16_t u;
  std::memcpy(&u, &v, sizeof(u));
  return upper_half(u);
}

// n values of a float32 or bfloat16 array as float32.
template <typename T>
inline void to_float(const T* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = widen(p[i]);
}

// The bits of the bfloat16 nearest to f (ties to even; NaN: 0x7FC0), as c10's conversion rounds it, without its
// branch: a loop of them vectorises (c10's: one value at a time).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

template <typename T>
inline void from_float(const float* p, int64_t n, T* out) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint16_t* bits = reinterpret_cast<uint16_t*>(out);
    for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(p[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i]);
  }
}

// acc[m][:] += w[k, :] * x[m, k] for MB rows: one line of 16 weights (float32, or bfloat16 or int8 widened in
// registers).
template <int MB, typename W>
SPECDEC_ALWAYS_INLINE void panel_step(float (&acc)[MB][kPanel], const float* x, int64_t ldx, const W* w, int64_t k) {
  if constexpr (std::is_same_v<W, float>) {
    const float* wk = w + k * kPanel;
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * ldx + k];
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) acc[m][l] = mul_add(wk[l], xm, acc[m][l]);
    }
  } else if constexpr (std::is_same_v<W, int8_t>) {
    const int8_t* wk = w + k * kPanel;
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * ldx + k];
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) acc[m][l] = mul_add(static_cast<float>(wk[l]), xm, acc[m][l]);
    }
  } else {  // bfloat16: the upper halves of float32s
    const uint16_t* wk = reinterpret_cast<const uint16_t*>(w) + k * kPanel;
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * ldx + k];
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) acc[m][l] = mul_add(upper_half(wk[l]), xm, acc[m][l]);
    }
  }
}

// Panel p of y for MB rows of x (row strides ldx, ldy): y[m, col] = x[m, :] . W[col, :] (+ bias), one chain of
// multiply-adds per output in k order, the same for every MB. One panel at a time, so each thread streams one run of
// memory: advancing 2 or 4 panels together gave a one-row product more independent chains (1.5x from the cache) but
// cost 3-6% end to end on SmolLM2-135M, whose weights come from memory (bench/installs.py side by side).
template <int MB, typename W>
SPECDEC_ALWAYS_INLINE void panel_rows(const float* x, int64_t ldx, int64_t K, const W* w, int64_t p, int64_t N,
                                      float* y, int64_t ldy, const float* bias) {
  float acc[MB][kPanel] = {};
  const W* wp = w + p * panel_stride<W>(K);
  const char* ahead = reinterpret_cast<const char*>(wp) + kPrefetchBytes;
  for (int64_t k = 0; k < K; ++k) {
    prefetch_line(ahead + k * kPanel * sizeof(W));
    panel_step<MB>(acc, x, ldx, wp, k);
  }
  const int64_t col = p * kPanel, width = std::min(kPanel, N - col);
  for (int m = 0; m < MB; ++m) store_panel_row(acc[m], y + m * ldy, col, width, bias, panel_scales(wp, K));
}

// Kernel::rows<MB> for the run-time row count rows (1 <= rows <= MB).
template <class Kernel, int MB, typename W>
SPECDEC_ALWAYS_INLINE void rows_upto(int64_t rows, const float* x, int64_t ldx, int64_t K, const W* w, int64_t p,
                                     int64_t N, float* y, int64_t ldy, const float* bias) {
  if constexpr (MB >= 1) {
    if (rows == MB) return Kernel::template rows<MB>(x, ldx, K, w, p, N, y, ldy, bias);
    rows_upto<Kernel, MB - 1>(rows, x, ldx, K, w, p, N, y, ldy, bias);
  }
}

// Panels [begin, end) of y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W packed [P, K, 16]
// (int8: [P, K + 4, 16]), by
// a kernel's Kernel::rows<MB> (a panel_rows). Up to Kernel::kMaxRows rows share every load of the weights (as many as
// its accumulators fit the vector registers); more rows go over each panel in blocks of near-equal size (7 rows of a
// 6-row kernel: 3 + 4, not 6 + 1, whose one-row block would wait on a single chain), each block reading the panel
// once: from memory, then from the cache.
template <class Kernel, typename W>
SPECDEC_ALWAYS_INLINE void gemm_rows(int64_t begin, int64_t end, const float* x, int64_t ldx, int64_t M, int64_t K,
                                     const W* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  constexpr int64_t kMax = Kernel::kMaxRows;
  const int64_t blocks = (M + kMax - 1) / kMax;
  for (int64_t p = begin; p < end; ++p) {
    int64_t m = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t rows = (M - m) / (blocks - b);
      rows_upto<Kernel, Kernel::kMaxRows>(rows, x + m * ldx, ldx, K, w, p, N, y + m * ldy, ldy, bias);
      m += rows;
    }
  }
}

struct Lanes {  // accumulators as arrays of 16 floats, vectorised by the compiler (AVX2 or AVX-512 clones)
  static constexpr int kMaxRows = 6;  // 6 x 16 float32 accumulators: 12 of AVX2's 16 ymm registers
  template <int MB, typename W>
  SPECDEC_ALWAYS_INLINE static void rows(const float* x, int64_t ldx, int64_t K, const W* w, int64_t p, int64_t N,
                                         float* y, int64_t ldy, const float* bias) {
    panel_rows<MB>(x, ldx, K, w, p, N, y, ldy, bias);
  }
};

template <typename W>
SPECDEC_CPU_CLONES void gemm_panels(int64_t begin, int64_t end, const float* x, int64_t ldx, int64_t M, int64_t K,
                                    const W* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  gemm_rows<Lanes>(begin, end, x, ldx, M, K, w, N, y, ldy, bias);
}

#if defined(SPECDEC_AVX512)
// The same products with every accumulator one 16-lane GCC vector (a zmm register once inlined into
// gemm_panels_avx512: the helpers carry no target of their own, so that the generic loops inline them) and a bfloat16
// line widened once for all rows (the auto-vectorised loops above widened it once per row).
// SmolLM2-135M's bfloat16 forward (bench/fused_layers.py, against ATEN_CPU_CAPABILITY=avx2's kernel, 2-core EPYC):
// 5 tokens 0.95x, one token 0.95x; float32, whose weights come from memory, level end to end.
struct Vectors {
  typedef float Line __attribute__((vector_size(64), aligned(4)));  // 16 float32 lanes
  typedef uint16_t Halves __attribute__((vector_size(32), aligned(2)));
  typedef uint32_t Bits __attribute__((vector_size(64)));
  typedef int8_t Bytes __attribute__((vector_size(16)));
  typedef int32_t Ints __attribute__((vector_size(64)));
  // 16 accumulators of AVX-512's 32 zmm registers: a verification of up to 16 tokens reads each weight once (with
  // 6-row blocks, 7 tokens read them twice: bfloat16 SmolLM2-135M's forward 1.4x slower at 7 tokens than at 6 on a
  // 2-core Xeon with AMX, bench/fused_layers.py).
  static constexpr int kMaxRows = 16;

  // *out = the 16 weights at w (bfloat16: each the upper half of a float32; int8: each converted).
  template <typename W>
  SPECDEC_ALWAYS_INLINE static void load(const W* w, Line* out) {
    if constexpr (std::is_same_v<W, float>) {
      *out = *reinterpret_cast<const Line*>(w);
    } else if constexpr (std::is_same_v<W, int8_t>) {
      // One vpmovsxbd: GCC's vector conversion widens int8 to int32 lane by lane (or in 6 shuffles through int16,
      // which bound the product at 12 G weights/s on a 2-core Xeon), and an intrinsic would need a target attribute
      // that the generic loops inlining this helper lack.
      // (the bytes pass in a register: a memory operand kept the accumulators in memory, 3-4x slower at 4 rows).
      Bytes bytes;
      std::memcpy(&bytes, w, sizeof(bytes));
      Ints ints;
      asm("vpmovsxbd %1, %0" : "=v"(ints) : "v"(bytes));
      *out = __builtin_convertvector(ints, Line);
    } else {
      const Bits bits = __builtin_convertvector(*reinterpret_cast<const Halves*>(w), Bits) << 16;
      std::memcpy(out, &bits, sizeof(Line));
    }
  }

  // Panels p .. p + G - 1 for MB rows, their G weight streams advanced together: G x MB independent chains, so a
  // product of few rows is not bound by one chain's multiply-add latency (bfloat16 SmolLM2-135M's one-token forward
  // 17.8 -> 13.9 ms with 4 panels on a 2-core Xeon with AMX, where the weights stream from memory with prefetcht0;
  // bench/fused_layers.py). Each output's chain is the same whatever G and MB (its K products in k order).
  template <int MB, int G, typename W>
  SPECDEC_ALWAYS_INLINE static void group(const float* x, int64_t ldx, int64_t K, const W* w, int64_t p, int64_t N,
                                          float* y, int64_t ldy, const float* bias) {
    Line acc[G][MB] = {};
    const int64_t stride = panel_stride<W>(K);
    const W* wp = w + p * stride;
    // k steps per 64-byte line: 1 (float32), 2 (bfloat16), 4 (int8)
    constexpr int64_t kPerLine = 64 / (kPanel * sizeof(W));
    for (int64_t k = 0; k < K; ++k) {
      for (int g = 0; g < G; ++g) {
        if (k % kPerLine == 0)
          prefetch_line(fetch_ahead(wp + g * stride, k * kPanel * sizeof(W), stride * sizeof(W), G));
        Line line;
        load(wp + g * stride + k * kPanel, &line);
        for (int m = 0; m < MB; ++m) acc[g][m] += line * x[m * ldx + k];
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t col = (p + g) * kPanel, width = std::min(kPanel, N - col);
      for (int m = 0; m < MB; ++m) {
        float sums[kPanel];
        std::memcpy(sums, &acc[g][m], sizeof(sums));
        store_panel_row(sums, y + m * ldy, col, width, bias, panel_scales(wp + g * stride, K));
      }
    }
  }

  template <int MB, typename W>
  SPECDEC_ALWAYS_INLINE static void rows(const float* x, int64_t ldx, int64_t K, const W* w, int64_t p, int64_t N,
                                         float* y, int64_t ldy, const float* bias) {
    group<MB, 1>(x, ldx, K, w, p, N, y, ldy, bias);
  }
};

// Vectors::group<MB, G> for the run-time row count rows (1 <= rows <= MB).
template <int G, int MB, typename W>
SPECDEC_ALWAYS_INLINE void group_upto(int64_t rows, const float* x, int64_t ldx, int64_t K, const W* w, int64_t p,
                                      int64_t N, float* y, int64_t ldy, const float* bias) {
  if constexpr (MB >= 1) {
    if (rows == MB) return Vectors::template group<MB, G>(x, ldx, K, w, p, N, y, ldy, bias);
    group_upto<G, MB - 1>(rows, x, ldx, K, w, p, N, y, ldy, bias);
  }
}

// gemm_rows with Vectors, where at most 8 rows advance 2 panels together, at most 4 rows 4 and at most 2 rows 8 (16
// accumulators). 8 panels for one row against 4: SmolLM2-135M's one-token step 0.97x with int8 weights and 0.96x
// with bfloat16 ones on a 2-core Xeon with AMX (the two alternated in one process, 256 columns of context).
template <typename W>
SPECDEC_ALWAYS_INLINE void gemm_vectors(int64_t begin, int64_t end, const float* x, int64_t ldx, int64_t M, int64_t K,
                                        const W* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  int64_t p = begin;
  if (M <= 2) {
    for (; p + 8 <= end; p += 8) group_upto<8, 2>(M, x, ldx, K, w, p, N, y, ldy, bias);
    for (; p + 4 <= end; p += 4) group_upto<4, 2>(M, x, ldx, K, w, p, N, y, ldy, bias);
  } else if (M <= 4) {
    for (; p + 4 <= end; p += 4) group_upto<4, 4>(M, x, ldx, K, w, p, N, y, ldy, bias);
  } else if (M <= 8) {
    for (; p + 2 <= end; p += 2) group_upto<2, 8>(M, x, ldx, K, w, p, N, y, ldy, bias);
  }
  gemm_rows<Vectors>(p, end, x, ldx, M, K, w, N, y, ldy, bias);
}

template <typename W>
SPECDEC_AVX512_FN void gemm_panels_avx512(int64_t begin, int64_t end, const float* x, int64_t ldx, int64_t M,
                                          int64_t K, const W* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  gemm_vectors(begin, end, x, ldx, M, K, w, N, y, ldy, bias);
}
#endif

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W packed [P, K, 16] (int8: [P, K + 4, 16]);
// panels split among at::parallel_for's threads, or with a team the calling thread's share of them alone.
template <typename W>
void packed_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t ldy,
                 const float* bias, const Team* team = nullptr) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  auto panels = [&](int64_t begin, int64_t end) {
#if defined(SPECDEC_AVX512)
    if (avx512_usable()) return gemm_panels_avx512<W>(begin, end, x, ldx, M, K, w, N, y, ldy, bias);
#endif
    gemm_panels<W>(begin, end, x, ldx, M, K, w, N, y, ldy, bias);
  };
  if (team != nullptr) return panels(team->begin(P), team->end(P));
  at::parallel_for(0, P, 1, panels);
}

// Blocks: csrc/cpu/blocks_cpu.cpp.
template <typename Byte, auto Gemm>
void packed_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const Blocks<Byte, Gemm>* w, int64_t N, float* y,
                 int64_t ldy, const float* bias, const Team* team = nullptr) {
  Gemm(x, ldx, M, K, reinterpret_cast<const Byte*>(w), N, y, ldy, bias, team);
}

// out[r, :] = w * x[r, :] / sqrt(mean(x[r, :]^2) + eps) for R rows of length H (row strides ldx, ldo).
void rms_rows(const float* x, int64_t ldx, int64_t R, int64_t H, const float* w, float eps, float* out, int64_t ldo) {
  constexpr int kLanes = 8;
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    float lanes[kLanes] = {};
    int64_t h = 0;
    for (; h + kLanes <= H; h += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += xr[h + l] * xr[h + l];
    float tail = 0.0f;
    for (; h < H; ++h) tail += xr[h] * xr[h];
    for (int s = kLanes / 2; s > 0; s /= 2)
      for (int l = 0; l < s; ++l) lanes[l] += lanes[l + s];
    const float inv = 1.0f / std::sqrt((lanes[0] + tail) / static_cast<float>(H) + eps);
    float* o = out + r * ldo;
    for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (xr[i] * inv);
  }
}

// x [D] <- x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]) (transformers' Llama RoPE).
inline void rope_row(float* x, const float* cos, const float* sin, int64_t D, float* tmp) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) tmp[d] = x[d] * cos[d] - x[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) tmp[d] = x[d] * cos[d] + x[d - half] * sin[d];
  std::memcpy(x, tmp, D * sizeof(float));
}

// out[j] = SiLU(g[j]) * g[I + j] for j < I (SiLU(gate) * up), SiLU(z) = z * sigmoid(z) with sigmoid from e =
// exp(-|z|) <= 1 (exp_nonpos, which the loop vectorises; std::exp is a call per value).
inline void silu_mul(const float* g, int64_t I, float* out) {
  for (int64_t j = 0; j < I; ++j) {
    const float e = exp_nonpos(-std::fabs(g[j]));
    out[j] = g[j] * ((g[j] >= 0.0f ? 1.0f : e) / (1.0f + e)) * g[I + j];
  }
}

// A vector of the layer's dtype as float32 (nullptr stays nullptr).
template <typename T>
std::vector<float> floats(const void* p, int64_t n) {
  std::vector<float> out(p != nullptr ? n : 0);
  if (p != nullptr) to_float(static_cast<const T*>(p), n, out.data());
  return out;
}

inline const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

template <typename T, typename W>
void packed_linear_impl(const PackedLinearArgs& a) {
  const int64_t M = a.rows, K = a.in_features, N = a.out_features;
  std::vector<float> x(M * K), y(M * N);
  to_float(static_cast<const T*>(a.x), M * K, x.data());
  const std::vector<float> bias = floats<T>(a.bias, N);
  packed_gemm(x.data(), K, M, K, static_cast<const W*>(a.weight), N, y.data(), N, data_or_null(bias));
  from_float(y.data(), M * N, static_cast<T*>(a.out));
}

// The widest of a stack's layers, which the buffers of a team and of each of its threads are sized for.
struct Widths {
  int64_t batch, rows, hidden, qkv = 0, q = 0, intermediate = 0, head_dim = 0;
  Widths(const DecoderLayerArgs* layers, int64_t L)
      : batch(layers[0].batch), rows(layers[0].batch * layers[0].tokens), hidden(layers[0].hidden) {
    for (int64_t l = 0; l < L; ++l) {
      const DecoderLayerArgs& a = layers[l];
      qkv = std::max(qkv, (a.heads + 2 * a.kv_heads) * a.head_dim);
      q = std::max(q, a.heads * a.head_dim);
      intermediate = std::max(intermediate, a.intermediate);
      head_dim = std::max(head_dim, a.head_dim);
    }
  }
};

// What the threads of a team share across a stack's layers (each writes its share of them, and all read them after a
// sync).
template <typename T>
struct Shared {
  std::vector<float> qkv, attn, mid, gate_up, out;
  std::vector<T> q_t, attn_t;  // bfloat16 layers: the rounded queries and attention output

  explicit Shared(const Widths& w)
      : qkv(w.rows * w.qkv), attn(w.rows * w.q), mid(w.rows * w.hidden), gate_up(w.rows * 2 * w.intermediate),
        out(w.rows * w.hidden), q_t(std::is_same_v<T, float> ? 0 : w.rows * w.q),
        attn_t(std::is_same_v<T, float> ? 0 : w.rows * w.q) {}
};

// Each thread's own buffers, allocated once for a stack: x, the layer's input as float32 (then its output); the
// normed rows, the attention block's residual, SiLU(gate) * up and (bfloat16) the attention output as float32, which
// every thread computes alike; RoPE's scratch; each row's slot and first position.
struct Own {
  std::vector<float> x, normed, res, act, attn, tmp, cs, sn;
  std::vector<int64_t> starts, slots;

  explicit Own(const Widths& w)
      : x(w.rows * w.hidden), normed(w.rows * w.hidden), res(w.rows * w.hidden), act(w.rows * w.intermediate),
        attn(w.rows * w.q), tmp(w.head_dim), cs(w.head_dim), sn(w.head_dim), starts(w.batch), slots(w.batch) {}
};

// One layer on one thread of the team: own.x [M, H] holds the layer's input as float32 and becomes its output (rounded
// to T, as the next layer reads it); every thread computes the norms, residuals and SiLU alike into its own buffers
// (no sync waits on one thread's), and its share of each product, of the q/k norms, RoPE and cache writes, and of
// attention, a sync after each. a.out gets this thread's share of the output rows.
template <typename T, typename W>
void layer_on_thread(const DecoderLayerArgs& a, const Team& team, Shared<T>& sh, Own& own) {
  const int64_t B = a.batch, n = a.tokens, M = B * n, H = a.hidden;
  const int64_t Hq = a.heads, Hkv = a.kv_heads, D = a.head_dim, I = a.intermediate, C = a.columns;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  const W* wqkv = static_cast<const W*>(a.qkv);
  const W* wo = static_cast<const W*>(a.o);
  const W* wgu = static_cast<const W*>(a.gate_up);
  const W* wdown = static_cast<const W*>(a.down);
  T* key_cache = static_cast<T*>(a.key_cache);
  T* value_cache = static_cast<T*>(a.value_cache);
  const std::vector<float> input_norm = floats<T>(a.input_norm, H), post_norm = floats<T>(a.post_norm, H);
  const std::vector<float> qkv_bias = floats<T>(a.qkv_bias, QKV);
  const std::vector<float> q_norm = floats<T>(a.q_norm, D), k_norm = floats<T>(a.k_norm, D);
  std::vector<float>& x = own.x;
  std::vector<float>& normed = own.normed;
  std::vector<float>& res = own.res;
  std::vector<float>& act = own.act;
  std::vector<float>& tmp = own.tmp;
  std::vector<float>& cs = own.cs;
  std::vector<float>& sn = own.sn;
  std::vector<int64_t>& starts = own.starts;
  std::vector<int64_t>& slots = own.slots;
  float* qkv = sh.qkv.data();

  rms_rows(x.data(), H, M, H, input_norm.data(), a.eps, normed.data(), H);
  packed_gemm(normed.data(), H, M, H, wqkv, QKV, qkv, QKV, data_or_null(qkv_bias), &team);
  team.sync();

  // each row's positions; per head, row after row: q/k norm and RoPE, the keys and values into the cache (positions
  // past the last regular column write the scratch column C - 1, the last such token's last, as rows sharing a slot;
  // RoPE past the table reads its last row)
  for (int64_t b = 0; b < B; ++b) {
    slots[b] = a.row_slots != nullptr ? a.row_slots[b] : b;
    starts[b] = a.lengths[slots[b]];
  }
  const T* cos = static_cast<const T*>(a.cos);
  const T* sin = static_cast<const T*>(a.sin);
  for (int64_t h = team.begin(Hq + Hkv); h < team.end(Hq + Hkv); ++h) {  // q heads, then k heads
    const std::vector<float>& norm = h < Hq ? q_norm : k_norm;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / n, pos = starts[b] + m % n, rot = std::min(pos, a.positions - 1);
      to_float(cos + rot * D, D, cs.data());
      to_float(sin + rot * D, D, sn.data());
      float* row = qkv + m * QKV;
      float* head = row + h * D;
      if (!norm.empty()) rms_rows(head, D, 1, D, norm.data(), a.eps, head, D);
      rope_row(head, cs.data(), sn.data(), D, tmp.data());
      if (h >= Hq) {
        const int64_t at = ((slots[b] * Hkv + h - Hq) * C + std::min(pos, C - 1)) * D;
        from_float(head, D, key_cache + at);
        from_float(row + (Hkv + h) * D, D, value_cache + at);  // value head h - Hq
      } else if constexpr (!std::is_same_v<T, float>) {
        from_float(head, D, sh.q_t.data() + m * Hq * D + h * D);
      }
    }
  }
  team.sync();

  DecodeAttentionArgs att{};
  att.dtype = std::is_same_v<T, float> ? DType::kFloat32 : DType::kBFloat16;
  att.batch = B; att.q_heads = Hq; att.kv_heads = Hkv; att.queries = n; att.columns = C; att.head_dim = D;
  if constexpr (std::is_same_v<T, float>) {  // the queries where the product wrote them
    att.q = qkv;
    att.q_stride[0] = n * QKV; att.q_stride[1] = D; att.q_stride[2] = QKV;
    att.out = sh.attn.data();
  } else {  // rounded, [B, n, Hq, D]
    att.q = sh.q_t.data();
    att.q_stride[0] = n * Hq * D; att.q_stride[1] = D; att.q_stride[2] = Hq * D;
    att.out = sh.attn_t.data();
  }
  att.k = key_cache;
  att.v = value_cache;
  att.k_stride[0] = att.v_stride[0] = Hkv * C * D;
  att.k_stride[1] = att.v_stride[1] = C * D;
  att.k_stride[2] = att.v_stride[2] = D;
  att.mask = nullptr;
  att.starts = starts.data();
  att.rows = slots.data();
  att.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));  // D ** -0.5, as the model
  decode_attention(att, &team);
  team.sync();
  const float* attn = sh.attn.data();
  if constexpr (!std::is_same_v<T, float>) {
    to_float(sh.attn_t.data(), M * Hq * D, own.attn.data());
    attn = own.attn.data();
  }

  packed_gemm(attn, Hq * D, M, Hq * D, wo, H, sh.mid.data(), H, static_cast<const float*>(nullptr), &team);
  team.sync();
  for (int64_t i = 0; i < M * H; ++i) res[i] = sh.mid[i] + x[i];  // the attention block's residual
  rms_rows(res.data(), H, M, H, post_norm.data(), a.eps, normed.data(), H);
  packed_gemm(normed.data(), H, M, H, wgu, 2 * I, sh.gate_up.data(), 2 * I, static_cast<const float*>(nullptr), &team);
  team.sync();
  for (int64_t m = 0; m < M; ++m) silu_mul(sh.gate_up.data() + m * 2 * I, I, act.data() + m * I);
  packed_gemm(act.data(), I, M, I, wdown, H, sh.out.data(), H, static_cast<const float*>(nullptr), &team);
  team.sync();
  T* out = static_cast<T*>(a.out);
  const int64_t first = team.begin(M * H), last = team.end(M * H);
  for (int64_t i = 0; i < M * H; ++i) x[i] = sh.out[i] + res[i];  // the MLP's residual
  from_float(x.data() + first, last - first, out + first);
  if constexpr (!std::is_same_v<T, float>)  // the next layer's input: the output as rounded
    for (int64_t i = 0; i < M * H; ++i) x[i] = upper_half(bf16_bits(x[i]));
}

// A stack of L layers (layers[l + 1].x is layers[l].out), all of one dtype and weight kind, in one team: one parallel
// region, a sync after each of a layer's 6 shared steps.
template <typename T, typename W>
void decoder_layers_impl(const DecoderLayerArgs* layers, int64_t L) {
  const Widths widths(layers, L);
  Shared<T> shared(widths);
  run_team([&](const Team& team) {
    Own own(widths);
    to_float(static_cast<const T*>(layers[0].x), widths.rows * widths.hidden, own.x.data());
    for (int64_t l = 0; l < L; ++l) layer_on_thread<T, W>(layers[l], team, shared, own);
  });
}

// Kernel<T, W>::run(a) for the activations' dtype T (float32, bfloat16) and the weights' W (T, int8, or blocks).
template <template <typename, typename> class Kernel, typename T, class Args>
void by_weights(const Args& a) {
  switch (a.weights) {
    case PackedWeights::kInt8Rows: return Kernel<T, int8_t>::run(a);
    case PackedWeights::kQ4Blocks: return Kernel<T, Q4Blocks>::run(a);
    case PackedWeights::kQ8Blocks: return Kernel<T, Q8Blocks>::run(a);
    case PackedWeights::kQ4BlocksA8: return Kernel<T, Q4BlocksA8>::run(a);
    case PackedWeights::kQ8BlocksA8: return Kernel<T, Q8BlocksA8>::run(a);
    case PackedWeights::kFloat: return Kernel<T, T>::run(a);
  }
}

template <template <typename, typename> class Kernel, class Args>
void by_dtypes(const Args& a) {
  if (a.dtype == DType::kBFloat16) return by_weights<Kernel, c10::BFloat16>(a);
  by_weights<Kernel, float>(a);
}

template <typename T, typename W>
struct PackedLinearKernel {
  static void run(const PackedLinearArgs& a) { packed_linear_impl<T, W>(a); }
};

// by_dtypes' Args for decoder_layers: the stack's first layer names the dtype and weights of all.
struct LayerStack {
  const DecoderLayerArgs* layers;
  int64_t count;
  DType dtype;
  PackedWeights weights;
};

template <typename T, typename W>
struct DecoderLayersKernel {
  static void run(const LayerStack& s) { decoder_layers_impl<T, W>(s.layers, s.count); }
};

}  // namespace

void packed_linear(const PackedLinearArgs& a) { by_dtypes<PackedLinearKernel>(a); }

void decoder_layers(const DecoderLayerArgs* layers, int64_t L) {
  if (L < 1) return;
  for (int64_t l = 1; l < L; ++l)
    if (layers[l].dtype != layers[0].dtype || layers[l].weights != layers[0].weights) {  // a team for each layer
      for (int64_t i = 0; i < L; ++i) decoder_layers(layers + i, 1);
      return;
    }
  by_dtypes<DecoderLayersKernel>(LayerStack{layers, L, layers[0].dtype, layers[0].weights});
}

void decoder_layer(const DecoderLayerArgs& a) { decoder_layers(&a, 1); }

}  // namespace cpu
}  // namespace specdec
