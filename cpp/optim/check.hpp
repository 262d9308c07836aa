// Internal: argument checks shared by the step functions. Each throws roundpipe::Error with a
// message that names the argument.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <string>

#include "roundpipe/buffers.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/step_io.hpp"
#include "kernels/moments.hpp"
#include "roundpipe/state_traits.hpp"

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

// Checks that every tensor has what the algorithm needs: param (or param_bf16), grad (or
// grad16, bfloat16 or float16), the state arrays State::state_names[k] for each k set in
// `state_mask` (unless numel == 0) in their state_format (float32: state[k]; bfloat16:
// packed_state[k]; int8, where State allows it: packed_state[k] and state_absmax[k]), the
// scalars State::scalar_names[k] for each k set in `scalar_mask`, a valid model_copy_dtype; and
// `io`'s grad_scale (finite, > 0), whose outputs it resets. Messages name
// `tensors[i].<slot name>` or `io.<field>`.
template <class State>
void check_buffers(const char* fn, const ParamBuffers* tensors, std::size_t count,
                   unsigned state_mask, unsigned scalar_mask, StepIO* io) {
  static_assert(State::state_names.size() <= ParamBuffers::kMaxState &&
                State::scalar_names.size() <= ParamBuffers::kMaxScalar);
  if (io) {
    if (!(io->grad_scale > 0.0 && io->grad_scale < INFINITY))
      throw Error(std::string(fn) + ": io.grad_scale must be finite and > 0, got " +
                  fmt(io->grad_scale));
    io->found_inf = false;
    io->grad_norm_sq = 0.0;
  }
  if (count != 0 && tensors == nullptr) throw Error(std::string(fn) + ": tensors is null");
  auto fail = [&](std::size_t i, const char* name) {
    throw Error(std::string(fn) + ": tensors[" + std::to_string(i) + "]." + name + " is null" +
                " (numel " + std::to_string(tensors[i].numel) + ")");
  };
  for (std::size_t i = 0; i < count; ++i) {
    const ParamBuffers& t = tensors[i];
    if (t.numel != 0 && !t.param && !t.param_bf16) fail(i, "param");
    if (t.numel != 0 && !t.grad && !t.grad16) fail(i, "grad");
    if (t.grad16 && t.grad16_dtype != Dtype::bfloat16 && t.grad16_dtype != Dtype::float16)
      throw Error(std::string(fn) + ": tensors[" + std::to_string(i) +
                  "].grad16_dtype must be bfloat16 or float16");
    if (t.model_copy && static_cast<unsigned>(t.model_copy_dtype) > 2u)
      throw Error(std::string(fn) + ": tensors[" + std::to_string(i) +
                  "].model_copy_dtype is not a Dtype");
    for (std::size_t k = 0; k < State::state_names.size(); ++k) {
      const std::string slot = std::string(State::state_names[k]);
      switch (t.state_format[k]) {
        case StateFormat::float32:
          if ((state_mask >> k & 1u) && t.numel != 0 && !t.state[k]) fail(i, slot.c_str());
          break;
        case StateFormat::int8:
          if (!Int8Slots<State>::allowed)
            throw Error(std::string(fn) + ": tensors[" + std::to_string(i) + "].state_format[" +
                        std::to_string(k) + "] (" + slot + ") is int8, which this algorithm " +
                        "does not support (float32 or bfloat16)");
          if (t.numel != 0 && !t.state_absmax[k]) fail(i, (slot + " absmax").c_str());
          [[fallthrough]];
        case StateFormat::bfloat16:
          if (t.numel != 0 && !t.packed_state[k]) fail(i, (slot + " (packed)").c_str());
          break;
        default:
          throw Error(std::string(fn) + ": tensors[" + std::to_string(i) + "].state_format[" +
                      std::to_string(k) + "] is not a StateFormat");
      }
    }
    for (std::size_t k = 0; k < State::scalar_names.size(); ++k)
      if ((scalar_mask >> k & 1u) && !t.scalar[k]) fail(i, State::scalar_names[k]);
  }
}

// Every slot of State (e.g. for check_buffers' masks).
template <class State>
constexpr unsigned all_states() { return (1u << State::state_names.size()) - 1u; }
template <class State>
constexpr unsigned all_scalars() { return (1u << State::scalar_names.size()) - 1u; }

// torch's lerp_(end, weight) in float32: coefficient and which end it starts from.
struct Lerp {
  float weight;
  bool from_end;
};
inline Lerp lerp_coeff(double weight) {
  const float w = static_cast<float>(weight);
  return std::fabs(w) < 0.5f ? Lerp{w, false} : Lerp{w - 1.0f, true};
}

// The shared part of the Adam family's coefficients (kernels/moments.hpp), as torch computes
// them: decoupled decay 1 - lr * weight_decay in double, the rest rounded to float32.
inline MomentCoeffs moment_coeffs(double lr, double beta1, double beta2, double weight_decay,
                                  bool decoupled_weight_decay, bool maximize) {
  const bool decoupled = decoupled_weight_decay && weight_decay != 0.0;
  const Lerp lerp = lerp_coeff(1.0 - beta1);
  return MomentCoeffs{
      grad_coeffs(decoupled_weight_decay ? 0.0 : weight_decay, maximize),
      /*decay=*/decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f,
      lerp.weight,
      lerp.from_end,
      static_cast<float>(beta2),
      static_cast<float>(1.0 - beta2),
  };
}

}  // namespace detail
}  // namespace roundpipe
