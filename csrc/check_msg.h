// Argument-check messages built without std::ostream.
//
// TORCH_CHECK_* formats its message with c10::str, an ostringstream. Seen on an H100 machine (torch 2.11+cu130,
// this library built there with g++ 13): streaming an integer from inside this library crashed the process
// (SIGSEGV in std::basic_ostream::_M_insert<long>, a locale facet call gone to the wrong function), so every
// ValueError naming a shape became a crash, while messages of strings alone worked. SPECDEC_CHK_VALUE and
// SPECDEC_CHK_TYPE take the arguments of TORCH_CHECK_VALUE / TORCH_CHECK_TYPE (and are as long, so call sites
// keep their alignment), format numbers, shapes, dtypes and devices with std::to_string / snprintf, and hand
// torch one std::string, which c10::str passes through unformatted. As with TORCH_CHECK, the message is built
// only when the check fails.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace specdec {
namespace detail {

inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, c10::ScalarType x) { s += c10::toString(x); }
inline void append(std::string& s, c10::DeviceType x) { s += c10::DeviceTypeName(x, /*lower_case=*/true); }
inline void append(std::string& s, const c10::Device& x) {
  append(s, x.type());
  if (x.has_index()) s += ":" + std::to_string(static_cast<int>(x.index()));
}
inline void append(std::string& s, c10::IntArrayRef x) {  // as torch prints a shape: [2, 3]
  s += "[";
  for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T x) {
  s += std::to_string(x);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void append(std::string& s, T x) {  // %g: what an ostream prints by default (6 significant digits)
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(x));
  s += buf;
}

}  // namespace detail

// The arguments concatenated: strings, integers, floating-point numbers, shapes, dtypes and devices.
template <typename... Args>
inline std::string msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace specdec

#define SPECDEC_CHK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::specdec::msg(__VA_ARGS__))
#define SPECDEC_CHK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::specdec::msg(__VA_ARGS__))
#define SPECDEC_CHK(cond, ...) TORCH_CHECK(cond, ::specdec::msg(__VA_ARGS__))
