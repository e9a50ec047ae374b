// A libtorch-only C++ program (no Python) that links the specdec_ext ops library, calls ops through the
// dispatcher, and prints their results for tests/test_cpp_library.py to compare with the Python reference.
//
// Input file, one tensor per line: name dtype(f32|i64) ndim d0 .. d{ndim-1} v0 v1 ...
// Output, one tensor per line: name v0 v1 ... (flattened, as float)
// Tensor and the one factory used here, not <ATen/ATen.h> (every op's header: twice the compile time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::map<std::string, at::Tensor> read_tensors(const char* path) {
  std::map<std::string, at::Tensor> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string name, dtype;
    int64_t ndim = 0;
    ss >> name >> dtype >> ndim;
    std::vector<int64_t> shape(ndim);
    int64_t numel = 1;
    for (auto& d : shape) {
      ss >> d;
      numel *= d;
    }
    std::vector<double> v(numel);
    for (auto& x : v) ss >> x;
    at::Tensor t = at::tensor(v, at::kDouble).reshape(shape);
    out[name] = dtype == "i64" ? t.to(at::kLong) : t.to(at::kFloat);
  }
  return out;
}

void print(const std::string& name, const at::Tensor& t) {
  at::Tensor f = t.to(at::kDouble).contiguous().reshape(-1);
  std::cout << name;
  for (int64_t i = 0; i < f.numel(); ++i) std::cout << ' ' << f[i].item<double>();
  std::cout << '\n';
}

std::vector<c10::IValue> call(const char* op, std::vector<c10::IValue> args) {
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, "");
  handle.callBoxed(&args);
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: call_ops LIBRARY INPUTS\n";
    return 2;
  }
  // the library is linked; loading it again with RTLD_NOW checks it has no unresolved (Python) symbols
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "dlopen failed: " << dlerror() << '\n';
    return 1;
  }
  auto t = read_tensors(argv[2]);
  const c10::IValue none;
  auto r = call("specdec_ext::chain_verify",
                {t["ids"], t["draft_probs"], t["target_probs"], none, t["uniforms"], none, false});
  print("chain_verify.out", r[0].toTensor());
  print("chain_verify.num", r[1].toTensor());
  r = call("specdec_ext::chain_verify_logits",
           {t["ids"], t["draft_logits"], t["target_logits"], t["temperature"], none, t["uniforms"], none, false});
  print("chain_verify_logits.out", r[0].toTensor());
  print("chain_verify_logits.num", r[1].toTensor());
  r = call("specdec_ext::chain_verify_greedy", {t["ids"], t["target_logits"], none});
  print("chain_verify_greedy.out", r[0].toTensor());
  print("chain_verify_greedy.num", r[1].toTensor());
  at::Tensor cum = t["cum_accept"].clone();
  r = call("specdec_ext::acceptance_head_step",
           {t["hidden"], none, none, none, t["block_weight"], t["block_bias"], t["out_weight"], t["out_bias"], cum,
            int64_t{2}, int64_t{1}, int64_t{20}, 0.9, t["stop_below"]});
  print("acceptance_head_step.p", r[0].toTensor());
  print("acceptance_head_step.stop", r[1].toTensor());
  print("acceptance_head_step.cum", cum);
  return 0;
}
