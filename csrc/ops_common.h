// Torch glue shared by the CPU registrations (ops.cpp) and the CUDA ones (bindings_cuda.cpp):
// argument checks that name the argument, and conversion of tensors into the torch-free
// argument blocks of kernels/args.h.
#pragma once
#include <torch/library.h>
// Tensor's methods and the three factories used here, not <ATen/ATen.h> (every op's header): the glue
// compiles in half the time
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "check_msg.h"
#include "kernels/args.h"

namespace specdec {

inline DType float_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default:
      SPECDEC_CHK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

inline void check_index_dtype(const at::Tensor& t, const char* name) {
  SPECDEC_CHK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name, " must be int32 or int64, got ",
                   t.scalar_type());
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* name, const char* ref_name) {
  SPECDEC_CHK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
}

// Randomness: exactly one of uniforms [B, slots] float32 in (0, 1] or philox_seed_offset [2] int64.
struct RandomTensors {
  at::Tensor uniforms, seed_offset;
  UniformSource source() const {
    UniformSource s{};
    if (uniforms.defined()) {
      s.explicit_u = uniforms.data_ptr<float>();
      s.stride = uniforms.dim() == 2 ? uniforms.size(1) : 1;
    } else {
      s.seed_offset = seed_offset.data_ptr<int64_t>();
    }
    return s;
  }
};

inline RandomTensors check_random(const std::optional<at::Tensor>& uniforms, const std::optional<at::Tensor>& seed_offset,
                                  at::IntArrayRef uniform_shape, const at::Tensor& ref, const char* op) {
  SPECDEC_CHK_VALUE(uniforms.has_value() != seed_offset.has_value(), op,
                    ": pass exactly one of uniforms or philox_seed_offset");
  RandomTensors r;
  if (uniforms.has_value()) {
    const at::Tensor& u = *uniforms;
    SPECDEC_CHK_TYPE(u.scalar_type() == at::kFloat, op, ": uniforms must be float32, got ", u.scalar_type());
    SPECDEC_CHK_VALUE(u.sizes() == uniform_shape, op, ": uniforms must have shape ", uniform_shape, ", got ", u.sizes());
    check_device(u, ref, "uniforms", "the probabilities");
    r.uniforms = u.contiguous();
  } else {
    const at::Tensor& so = *seed_offset;
    SPECDEC_CHK_TYPE(so.scalar_type() == at::kLong, op, ": philox_seed_offset must be int64, got ", so.scalar_type());
    SPECDEC_CHK_VALUE(so.dim() == 1 && so.size(0) == 2, op, ": philox_seed_offset must have shape [2], got ", so.sizes());
    check_device(so, ref, "philox_seed_offset", "the probabilities");
    r.seed_offset = so.contiguous();
  }
  return r;
}

// Everything chain_verify / chain_verify_logits need, checked; owns the contiguous copies.
struct VerifyTensors {
  at::Tensor ids, draft, target, num_draft, temperature, out_ids, num_accepted;
  RandomTensors rnd;
  VerifyArgs args;
};

inline VerifyTensors prepare_verify(const at::Tensor& draft_token_ids, const at::Tensor& draft, const at::Tensor& target,
                                    const std::optional<at::Tensor>& num_draft_tokens,
                                    const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& uniforms,
                                    const std::optional<at::Tensor>& seed_offset, bool logits, bool validate) {
  const char* op = logits ? "chain_verify_logits" : "chain_verify";
  const char* dname = logits ? "draft_logits" : "draft_probs";
  const char* tname = logits ? "target_logits" : "target_probs";
  check_index_dtype(draft_token_ids, "draft_token_ids");
  SPECDEC_CHK_VALUE(draft_token_ids.dim() == 2, op, ": draft_token_ids must be [B, K], got shape ", draft_token_ids.sizes());
  const int64_t B = draft_token_ids.size(0), K = draft_token_ids.size(1);
  SPECDEC_CHK_VALUE(K >= 1, op, ": the candidate length K (draft_token_ids.shape[1]) must be >= 1, got 0");
  const DType dt = float_dtype(draft, dname);
  SPECDEC_CHK_TYPE(target.scalar_type() == draft.scalar_type(), op, ": ", tname, " has dtype ", target.scalar_type(),
                   " but ", dname, " has ", draft.scalar_type());
  SPECDEC_CHK_VALUE(draft.dim() == 3 && draft.size(0) == B && draft.size(1) == K, op, ": ", dname,
                    " must be [B, K, V] = [", B, ", ", K, ", V], got ", draft.sizes());
  const int64_t V = draft.size(2);
  SPECDEC_CHK_VALUE(V >= 1, op, ": vocabulary size V must be >= 1");
  SPECDEC_CHK_VALUE(target.dim() == 3 && target.size(0) == B && target.size(1) == K + 1, op, ": ", tname,
                    " must be [B, K+1, V] = [", B, ", ", K + 1, ", V], got ", target.sizes());
  SPECDEC_CHK_VALUE(target.size(2) == V, op, ": vocabulary mismatch: ", dname, " has V = ", V, " but ", tname, " has V = ",
                    target.size(2));
  check_device(draft_token_ids, target, "draft_token_ids", tname);
  check_device(draft, target, dname, tname);
  VerifyTensors t;
  t.ids = draft_token_ids.to(at::kLong).contiguous();
  t.draft = draft.contiguous();
  t.target = target.contiguous();
  if (num_draft_tokens.has_value()) {
    const at::Tensor& n = *num_draft_tokens;
    check_index_dtype(n, "num_draft_tokens");
    SPECDEC_CHK_VALUE(n.dim() == 1 && n.size(0) == B, op, ": num_draft_tokens must be [B] = [", B, "], got ", n.sizes());
    check_device(n, target, "num_draft_tokens", tname);
    t.num_draft = n.to(at::kLong).contiguous();
    if (n.device().is_cpu()) {  // a loop over B values: no dispatcher calls on the hot path
      const int64_t* nd = t.num_draft.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b)
        SPECDEC_CHK_VALUE(nd[b] >= 0 && nd[b] <= K, op, ": ", error_message(kInvalidNumDraft, logits), " = [0, ", K,
                          "], got ", nd[b], " in row ", b);
    }
  }
  if (logits) {
    SPECDEC_CHK_VALUE(temperature.has_value(), op, ": temperature [B] is required");
    const at::Tensor& tt = *temperature;
    SPECDEC_CHK_TYPE(tt.scalar_type() == at::kFloat, op, ": temperature must be float32, got ", tt.scalar_type());
    SPECDEC_CHK_VALUE(tt.dim() == 1 && tt.size(0) == B, op, ": temperature must be [B] = [", B, "], got ", tt.sizes());
    check_device(tt, target, "temperature", tname);
    t.temperature = tt.contiguous();
    if (tt.device().is_cpu()) {
      const float* tp = t.temperature.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        SPECDEC_CHK_VALUE(tp[b] >= 0.0f && tp[b] <= 3.4028234663852886e38f, op,
                          ": temperature must be finite and >= 0 (0 means greedy), got ", tp[b], " in row ", b);
        SPECDEC_CHK_VALUE(tp[b] == 0.0f || tp[b] >= kMinTemperature, op, ": ", error_message(kInvalidTemperature, true),
                          ", got ", tp[b], " in row ", b);
      }
    }
  }
  t.rnd = check_random(uniforms, seed_offset, {B, K + 1}, target, op);
  t.out_ids = at::empty({B, K + 1}, target.options().dtype(at::kLong));
  t.num_accepted = at::empty({B}, target.options().dtype(at::kLong));
  VerifyArgs& a = t.args;
  a.dtype = dt;
  a.batch = B; a.k = K; a.vocab = V;
  a.ids = t.ids.data_ptr<int64_t>();
  a.draft = t.draft.data_ptr();
  a.target = t.target.data_ptr();
  a.num_draft = t.num_draft.defined() ? t.num_draft.data_ptr<int64_t>() : nullptr;
  a.temperature = t.temperature.defined() ? t.temperature.data_ptr<float>() : nullptr;
  a.rng = t.rnd.source();
  a.out_ids = t.out_ids.data_ptr<int64_t>();
  a.num_accepted = t.num_accepted.data_ptr<int64_t>();
  a.validate = validate;
  return t;
}

// chain_verify_greedy: the target's logits only (no draft distribution, no randomness).
inline VerifyTensors prepare_greedy(const at::Tensor& draft_token_ids, const at::Tensor& target,
                                    const std::optional<at::Tensor>& num_draft_tokens) {
  const char* op = "chain_verify_greedy";
  check_index_dtype(draft_token_ids, "draft_token_ids");
  SPECDEC_CHK_VALUE(draft_token_ids.dim() == 2, op, ": draft_token_ids must be [B, K], got shape ", draft_token_ids.sizes());
  const int64_t B = draft_token_ids.size(0), K = draft_token_ids.size(1);
  SPECDEC_CHK_VALUE(K >= 1, op, ": the candidate length K (draft_token_ids.shape[1]) must be >= 1, got 0");
  const DType dt = float_dtype(target, "target_logits");
  SPECDEC_CHK_VALUE(target.dim() == 3 && target.size(0) == B && target.size(1) == K + 1 && target.size(2) >= 1, op,
                    ": target_logits must be [B, K+1, V] = [", B, ", ", K + 1, ", V], got ", target.sizes());
  check_device(draft_token_ids, target, "draft_token_ids", "target_logits");
  VerifyTensors t;
  t.ids = draft_token_ids.to(at::kLong).contiguous();
  t.target = target.contiguous();
  if (num_draft_tokens.has_value()) {
    const at::Tensor& n = *num_draft_tokens;
    check_index_dtype(n, "num_draft_tokens");
    SPECDEC_CHK_VALUE(n.dim() == 1 && n.size(0) == B, op, ": num_draft_tokens must be [B] = [", B, "], got ", n.sizes());
    check_device(n, target, "num_draft_tokens", "target_logits");
    t.num_draft = n.to(at::kLong).contiguous();
  }
  t.out_ids = at::empty({B, K + 1}, target.options().dtype(at::kLong));
  t.num_accepted = at::empty({B}, target.options().dtype(at::kLong));
  VerifyArgs& a = t.args;
  a = VerifyArgs{};
  a.dtype = dt;
  a.batch = B; a.k = K; a.vocab = target.size(2);
  a.ids = t.ids.data_ptr<int64_t>();
  a.target = t.target.data_ptr();
  a.num_draft = t.num_draft.defined() ? t.num_draft.data_ptr<int64_t>() : nullptr;
  a.out_ids = t.out_ids.data_ptr<int64_t>();
  a.num_accepted = t.num_accepted.data_ptr<int64_t>();
  return t;
}

struct ResidualTensors {
  at::Tensor target, draft, out;
  RandomTensors rnd;
  ResidualArgs args;
};

inline ResidualTensors prepare_residual(const at::Tensor& target, const at::Tensor& draft,
                                        const std::optional<at::Tensor>& uniforms,
                                        const std::optional<at::Tensor>& seed_offset) {
  const DType dt = float_dtype(target, "target_probs");
  SPECDEC_CHK_TYPE(draft.scalar_type() == target.scalar_type(), "residual_sample: draft_probs has dtype ",
                   draft.scalar_type(), " but target_probs has ", target.scalar_type());
  SPECDEC_CHK_VALUE(target.dim() == 2, "residual_sample: target_probs must be [B, V], got ", target.sizes());
  SPECDEC_CHK_VALUE(draft.dim() == 2 && draft.size(0) == target.size(0), "residual_sample: draft_probs must be [B, V] = [",
                    target.size(0), ", V], got ", draft.sizes());
  SPECDEC_CHK_VALUE(draft.size(1) == target.size(1), "residual_sample: vocabulary mismatch: target_probs has V = ",
                    target.size(1), " but draft_probs has V = ", draft.size(1));
  SPECDEC_CHK_VALUE(target.size(1) >= 1, "residual_sample: vocabulary size V must be >= 1");
  check_device(draft, target, "draft_probs", "target_probs");
  ResidualTensors t;
  t.target = target.contiguous();
  t.draft = draft.contiguous();
  t.rnd = check_random(uniforms, seed_offset, {target.size(0)}, target, "residual_sample");
  t.out = at::empty({target.size(0)}, target.options().dtype(at::kLong));
  t.args = ResidualArgs{dt, target.size(0), target.size(1), t.target.data_ptr(), t.draft.data_ptr(), t.rnd.source(),
                        t.out.data_ptr<int64_t>()};
  return t;
}

struct ArgmaxTensors {
  at::Tensor logits, out;
  ArgmaxArgs args;
};

// argmax_tokens: logits [..., V] (at least one dimension, V >= 1) -> [...] int64.
inline ArgmaxTensors prepare_argmax(const at::Tensor& logits) {
  const char* op = "argmax_tokens";
  const DType dt = float_dtype(logits, "logits");
  SPECDEC_CHK_VALUE(logits.dim() >= 1 && logits.size(-1) >= 1, op,
                    ": logits must be [..., V] with V >= 1 (the vocabulary last), got shape ", logits.sizes());
  ArgmaxTensors t;
  t.logits = logits.contiguous();
  const int64_t V = logits.size(-1);
  t.out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kLong));
  t.args = ArgmaxArgs{dt, logits.numel() / V, V, t.logits.data_ptr(), t.out.data_ptr<int64_t>()};
  return t;
}

struct PhiloxTensors {
  at::Tensor seed_offsets, out;
  PhiloxArgs args;
};

// philox_uniforms: seed_offsets [B, 2] int64 -> [B, slots] float32 from counter slots first_slot .. first_slot + slots - 1.
inline PhiloxTensors prepare_philox(const at::Tensor& seed_offsets, int64_t slots, int64_t first_slot) {
  const char* op = "philox_uniforms";
  SPECDEC_CHK_TYPE(seed_offsets.scalar_type() == at::kLong, op, ": seed_offsets must be int64, got ",
                   seed_offsets.scalar_type());
  SPECDEC_CHK_VALUE(seed_offsets.dim() == 2 && seed_offsets.size(1) == 2, op,
                    ": seed_offsets must be [B, 2] (a seed and an offset per row), got shape ", seed_offsets.sizes());
  SPECDEC_CHK_VALUE(slots >= 0 && first_slot >= 0 && first_slot + slots <= (int64_t(1) << 32), op,
                    ": slots and first_slot must be >= 0 with first_slot + slots <= 2**32 (Philox counter slots), got ",
                    slots, " and ", first_slot);
  PhiloxTensors t;
  t.seed_offsets = seed_offsets.contiguous();
  t.out = at::empty({seed_offsets.size(0), slots}, seed_offsets.options().dtype(at::kFloat));
  t.args = PhiloxArgs{seed_offsets.size(0), slots, first_slot, t.seed_offsets.data_ptr<int64_t>(), t.out.data_ptr<float>()};
  return t;
}

struct AdvanceTensors {
  at::Tensor emitted, accepted;
  AdvanceArgs args;
};

// advance_rows: the in-place tensors (last, prev, room, seed_offsets) int64, contiguous, on emitted's device, with at
// least `rows` rows; emitted [>= rows, W >= 1] int64; accepted [>= rows] int64 or none.
inline AdvanceTensors prepare_advance(at::Tensor& last, const std::optional<at::Tensor>& prev,
                                      const std::optional<at::Tensor>& room,
                                      const std::optional<at::Tensor>& seed_offsets, const at::Tensor& emitted,
                                      const std::optional<at::Tensor>& accepted, int64_t rows) {
  const char* op = "advance_rows";
  SPECDEC_CHK_TYPE(emitted.scalar_type() == at::kLong, op, ": emitted must be int64, got ", emitted.scalar_type());
  SPECDEC_CHK_VALUE(emitted.dim() == 2 && emitted.size(1) >= 1, op, ": emitted must be [B, W] with W >= 1, got shape ",
                    emitted.sizes());
  SPECDEC_CHK_VALUE(rows >= 0 && rows <= emitted.size(0), op, ": rows must be in 0 .. ", emitted.size(0),
                    " (emitted's rows), got ", rows);
  auto check = [&](const at::Tensor& t, const char* name, int64_t dim, bool written) {
    SPECDEC_CHK_TYPE(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t.scalar_type());
    SPECDEC_CHK_VALUE(t.dim() == dim && t.size(0) >= rows && (dim == 1 || t.size(1) == 2), op, ": ", name,
                      dim == 1 ? " must be [B] with B >= rows (" : " must be [B, 2] with B >= rows (", rows,
                      "), got shape ", t.sizes());
    SPECDEC_CHK_VALUE(!written || t.is_contiguous(), op, ": ", name, " must be contiguous (it is written in place)");
    check_device(t, emitted, name, "emitted");
  };
  check(last, "last", 1, true);
  if (prev) check(*prev, "prev", 1, true);
  if (room) check(*room, "room", 1, true);
  if (seed_offsets) check(*seed_offsets, "seed_offsets", 2, true);
  AdvanceTensors t;
  t.emitted = emitted.contiguous();
  if (accepted) {
    check(*accepted, "accepted", 1, false);
    t.accepted = accepted->contiguous();
  }
  auto ptr = [](const std::optional<at::Tensor>& x) { return x ? x->data_ptr<int64_t>() : nullptr; };
  t.args = AdvanceArgs{rows, emitted.size(1), t.emitted.data_ptr<int64_t>(),
                       accepted ? t.accepted.data_ptr<int64_t>() : nullptr, last.data_ptr<int64_t>(), ptr(prev),
                       ptr(room), ptr(seed_offsets)};
  return t;
}

struct ConfidenceTensors {
  at::Tensor dist, tokens, out, code;
  ConfidenceArgs args;
};

inline ConfidenceTensors prepare_confidence(const at::Tensor& dist, const at::Tensor& tokens, bool logits) {
  const char* op = "confidence_features";
  const char* name = logits ? "draft_logits" : "draft_probs";
  const DType dt = float_dtype(dist, name);
  SPECDEC_CHK_VALUE(dist.dim() == 2 && dist.size(1) >= 1, op, ": ", name, " must be [B, V] with V >= 1, got ", dist.sizes());
  check_index_dtype(tokens, "tokens");
  SPECDEC_CHK_VALUE(tokens.dim() == 1 && tokens.size(0) == dist.size(0), op, ": tokens must be [B] = [", dist.size(0),
                    "], got ", tokens.sizes());
  check_device(tokens, dist, "tokens", name);
  ConfidenceTensors t;
  t.dist = dist.contiguous();
  t.tokens = tokens.to(at::kLong).contiguous();
  t.out = at::empty({dist.size(0), 3}, dist.options().dtype(at::kFloat));
  t.code = at::zeros({dist.size(0)}, dist.options().dtype(at::kLong));
  t.args = ConfidenceArgs{dt, dist.size(0), dist.size(1), t.dist.data_ptr(), t.tokens.data_ptr<int64_t>(), logits,
                          t.out.data_ptr<float>(), t.code.data_ptr<int64_t>()};
  return t;
}

struct HeadTensors {
  at::Tensor hidden, features, fw, fb, w, b, ow, ob, p_accept, stop, stop_below;
  HeadArgs args;
};

// acceptance_head_step: x_0 = hidden + feature_weight @ features + feature_bias (either part may be
// absent), L residual blocks, the output layer. H is the head's width (out_weight's length).
inline HeadTensors prepare_head(const std::optional<at::Tensor>& hidden, const std::optional<at::Tensor>& features,
                                const std::optional<at::Tensor>& feature_weight,
                                const std::optional<at::Tensor>& feature_bias, const at::Tensor& block_weight,
                                const at::Tensor& block_bias, const at::Tensor& out_weight, const at::Tensor& out_bias,
                                at::Tensor& cum_accept, int64_t candidate_length, int64_t k_min, int64_t k_max,
                                double threshold, const std::optional<at::Tensor>& stop_below) {
  const char* op = "acceptance_head_step";
  SPECDEC_CHK_VALUE(hidden.has_value() || features.has_value(), op,
                    ": pass hidden [B, H], features [B, F], or both (the head reads nothing otherwise)");
  SPECDEC_CHK_VALUE(out_weight.dim() == 1, op, ": out_weight must be [H], got ", out_weight.sizes());
  const int64_t H = out_weight.size(0);
  const at::Tensor& ref = hidden.has_value() ? *hidden : *features;
  const char* ref_name = hidden.has_value() ? "hidden" : "features";
  SPECDEC_CHK_VALUE(ref.dim() == 2, op, ": ", ref_name, " must be [B, ", hidden.has_value() ? "H" : "F", "], got ",
                    ref.sizes());
  const int64_t B = ref.size(0);
  DType dt = DType::kFloat32;
  if (hidden.has_value()) {
    dt = float_dtype(*hidden, "hidden");
    SPECDEC_CHK_VALUE(hidden->size(1) == H, op, ": hidden must be [B, H] with H = ", H,
                      " (the head's width, out_weight's length), got ", hidden->sizes(),
                      ": this head belongs to a draft with another hidden size");
  }
  int64_t F = 0;
  if (features.has_value()) {
    const at::Tensor& f = *features;
    SPECDEC_CHK_TYPE(f.scalar_type() == at::kFloat, op, ": features must be float32, got ", f.scalar_type());
    SPECDEC_CHK_VALUE(f.dim() == 2 && f.size(0) == B, op, ": features must be [B, F] with B = ", B, ", got ", f.sizes());
    F = f.size(1);
    SPECDEC_CHK_VALUE(feature_weight.has_value() && feature_bias.has_value(), op,
                      ": features need feature_weight [H, F] and feature_bias [H]");
    SPECDEC_CHK_VALUE(feature_weight->dim() == 2 && feature_weight->size(0) == H && feature_weight->size(1) == F, op,
                      ": feature_weight must be [H, F] = [", H, ", ", F, "], got ", feature_weight->sizes());
    SPECDEC_CHK_VALUE(feature_bias->dim() == 1 && feature_bias->size(0) == H, op, ": feature_bias must be [H] = [", H,
                      "], got ", feature_bias->sizes());
  } else {
    SPECDEC_CHK_VALUE(!feature_weight.has_value() && !feature_bias.has_value(), op,
                      ": feature_weight / feature_bias given without features");
  }
  SPECDEC_CHK_VALUE(block_weight.dim() == 3 && block_weight.size(1) == H && block_weight.size(2) == H, op,
                    ": block_weight must be [L, H, H] with H = ", H, ", got ", block_weight.sizes());
  const int64_t L = block_weight.size(0);
  SPECDEC_CHK_VALUE(block_bias.dim() == 2 && block_bias.size(0) == L && block_bias.size(1) == H, op,
                    ": block_bias must be [L, H] = [", L, ", ", H, "], got ", block_bias.sizes());
  SPECDEC_CHK_VALUE(out_bias.numel() == 1, op, ": out_bias must have one element, got ", out_bias.sizes());
  SPECDEC_CHK_VALUE(cum_accept.dim() == 1 && cum_accept.size(0) == B, op, ": cum_accept must be [B] = [", B, "], got ",
                    cum_accept.sizes());
  std::vector<const at::Tensor*> f32 = {&block_weight, &block_bias, &out_weight, &out_bias, &cum_accept};
  if (feature_weight.has_value()) f32.push_back(&*feature_weight);
  if (feature_bias.has_value()) f32.push_back(&*feature_bias);
  for (const at::Tensor* p : f32) {
    SPECDEC_CHK_TYPE(p->scalar_type() == at::kFloat, op, ": head weights and cum_accept must be float32, got ",
                     p->scalar_type());
    check_device(*p, ref, "head weights and cum_accept", ref_name);
  }
  if (hidden.has_value() && features.has_value()) check_device(*features, *hidden, "features", "hidden");
  SPECDEC_CHK_VALUE(cum_accept.is_contiguous(), op, ": cum_accept must be contiguous (it is updated in place)");
  SPECDEC_CHK_VALUE(candidate_length >= 1, op,
                    ": candidate_length (the round's candidate length K if drafting stopped now) must be >= 1, got ",
                    candidate_length);
  SPECDEC_CHK_VALUE(k_min >= 1 && k_min <= k_max, op, ": need 1 <= k_min <= k_max, got k_min = ", k_min,
                    ", k_max = ", k_max);
  SPECDEC_CHK_VALUE(threshold >= 0.0 && threshold <= 1.0, op, ": stop threshold must lie in [0, 1], got ", threshold);
  HeadTensors t;
  if (hidden.has_value()) t.hidden = hidden->contiguous();
  if (features.has_value()) {
    t.features = features->contiguous();
    t.fw = feature_weight->contiguous();
    t.fb = feature_bias->contiguous();
  }
  t.w = block_weight.contiguous();
  t.b = block_bias.contiguous();
  t.ow = out_weight.contiguous();
  t.ob = out_bias.contiguous();
  t.p_accept = at::empty({B}, ref.options().dtype(at::kFloat));
  t.stop = at::empty({B}, ref.options().dtype(at::kBool));
  t.args = HeadArgs{dt, B, H, L, F,
                    t.hidden.defined() ? t.hidden.data_ptr() : nullptr,
                    t.features.defined() ? t.features.data_ptr<float>() : nullptr,
                    t.fw.defined() ? t.fw.data_ptr<float>() : nullptr,
                    t.fb.defined() ? t.fb.data_ptr<float>() : nullptr,
                    t.w.data_ptr<float>(), t.b.data_ptr<float>(), t.ow.data_ptr<float>(), t.ob.data_ptr<float>(),
                    cum_accept.data_ptr<float>(), t.p_accept.data_ptr<float>(), t.stop.data_ptr<bool>(),
                    candidate_length, k_min, k_max, static_cast<float>(threshold)};
  if (stop_below.has_value()) {
    const at::Tensor& s = *stop_below;
    SPECDEC_CHK_TYPE(s.scalar_type() == at::kFloat, op, ": stop_below must be float32, got ", s.scalar_type());
    SPECDEC_CHK_VALUE(s.dim() == 1 && s.size(0) == B, op, ": stop_below must be [B] = [", B, "], got ", s.sizes());
    SPECDEC_CHK_VALUE(s.device() == cum_accept.device(), op, ": stop_below must be on cum_accept's device (",
                      cum_accept.device(), "), got ", s.device());
    t.stop_below = s.contiguous();
    t.args.stop_below = t.stop_below.data_ptr<float>();
  }
  return t;
}

struct AttentionTensors {
  at::Tensor q, k, v, mask, out;
  DecodeAttentionArgs args;
};

// The checks and layout both attention ops share: query [B, Hq, n, D] with n, D >= 1 (and D <= max_head_dim where
// given: > 0), key and value [B, Hkv, C, D] of query's dtype and device, Hq a multiple of Hkv. Fills `a`'s shape,
// pointers and strides from q, k, v: the inputs, copied where the head dimension is not contiguous.
inline void prepare_qkv(const char* op, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        int64_t max_head_dim, at::Tensor& q, at::Tensor& k, at::Tensor& v, AttentionQKV& a) {
  const DType dt = float_dtype(query, "query");
  SPECDEC_CHK_TYPE(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), op,
                   ": key and value must have query's dtype ", query.scalar_type(), ", got ", key.scalar_type(), " and ",
                   value.scalar_type());
  const std::string bound = max_head_dim > 0 ? " and 1 <= D <= " + std::to_string(max_head_dim) : ", D >= 1";
  SPECDEC_CHK_VALUE(query.dim() == 4 && query.size(2) >= 1 && query.size(3) >= 1 &&
                        (max_head_dim <= 0 || query.size(3) <= max_head_dim),
                    op, ": query must be [B, Hq, n, D] with n", max_head_dim > 0 ? " >= 1" : "", bound, ", got ",
                    query.sizes());
  const int64_t B = query.size(0), Hq = query.size(1), n = query.size(2), D = query.size(3);
  SPECDEC_CHK_VALUE(key.dim() == 4 && key.size(0) == B && key.size(1) >= 1 && key.size(2) >= 1 && key.size(3) == D, op,
                    ": key must be [B, Hkv, C, D] = [", B, ", Hkv, C, ", D, "] with Hkv, C >= 1, got ", key.sizes());
  SPECDEC_CHK_VALUE(value.sizes() == key.sizes(), op, ": value must have key's shape ", key.sizes(), ", got ",
                    value.sizes());
  const int64_t Hkv = key.size(1), C = key.size(2);
  SPECDEC_CHK_VALUE(Hq % Hkv == 0, op, ": query heads (", Hq, ") must be a multiple of key/value heads (", Hkv, ")");
  check_device(key, query, "key", "query");
  check_device(value, query, "value", "query");
  q = query.stride(3) == 1 ? query : query.contiguous();
  k = key.stride(3) == 1 ? key : key.contiguous();
  v = value.stride(3) == 1 ? value : value.contiguous();
  a.dtype = dt;
  a.batch = B; a.q_heads = Hq; a.kv_heads = Hkv; a.queries = n; a.columns = C; a.head_dim = D;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = q.stride(d);
    a.k_stride[d] = k.stride(d);
    a.v_stride[d] = v.stride(d);
  }
}

// decode_attention: query [B, Hq, n, D], key and value [B, Hkv, C, D] (any strides; a head dimension that is
// not contiguous is copied), mask bool [B or 1, Hq or 1, n, C] (any strides; size-1 dimensions broadcast).
inline AttentionTensors prepare_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          const at::Tensor& mask, double scale) {
  const char* op = "decode_attention";
  AttentionTensors t;
  DecodeAttentionArgs& a = t.args;
  a = DecodeAttentionArgs{};
  prepare_qkv(op, query, key, value, 0, t.q, t.k, t.v, a);
  const int64_t B = a.batch, Hq = a.q_heads, n = a.queries, C = a.columns, D = a.head_dim;
  SPECDEC_CHK_TYPE(mask.scalar_type() == at::kBool, op, ": mask must be bool (true where a query sees a column), got ",
                   mask.scalar_type());
  SPECDEC_CHK_VALUE(mask.dim() == 4 && (mask.size(0) == B || mask.size(0) == 1) &&
                        (mask.size(1) == Hq || mask.size(1) == 1) && mask.size(2) == n && mask.size(3) == C,
                    op, ": mask must be [B or 1, Hq or 1, n, C] = [", B, ", ", Hq, ", ", n, ", ", C, "], got ", mask.sizes());
  SPECDEC_CHK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_device(mask, query, "mask", "query");
  t.mask = mask.expand({B, Hq, n, C});
  t.out = at::empty({B, n, Hq, D}, query.options());
  a.mask = t.mask.data_ptr<bool>();
  for (int d = 0; d < 4; ++d) a.mask_stride[d] = t.mask.stride(d);
  a.scale = static_cast<float>(scale);
  a.out = t.out.data_ptr();
  return t;
}

struct CacheAttentionTensors {
  at::Tensor q, k, v, starts, out;
  CacheAttentionArgs args;
};

// cache_attention: query [B, Hq, n, D], key and value [B, Hkv, C, D] as decode_attention takes them, starts [B] int64
// on query's device (each row's first query's position; query i sees the columns 0 .. starts[b] + i), D <= 256.
inline CacheAttentionTensors prepare_cache_attention(const at::Tensor& query, const at::Tensor& key,
                                                     const at::Tensor& value, const at::Tensor& starts, double scale) {
  const char* op = "cache_attention";
  CacheAttentionTensors t;
  CacheAttentionArgs& a = t.args;
  a = CacheAttentionArgs{};
  prepare_qkv(op, query, key, value, 256, t.q, t.k, t.v, a);
  SPECDEC_CHK_TYPE(starts.scalar_type() == at::kLong, op, ": starts must be int64 (positions), got ",
                   starts.scalar_type());
  SPECDEC_CHK_VALUE(starts.dim() == 1 && starts.size(0) == a.batch, op, ": starts must be [B] = [", a.batch, "], got ",
                    starts.sizes());
  SPECDEC_CHK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_device(starts, query, "starts", "query");
  t.starts = starts.contiguous();
  t.out = at::empty({a.batch, a.queries, a.q_heads, a.head_dim}, query.options());
  a.starts = t.starts.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
  a.out = t.out.data_ptr();
  return t;
}

// A tensor of ref's dtype and `shape` (-1: any size), contiguous, on ref's device.
inline void check_like(const at::Tensor& t, at::IntArrayRef shape, const char* op, const char* name,
                       const at::Tensor& ref) {
  SPECDEC_CHK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have x's dtype ", ref.scalar_type(),
                   ", got ", t.scalar_type());
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t d = 0; ok && d < shape.size(); ++d) ok = shape[d] < 0 || t.size(d) == shape[d];
  SPECDEC_CHK_VALUE(ok, op, ": ", name, " must be ", shape, " (-1: any), got ", t.sizes());
  SPECDEC_CHK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
  check_device(t, ref, name, "x");
}

// How a packed weight stores its values (its tensor's dtype and shape: int8 panels [P, K + 4, 16] or int8 8-bit blocks
// [P, K / 32, 544], uint8 4-bit blocks, else float).
inline PackedWeights packed_weights(const at::Tensor& w) {
  if (w.scalar_type() == at::kChar) {
    if (w.dim() == 4) return PackedWeights::kQ8BlocksA8;
    return w.dim() == 3 && w.size(2) == 544 ? PackedWeights::kQ8Blocks : PackedWeights::kInt8Rows;
  }
  if (w.scalar_type() == at::kByte) return w.dim() == 4 ? PackedWeights::kQ4BlocksA8 : PackedWeights::kQ4Blocks;
  return PackedWeights::kFloat;
}

inline bool in_blocks(PackedWeights kind) {
  return kind == PackedWeights::kQ4Blocks || kind == PackedWeights::kQ8Blocks || kind == PackedWeights::kQ4BlocksA8 ||
         kind == PackedWeights::kQ8BlocksA8;
}

// A weight packed by ops.pack_linear_weight for out_features N and in_features K: [ceil(N / 16), K, 16] in x's
// dtype, int8 [ceil(N / 16), K + 4, 16] (each panel's K lines of int8 weights, then its 16 float32 scales), or blocks
// of 32 inputs: uint8 4-bit [ceil(N / 16), K / 32, 320], int8 8-bit [ceil(N / 16), K / 32, 544].
inline void check_packed(const at::Tensor& w, int64_t N, int64_t K, const char* op, const char* name,
                         const at::Tensor& ref) {
  const PackedWeights kind = packed_weights(w);
  if (in_blocks(kind)) {
    const bool q4 = kind == PackedWeights::kQ4Blocks || kind == PackedWeights::kQ4BlocksA8;
    const bool a8 = w.dim() == 4;
    const int64_t bytes = q4 ? 320 : 544, chunk = q4 ? 64 : 32;
    const bool shaped = a8 ? w.size(2) == bytes / chunk && w.size(3) == chunk : w.dim() == 3 && w.size(2) == bytes;
    SPECDEC_CHK_VALUE(K % 32 == 0 && shaped && w.size(0) == (N + 15) / 16 && w.size(1) == K / 32, op, ": ", name,
                      " (", q4 ? 4 : 8, "-bit blocks", a8 ? " for int8 activations" : "", ") must be [",
                      (N + 15) / 16, ", ", K / 32, ", ", a8 ? std::to_string(bytes / chunk) + ", " : "",
                      a8 ? chunk : bytes, "] (in features a multiple of 32), got ", w.sizes());
    SPECDEC_CHK_VALUE(w.is_contiguous(), op, ": ", name, " must be contiguous");
    check_device(w, ref, name, "x");
    return;
  }
  if (w.scalar_type() == at::kChar) {
    SPECDEC_CHK_VALUE(w.dim() == 3 && w.size(0) == (N + 15) / 16 && w.size(1) == K + 4 && w.size(2) == 16, op, ": ",
                      name, " (int8 panels) must be [", (N + 15) / 16, ", ", K + 4, ", 16], got ", w.sizes());
    SPECDEC_CHK_VALUE(w.is_contiguous(), op, ": ", name, " must be contiguous");
    check_device(w, ref, name, "x");
    return;
  }
  check_like(w, {(N + 15) / 16, K, 16}, op, name, ref);
}

// A packed weight's in_features K: [P, K, 16], int8 [P, K + 4, 16], or blocks [P, K / 32, 320 or 544].
inline int64_t packed_in_features(const at::Tensor& w) {
  if (in_blocks(packed_weights(w))) return w.size(1) * 32;
  return w.size(1) - (w.scalar_type() == at::kChar ? 4 : 0);
}

struct PackedLinearTensors {
  at::Tensor x, out;
  PackedLinearArgs args;
};

// packed_linear: x [..., K] float32 or bfloat16, weight packed [P, K, 16], out_features N with ceil(N / 16) == P, bias [N] or None.
inline PackedLinearTensors prepare_packed_linear(const at::Tensor& x, const at::Tensor& weight,
                                                 const std::optional<at::Tensor>& bias, int64_t out_features) {
  const char* op = "packed_linear";
  SPECDEC_CHK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                   ": x must be float32 or bfloat16, got ", x.scalar_type());
  SPECDEC_CHK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must be [..., K] with K >= 1, got ", x.sizes());
  SPECDEC_CHK_VALUE(out_features >= 1, op, ": out_features must be >= 1, got ", out_features);
  const int64_t K = x.size(-1);
  check_packed(weight, out_features, K, op, "weight", x);
  if (bias.has_value()) check_like(*bias, {out_features}, op, "bias", x);
  PackedLinearTensors t;
  t.x = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  t.out = at::empty(shape, x.options());
  PackedLinearArgs& a = t.args;
  a.rows = x.numel() / K; a.in_features = K; a.out_features = out_features; a.panels = weight.size(0);
  a.dtype = float_dtype(x, "x");
  a.weights = packed_weights(weight);
  a.x = t.x.data_ptr();
  a.weight = weight.data_ptr();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.out = t.out.data_ptr();
  return t;
}

// unpack_linear_weight's and packed_rows' checks of a quantized packing for out_features N, read as dtype (float32
// or bfloat16); returns the UnpackArgs that describe it (out not set).
inline UnpackArgs quantized_packing(const at::Tensor& weight, int64_t out_features, at::ScalarType dtype,
                                    const char* op) {
  SPECDEC_CHK_TYPE(weight.scalar_type() == at::kChar || weight.scalar_type() == at::kByte, op,
                   ": weight must be a quantized packing (int8 panels, uint8 or int8 blocks), got ",
                   weight.scalar_type());
  SPECDEC_CHK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16, op, ": dtype must be float32 or bfloat16, got ",
                   dtype);
  SPECDEC_CHK_VALUE(out_features >= 1, op, ": out_features must be >= 1, got ", out_features);
  SPECDEC_CHK_VALUE(weight.dim() >= 3, op, ": weight must be a packing [P, ...], got ", weight.sizes());
  const int64_t K = packed_in_features(weight);
  check_packed(weight, out_features, K, op, "weight", weight);
  UnpackArgs a{};
  a.dtype = dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
  a.weights = packed_weights(weight);
  a.in_features = K; a.out_features = out_features; a.panels = weight.size(0);
  a.weight = weight.data_ptr();
  a.out = nullptr;
  return a;
}

// unpack_linear_weight: weight packed for out_features N by ops.pack_linear_weight in a quantized layout (int8
// panels or blocks) -> W^T into out [K, N], contiguous, float32 or bfloat16.
inline void prepare_unpack(const at::Tensor& weight, int64_t out_features, const at::Tensor& out, UnpackArgs& a) {
  const char* op = "unpack_linear_weight";
  a = quantized_packing(weight, out_features, out.scalar_type(), op);
  const int64_t K = a.in_features;
  SPECDEC_CHK_VALUE(out.dim() == 2 && out.size(0) == K && out.size(1) == out_features && out.is_contiguous(), op,
                    ": out must be [", K, ", ", out_features, "] (W^T), contiguous, got ", out.sizes());
  check_device(out, weight, "out", "weight");
  a.out = out.data_ptr();
}

// packed_rows: weight a quantized packing for out_features N (as unpack_linear_weight takes it), ids int64 on the CPU,
// each in [0, N), dtype float32 or bfloat16 -> [*ids.shape, K] in dtype.
struct PackedRowsTensors {
  at::Tensor ids, out;
  PackedRowsArgs args;
};

inline PackedRowsTensors prepare_packed_rows(const at::Tensor& weight, const at::Tensor& ids, int64_t out_features,
                                             at::ScalarType dtype) {
  const char* op = "packed_rows";
  PackedRowsTensors t;
  PackedRowsArgs& a = t.args;
  a.packing = quantized_packing(weight, out_features, dtype, op);
  SPECDEC_CHK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous, got strides ", weight.strides());
  SPECDEC_CHK_TYPE(ids.scalar_type() == at::kLong, op, ": ids must be int64, got ", ids.scalar_type());
  check_device(ids, weight, "ids", "weight");
  t.ids = ids.contiguous();
  const int64_t* id = t.ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.ids.numel(); ++i)
    SPECDEC_CHK_VALUE(id[i] >= 0 && id[i] < out_features, op, ": ids must be in [0, ", out_features,
                      ") (the weight's rows), got ", id[i]);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(a.packing.in_features);
  t.out = at::empty(shape, weight.options().dtype(dtype));
  a.panel_bytes = weight.stride(0) * weight.element_size();
  a.ids = id;
  a.count = t.ids.numel();
  a.out = t.out.data_ptr();
  return t;
}

struct DecoderLayerTensors {
  at::Tensor x, lengths, slots, out;
  DecoderLayerArgs args;
};

// decoder_layer: x [B, n, H] float32 or bfloat16 (every floating tensor in x's dtype, the packed weights too, or all
// four int8 panels [P, K + 4, 16] or blocks of one kind); packed weights (ops.pack_linear_weight) qkv [(Hq + 2 Hkv) D / 16, H, 16],
// o [H / 16, Hq D, 16], gate_up [2 I / 16, H, 16], down [H / 16, I, 16] (every N a multiple of 16); norms [H]
// ([D] for q_norm, k_norm); caches [S, Hkv, C, D] contiguous; lengths [S] int64; slots [B] int64 or None; cos/sin
// [T, D]; heads Hq a multiple of Hkv.
inline DecoderLayerTensors prepare_decoder_layer(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, const at::Tensor& o,
    const at::Tensor& post_norm, const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& lengths, const std::optional<at::Tensor>& slots,
    const at::Tensor& cos, const at::Tensor& sin, int64_t heads, double eps) {
  const char* op = "decoder_layer";
  SPECDEC_CHK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                   ": x must be float32 or bfloat16, got ", x.scalar_type());
  SPECDEC_CHK_VALUE(x.dim() == 3 && x.size(0) >= 1 && x.size(1) >= 1 && x.size(2) >= 1, op,
                    ": x must be [B, n, H] with B, n, H >= 1, got ", x.sizes());
  const int64_t B = x.size(0), n = x.size(1), H = x.size(2);
  SPECDEC_CHK_VALUE(key_cache.dim() == 4 && key_cache.size(0) >= 1 && key_cache.size(1) >= 1 &&
                        key_cache.size(2) >= 1 && key_cache.size(3) >= 2 && key_cache.size(3) % 2 == 0,
                    op, ": key_cache must be [S, Hkv, C, D] with D even, got ", key_cache.sizes());
  const int64_t S = key_cache.size(0), Hkv = key_cache.size(1), C = key_cache.size(2), D = key_cache.size(3);
  SPECDEC_CHK_VALUE(heads >= 1 && heads % Hkv == 0, op, ": heads must be a multiple of key_cache's ", Hkv,
                    " key/value heads, got ", heads);
  SPECDEC_CHK_VALUE((down.dim() == 3 || (down.dim() == 4 && in_blocks(packed_weights(down)))) &&
                        packed_in_features(down) >= 1,
                    op,
                    ": down must be packed [H / 16, I, 16] (int8: [H / 16, I + 4, 16]; 4-bit: [H / 16, I / 32, 320]), "
                    "got ",
                    down.sizes());
  const PackedWeights kind = packed_weights(down);
  for (const at::Tensor* w : {&qkv, &o, &gate_up})
    SPECDEC_CHK_TYPE(packed_weights(*w) == kind, op,
                     ": qkv, o, gate_up and down must all be int8 panels, all blocks of one kind or all in x's dtype, got ",
                     qkv.scalar_type(), ", ", o.scalar_type(), ", ", gate_up.scalar_type(), ", ", down.scalar_type());
  const int64_t I = packed_in_features(down), QKV = (heads + 2 * Hkv) * D;
  SPECDEC_CHK_VALUE(H % 16 == 0 && QKV % 16 == 0 && (2 * I) % 16 == 0, op,
                    ": every product's out features must be a multiple of 16 (H = ", H, ", QKV = ", QKV, ", 2 I = ",
                    2 * I, ")");
  SPECDEC_CHK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  check_like(x, {B, n, H}, op, "x", x);
  check_like(input_norm, {H}, op, "input_norm", x);
  check_like(post_norm, {H}, op, "post_norm", x);
  check_packed(qkv, QKV, H, op, "qkv", x);
  check_packed(o, H, heads * D, op, "o", x);
  check_packed(gate_up, 2 * I, H, op, "gate_up", x);
  check_packed(down, H, I, op, "down", x);
  if (qkv_bias.has_value()) check_like(*qkv_bias, {QKV}, op, "qkv_bias", x);
  SPECDEC_CHK_VALUE(q_norm.has_value() == k_norm.has_value(), op, ": pass both q_norm and k_norm or neither");
  if (q_norm.has_value()) {
    check_like(*q_norm, {D}, op, "q_norm", x);
    check_like(*k_norm, {D}, op, "k_norm", x);
  }
  check_like(key_cache, {S, Hkv, C, D}, op, "key_cache", x);
  check_like(value_cache, {S, Hkv, C, D}, op, "value_cache", x);
  check_like(cos, {-1, D}, op, "cos", x);
  check_like(sin, {cos.size(0), D}, op, "sin", x);
  SPECDEC_CHK_VALUE(cos.size(0) >= 1, op, ": cos must have a row per position, got ", cos.sizes());
  SPECDEC_CHK_TYPE(lengths.scalar_type() == at::kLong, op, ": lengths must be int64, got ", lengths.scalar_type());
  SPECDEC_CHK_VALUE(lengths.dim() == 1 && lengths.size(0) == S, op, ": lengths must be [S] = [", S, "], got ",
                    lengths.sizes());
  check_device(lengths, x, "lengths", "x");
  DecoderLayerTensors t;
  t.lengths = lengths.contiguous();
  const int64_t* len = t.lengths.data_ptr<int64_t>();
  const int64_t* row_slot = nullptr;
  if (slots.has_value()) {
    SPECDEC_CHK_TYPE(slots->scalar_type() == at::kLong, op, ": slots must be int64, got ", slots->scalar_type());
    SPECDEC_CHK_VALUE(slots->dim() == 1 && slots->size(0) == B, op, ": slots must be [B] = [", B, "], got ",
                      slots->sizes());
    check_device(*slots, x, "slots", "x");
    t.slots = slots->contiguous();
    row_slot = t.slots.data_ptr<int64_t>();
  } else {
    SPECDEC_CHK_VALUE(B <= S, op, ": x has ", B, " rows but the cache ", S, " slots");
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = row_slot != nullptr ? row_slot[b] : b;
    SPECDEC_CHK_VALUE(s >= 0 && s < S, op, ": slots[", b, "] = ", s, " is not a slot of the cache's ", S);
    SPECDEC_CHK_VALUE(len[s] >= 0, op, ": lengths[", s, "] = ", len[s], " is negative");
  }
  t.x = x;
  t.out = at::empty_like(x);
  DecoderLayerArgs& a = t.args;
  a.batch = B; a.tokens = n; a.hidden = H;
  a.heads = heads; a.kv_heads = Hkv; a.head_dim = D; a.intermediate = I;
  a.slots = S; a.columns = C; a.positions = cos.size(0);
  a.dtype = float_dtype(x, "x");
  a.weights = kind;
  a.eps = static_cast<float>(eps);
  a.x = x.data_ptr();
  a.input_norm = input_norm.data_ptr();
  a.qkv = qkv.data_ptr();
  a.qkv_bias = qkv_bias.has_value() ? qkv_bias->data_ptr() : nullptr;
  a.q_norm = q_norm.has_value() ? q_norm->data_ptr() : nullptr;
  a.k_norm = k_norm.has_value() ? k_norm->data_ptr() : nullptr;
  a.o = o.data_ptr();
  a.post_norm = post_norm.data_ptr();
  a.gate_up = gate_up.data_ptr();
  a.down = down.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.lengths = len;
  a.row_slots = row_slot;
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.out = t.out.data_ptr();
  return t;
}

}  // namespace specdec
