// CPU kernels of a decoding step's matrix-vector products (packed_linear) and of a whole decoder layer
// (decoder_layer), float32.
//
// Why: a decode step or a verification multiplies a few rows (1 to K + 1 tokens) by every weight of the model once,
// so its time is the time to read the weights; on a 2-core AMD EPYC oneDNN's packed matmul read them at 0.7-0.8x the
// rate torch.sum reads a buffer, and the ~50 small torch ops of each layer (norms, RoPE, cache writes, views, the
// attention call) cost as much again in dispatch (bench/scale_probe.py: 1,570 ops a step for SmolLM2-135M).
//
// packed_linear reads W [N, K] stored as panels of 16 output features, [P, K, 16]: each step of the reduction over
// k loads one cache line (16 weights) and multiplies it by x[m, k] for every row m, so the weight streams front to
// back with the next lines prefetched. Every output sums its K products in one chain in k order, whatever the number
// of rows: a row's result is the same in a one-token step and in a verification of K + 1 tokens.
//
// decoder_layer runs a layer's whole forward in one call (llama.cpp's and gpt-fast's layer, without the
// dispatcher): RMS norm, the fused QKV product (+ bias), each head's q/k RMS norm (Qwen3), RoPE (rotate_half, as
// transformers' Llama), the keys and values written into the cache, attention (the decode_attention kernel, causal
// over each row's cache slot), the output product and its residual, then RMS norm, the gate/up product,
// SiLU(gate) * up, the down product and its residual.
#include "cpu/layer_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/cpu_math.h"

namespace specdec {
namespace cpu {
namespace {

constexpr int64_t kPanel = 16;          // output features per panel: one 64-byte line of float32 per k
constexpr int64_t kPrefetchLines = 32;  // lines ahead of the one being read (2 KB)
constexpr int64_t kMaxRowBlock = 6;     // rows sharing each load of a panel line (2 x 6 accumulators of 8 lanes)

// y[m, 0..width) (row stride ldy) = x[m, :] . panel columns for MB rows of x (row stride ldx).
template <int MB>
inline void panel_rows(const float* x, int64_t ldx, int64_t K, const float* w, float* y, int64_t ldy, int64_t width,
                       const float* bias) {
  float acc[MB][kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + (k + kPrefetchLines) * kPanel, 0, 0);
    const float* wk = w + k * kPanel;
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * ldx + k];
#pragma omp simd
      for (int l = 0; l < kPanel; ++l) acc[m][l] += wk[l] * xm;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t l = 0; l < width; ++l) y[m * ldy + l] = acc[m][l] + (bias != nullptr ? bias[l] : 0.0f);
}

// Panels [begin, end) of y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W packed [P, K, 16].
SPECDEC_CPU_CLONES void gemm_panels(int64_t begin, int64_t end, const float* x, int64_t ldx, int64_t M, int64_t K,
                                    const float* w, int64_t N, float* y, int64_t ldy, const float* bias) {
  for (int64_t p = begin; p < end; ++p) {
    const float* wp = w + p * K * kPanel;
    const int64_t col = p * kPanel, width = std::min(kPanel, N - col);
    const float* bp = bias != nullptr ? bias + col : nullptr;
    int64_t m = 0;
    for (; m + kMaxRowBlock <= M; m += kMaxRowBlock)
      panel_rows<kMaxRowBlock>(x + m * ldx, ldx, K, wp, y + m * ldy + col, ldy, width, bp);
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy + col;
    switch (M - m) {
      case 5: panel_rows<5>(xm, ldx, K, wp, ym, ldy, width, bp); break;
      case 4: panel_rows<4>(xm, ldx, K, wp, ym, ldy, width, bp); break;
      case 3: panel_rows<3>(xm, ldx, K, wp, ym, ldy, width, bp); break;
      case 2: panel_rows<2>(xm, ldx, K, wp, ym, ldy, width, bp); break;
      case 1: panel_rows<1>(xm, ldx, K, wp, ym, ldy, width, bp); break;
      default: break;
    }
  }
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) W^T (+ bias), W packed [P, K, 16]; panels split among threads.
void packed_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N, float* y, int64_t ldy,
                 const float* bias) {
  const int64_t P = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    gemm_panels(begin, end, x, ldx, M, K, w, N, y, ldy, bias);
  });
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

}  // namespace

void packed_linear(const PackedLinearArgs& a) {
  packed_gemm(a.x, a.in_features, a.rows, a.in_features, a.weight, a.out_features, a.out, a.out_features, a.bias);
}

void decoder_layer(const DecoderLayerArgs& a) {
  const int64_t B = a.batch, n = a.tokens, M = B * n, H = a.hidden;
  const int64_t Hq = a.heads, Hkv = a.kv_heads, D = a.head_dim, I = a.intermediate, C = a.columns;
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  std::vector<float> normed(M * H), qkv(M * QKV), attn(M * Hq * D), mid(M * H), gate_up(M * 2 * I), act(M * I);
  std::vector<float> tmp(D);
  std::vector<int64_t> starts(B), slots(B);

  rms_rows(a.x, H, M, H, a.input_norm, a.eps, normed.data(), H);
  packed_gemm(normed.data(), H, M, H, a.qkv, QKV, qkv.data(), QKV, a.qkv_bias);

  // each row's positions; q/k norms and RoPE; keys and values into the cache (positions past the last regular
  // column write the scratch column C - 1; RoPE past the table reads its last row)
  for (int64_t b = 0; b < B; ++b) {
    slots[b] = a.row_slots != nullptr ? a.row_slots[b] : b;
    starts[b] = a.lengths[slots[b]];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = starts[b] + i;
      const float* cs = a.cos + std::min(pos, a.positions - 1) * D;
      const float* sn = a.sin + std::min(pos, a.positions - 1) * D;
      const int64_t col = std::min(pos, C - 1);
      float* row = qkv.data() + (b * n + i) * QKV;
      for (int64_t h = 0; h < Hq + Hkv; ++h) {  // q heads, then k heads
        float* head = row + h * D;
        const float* norm = h < Hq ? a.q_norm : a.k_norm;
        if (norm != nullptr) rms_rows(head, D, 1, D, norm, a.eps, head, D);
        rope_row(head, cs, sn, D, tmp.data());
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = ((slots[b] * Hkv + h) * C + col) * D;
        std::memcpy(a.key_cache + at, row + (Hq + h) * D, D * sizeof(float));
        std::memcpy(a.value_cache + at, row + (Hq + Hkv + h) * D, D * sizeof(float));
      }
    }
  }

  DecodeAttentionArgs att{};
  att.dtype = DType::kFloat32;
  att.batch = B; att.q_heads = Hq; att.kv_heads = Hkv; att.queries = n; att.columns = C; att.head_dim = D;
  att.q = qkv.data();
  att.q_stride[0] = n * QKV; att.q_stride[1] = D; att.q_stride[2] = QKV;
  att.k = a.key_cache;
  att.v = a.value_cache;
  att.k_stride[0] = att.v_stride[0] = Hkv * C * D;
  att.k_stride[1] = att.v_stride[1] = C * D;
  att.k_stride[2] = att.v_stride[2] = D;
  att.mask = nullptr;
  att.starts = starts.data();
  att.rows = slots.data();
  att.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));  // D ** -0.5, as the model
  att.out = attn.data();
  decode_attention(att);

  packed_gemm(attn.data(), Hq * D, M, Hq * D, a.o, H, mid.data(), H, nullptr);
  for (int64_t i = 0; i < M * H; ++i) mid[i] += a.x[i];  // the attention block's residual
  rms_rows(mid.data(), H, M, H, a.post_norm, a.eps, normed.data(), H);
  packed_gemm(normed.data(), H, M, H, a.gate_up, 2 * I, gate_up.data(), 2 * I, nullptr);
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up.data() + m * 2 * I;
    float* o = act.data() + m * I;
    for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * g[I + j];  // SiLU(gate) * up
  }
  packed_gemm(act.data(), I, M, I, a.down, H, a.out, H, nullptr);
  for (int64_t i = 0; i < M * H; ++i) a.out[i] += mid[i];  // the MLP's residual
}

}  // namespace cpu
}  // namespace specdec
