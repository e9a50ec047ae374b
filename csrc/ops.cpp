// The one schema file: every specdec_ext op is declared here with TORCH_LIBRARY, and the CPU
// implementations are registered here. CUDA implementations register in bindings_cuda.cpp.
// The library is Python-free (no <Python.h>, not linked to libtorch_python): Python loads it with
// torch.ops.load_library (specdec_ext/ops.py), and a C++ program links it beside libtorch; either way,
// loading it runs the registrations below.
#include <torch/library.h>

#include "cpu/attention_cpu.h"
#include "cpu/layer_cpu.h"
#include "cpu/unpack_cpu.h"
#include "cpu/verify_cpu.h"
#include "ops_common.h"

namespace specdec {

std::tuple<at::Tensor, at::Tensor> chain_verify_cpu(const at::Tensor& ids, const at::Tensor& draft_probs,
                                                    const at::Tensor& target_probs, const std::optional<at::Tensor>& n,
                                                    const std::optional<at::Tensor>& u,
                                                    const std::optional<at::Tensor>& so, bool validate) {
  VerifyTensors t = prepare_verify(ids, draft_probs, target_probs, n, std::nullopt, u, so, false, validate);
  cpu::chain_verify(t.args);
  return {t.out_ids, t.num_accepted};
}

std::tuple<at::Tensor, at::Tensor> chain_verify_logits_cpu(const at::Tensor& ids, const at::Tensor& draft_logits,
                                                           const at::Tensor& target_logits, const at::Tensor& temperature,
                                                           const std::optional<at::Tensor>& n,
                                                           const std::optional<at::Tensor>& u,
                                                           const std::optional<at::Tensor>& so, bool validate) {
  VerifyTensors t = prepare_verify(ids, draft_logits, target_logits, n, temperature, u, so, true, validate);
  cpu::chain_verify_logits(t.args);
  return {t.out_ids, t.num_accepted};
}

std::tuple<at::Tensor, at::Tensor> chain_verify_greedy_cpu(const at::Tensor& ids, const at::Tensor& target_logits,
                                                           const std::optional<at::Tensor>& n) {
  VerifyTensors t = prepare_greedy(ids, target_logits, n);
  cpu::chain_verify_greedy(t.args);
  return {t.out_ids, t.num_accepted};
}

at::Tensor residual_sample_cpu(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                               const std::optional<at::Tensor>& u, const std::optional<at::Tensor>& so) {
  ResidualTensors t = prepare_residual(target_probs, draft_probs, u, so);
  cpu::residual_sample(t.args);
  return t.out;
}

std::tuple<at::Tensor, at::Tensor> acceptance_head_step_cpu(
    const std::optional<at::Tensor>& hidden, const std::optional<at::Tensor>& features,
    const std::optional<at::Tensor>& feature_weight, const std::optional<at::Tensor>& feature_bias,
    const at::Tensor& block_weight, const at::Tensor& block_bias, const at::Tensor& out_weight,
    const at::Tensor& out_bias, at::Tensor& cum_accept, int64_t candidate_length, int64_t k_min, int64_t k_max,
    double threshold, const std::optional<at::Tensor>& stop_below) {
  HeadTensors t = prepare_head(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                               out_bias, cum_accept, candidate_length, k_min, k_max, threshold, stop_below);
  cpu::acceptance_head_step(t.args);
  return {t.p_accept, t.stop};
}

at::Tensor argmax_tokens_cpu(const at::Tensor& logits) {
  ArgmaxTensors t = prepare_argmax(logits);
  if (t.out.numel() > 0) cpu::argmax_tokens(t.args);
  return t.out;
}

std::tuple<at::Tensor, at::Tensor> confidence_features_cpu(const at::Tensor& dist, const at::Tensor& tokens, bool logits) {
  ConfidenceTensors t = prepare_confidence(dist, tokens, logits);
  cpu::confidence_features(t.args);
  return {t.out, t.code};
}

at::Tensor decode_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& mask, double scale) {
  AttentionTensors t = prepare_attention(query, key, value, mask, scale);
  if (t.out.numel() > 0) cpu::decode_attention(t.args);
  return t.out;
}

at::Tensor cache_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const at::Tensor& starts, double scale) {
  CacheAttentionTensors c = prepare_cache_attention(query, key, value, starts, scale);
  DecodeAttentionArgs a{};  // the masked kernel without a mask: causal from each row's start
  static_cast<AttentionQKV&>(a) = c.args;
  a.mask = nullptr;
  a.starts = c.args.starts;
  a.scale = c.args.scale;
  a.out = c.args.out;
  if (c.out.numel() > 0) cpu::decode_attention(a);
  return c.out;
}

at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t out_features) {
  PackedLinearTensors t = prepare_packed_linear(x, weight, bias, out_features);
  if (t.out.numel() > 0) cpu::packed_linear(t.args);
  return t.out;
}

void unpack_linear_weight_cpu(const at::Tensor& weight, int64_t out_features, at::Tensor& out) {
  UnpackArgs a{};
  prepare_unpack(weight, out_features, out, a);
  cpu::unpack_linear_weight(a);
}

at::Tensor packed_rows_cpu(const at::Tensor& weight, const at::Tensor& ids, int64_t out_features,
                           at::ScalarType dtype) {
  PackedRowsTensors t = prepare_packed_rows(weight, ids, out_features, dtype);
  cpu::packed_rows(t.args);
  return t.out;
}

at::Tensor decoder_layer_cpu(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv,
                             const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
                             const std::optional<at::Tensor>& k_norm, const at::Tensor& o, const at::Tensor& post_norm,
                             const at::Tensor& gate_up, const at::Tensor& down, at::Tensor& key_cache,
                             at::Tensor& value_cache, const at::Tensor& lengths, const std::optional<at::Tensor>& slots,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t heads, double eps) {
  DecoderLayerTensors t = prepare_decoder_layer(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up,
                                                down, key_cache, value_cache, lengths, slots, cos, sin, heads, eps);
  cpu::decoder_layer(t.args);
  return t.out;
}

// decoder_layers: decoder_layer over a stack of L layers, the output of each the input of the next, in one call (one
// dispatch, not L: ~25 us a layer from Python on a 2-core Xeon, a sixth of SmolLM2-135M's one-token step). Each
// layer's arguments are checked as decoder_layer checks them; the lists must all hold L entries.
at::Tensor decoder_layers_cpu(const at::Tensor& x, at::TensorList input_norm, at::TensorList qkv,
                              const c10::List<std::optional<at::Tensor>>& qkv_bias,
                              const c10::List<std::optional<at::Tensor>>& q_norm,
                              const c10::List<std::optional<at::Tensor>>& k_norm, at::TensorList o,
                              at::TensorList post_norm, at::TensorList gate_up, at::TensorList down,
                              at::TensorList key_cache, at::TensorList value_cache, const at::Tensor& lengths,
                              const std::optional<at::Tensor>& slots, const at::Tensor& cos, const at::Tensor& sin,
                              int64_t heads, double eps) {
  const int64_t L = static_cast<int64_t>(input_norm.size());
  SPECDEC_CHK_VALUE(L >= 1, "decoder_layers: input_norm must hold a tensor per layer (at least one), got none");
  const std::pair<const char*, int64_t> lists[] = {
      {"qkv", qkv.size()},         {"qkv_bias", qkv_bias.size()}, {"q_norm", q_norm.size()},
      {"k_norm", k_norm.size()},   {"o", o.size()},               {"post_norm", post_norm.size()},
      {"gate_up", gate_up.size()}, {"down", down.size()},         {"key_cache", key_cache.size()},
      {"value_cache", value_cache.size()}};
  for (const auto& [name, size] : lists)
    SPECDEC_CHK_VALUE(size == L, "decoder_layers: ", name, " must hold ", L, " entries (one per layer, as input_norm), got ",
                      size);
  std::vector<DecoderLayerTensors> stack;  // every layer checked (and its output allocated) before any runs
  std::vector<DecoderLayerArgs> args;
  stack.reserve(L);
  args.reserve(L);
  for (int64_t l = 0; l < L; ++l) {
    stack.push_back(prepare_decoder_layer(l == 0 ? x : stack.back().out, input_norm[l], qkv[l], qkv_bias.get(l),
                                          q_norm.get(l), k_norm.get(l), o[l], post_norm[l], gate_up[l], down[l],
                                          key_cache[l], value_cache[l], lengths, slots, cos, sin, heads, eps));
    args.push_back(stack.back().args);
  }
  cpu::decoder_layers(args.data(), L);
  return stack.back().out;
}

void advance_rows_cpu(at::Tensor& last, const std::optional<at::Tensor>& prev, const std::optional<at::Tensor>& room,
                      const std::optional<at::Tensor>& seed_offsets, const at::Tensor& emitted,
                      const std::optional<at::Tensor>& accepted, int64_t rows) {
  AdvanceTensors t = prepare_advance(last, prev, room, seed_offsets, emitted, accepted, rows);
  cpu::advance_rows(t.args);
}

at::Tensor philox_uniforms_cpu(const at::Tensor& seed_offsets, int64_t slots, int64_t first_slot) {
  PhiloxTensors t = prepare_philox(seed_offsets, slots, first_slot);
  cpu::philox_uniforms(t.args);
  return t.out;
}

TORCH_LIBRARY(specdec_ext, m) {
  m.def(
      "chain_verify(Tensor draft_token_ids, Tensor draft_probs, Tensor target_probs, Tensor? num_draft_tokens=None, "
      "Tensor? uniforms=None, Tensor? philox_seed_offset=None, bool validate=False) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "chain_verify_logits(Tensor draft_token_ids, Tensor draft_logits, Tensor target_logits, Tensor temperature, "
      "Tensor? num_draft_tokens=None, Tensor? uniforms=None, Tensor? philox_seed_offset=None, bool validate=False) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "chain_verify_greedy(Tensor draft_token_ids, Tensor target_logits, Tensor? num_draft_tokens=None) "
      "-> (Tensor output_token_ids, Tensor num_accepted)");
  m.def(
      "residual_sample(Tensor target_probs, Tensor draft_probs, Tensor? uniforms=None, "
      "Tensor? philox_seed_offset=None) -> Tensor");
  m.def(
      "acceptance_head_step(Tensor? hidden, Tensor? features, Tensor? feature_weight, Tensor? feature_bias, "
      "Tensor block_weight, Tensor block_bias, Tensor out_weight, Tensor out_bias, Tensor(a!) cum_accept, "
      "int candidate_length, int k_min, int k_max, float threshold, Tensor? stop_below=None) "
      "-> (Tensor p_accept, Tensor stop)");
  m.def("confidence_features(Tensor dist, Tensor tokens, bool logits) -> (Tensor features, Tensor code)");
  m.def("argmax_tokens(Tensor logits) -> Tensor");
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
  m.def("cache_attention(Tensor query, Tensor key, Tensor value, Tensor starts, float scale) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor");
  m.def("unpack_linear_weight(Tensor weight, int out_features, Tensor(a!) out) -> ()");
  m.def("packed_rows(Tensor weight, Tensor ids, int out_features, ScalarType dtype) -> Tensor");
  m.def(
      "decoder_layer(Tensor x, Tensor input_norm, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
      "Tensor o, Tensor post_norm, Tensor gate_up, Tensor down, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor lengths, Tensor? slots, Tensor cos, Tensor sin, int heads, float eps) -> Tensor");
  m.def(
      "decoder_layers(Tensor x, Tensor[] input_norm, Tensor[] qkv, Tensor?[] qkv_bias, Tensor?[] q_norm, "
      "Tensor?[] k_norm, Tensor[] o, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, Tensor(a!)[] key_cache, "
      "Tensor(b!)[] value_cache, Tensor lengths, Tensor? slots, Tensor cos, Tensor sin, int heads, float eps) -> Tensor");
  m.def("philox_uniforms(Tensor seed_offsets, int slots, int first_slot=0) -> Tensor");
  m.def("advance_rows(Tensor(a!) last, Tensor(b!)? prev, Tensor(c!)? room, Tensor(d!)? seed_offsets, Tensor emitted, "
        "Tensor? accepted, int rows) -> ()");
  // CUDA graphs with conditional nodes, composed from pieces torch captured (csrc/cuda/graphs.cu; CUDA only): the
  // device tensor `anchor` names the device; graphs are cudaGraph_t / cudaGraphExec_t handles as integers
  m.def("graph_chain(Tensor anchor, int[] pieces, Tensor[] flags) -> int");
  m.def("graph_launch(Tensor anchor, int graph) -> ()");
  m.def("graph_destroy(Tensor anchor, int graph) -> ()");
}

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  m.impl("chain_verify", &chain_verify_cpu);
  m.impl("chain_verify_logits", &chain_verify_logits_cpu);
  m.impl("chain_verify_greedy", &chain_verify_greedy_cpu);
  m.impl("residual_sample", &residual_sample_cpu);
  m.impl("acceptance_head_step", &acceptance_head_step_cpu);
  m.impl("confidence_features", &confidence_features_cpu);
  m.impl("argmax_tokens", &argmax_tokens_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("cache_attention", &cache_attention_cpu);
  m.impl("packed_linear", &packed_linear_cpu);
  m.impl("unpack_linear_weight", &unpack_linear_weight_cpu);
  m.impl("packed_rows", &packed_rows_cpu);
  m.impl("decoder_layer", &decoder_layer_cpu);
  m.impl("decoder_layers", &decoder_layers_cpu);
  m.impl("philox_uniforms", &philox_uniforms_cpu);
  m.impl("advance_rows", &advance_rows_cpu);
}

}  // namespace specdec
