// Internal: argument checks shared by the step functions. Each throws roundpipe::Error with a
// message that names the argument.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <string>

#include "roundpipe/error.hpp"

namespace roundpipe {
namespace detail {

inline std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// lo <= x (and x < hi when hi is given); NaN fails.
inline void check_range(const char* fn, const char* name, double x, double lo,
                        double hi = INFINITY, bool hi_open = false) {
  const bool ok = x >= lo && (hi_open ? x < hi : x <= hi);
  if (!ok)
    throw Error(std::string(fn) + ": " + name + " must be in [" + fmt(lo) + ", " + fmt(hi) +
                (hi_open ? ")" : "]") + ", got " + fmt(x));
}

// A buffer of tensors[i] must be non-null unless the tensor is empty.
inline void check_buffer(const char* fn, std::size_t i, const char* field, const void* p,
                         std::size_t numel) {
  if (numel != 0 && p == nullptr)
    throw Error(std::string(fn) + ": tensors[" + std::to_string(i) + "]." + field +
                " is null (numel " + std::to_string(numel) + ")");
}

inline void check_step(const char* fn, std::size_t i, const float* step) {
  if (step == nullptr)
    throw Error(std::string(fn) + ": tensors[" + std::to_string(i) + "].step is null");
}

// torch's lerp_(end, weight) in float32: coefficient and which end it starts from.
struct Lerp {
  float weight;
  bool from_end;
};
inline Lerp lerp_coeff(double weight) {
  const float w = static_cast<float>(weight);
  return std::fabs(w) < 0.5f ? Lerp{w, false} : Lerp{w - 1.0f, true};
}

}  // namespace detail
}  // namespace roundpipe
