// Adafactor: the stateless step over caller-owned buffers.
//
// Algorithm: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost"
// (2018), as torch.optim.Adafactor (torch 2.13) states and computes it (its single-tensor code):
// for a tensor of two or more dimensions, the second moment is factored into a row factor R
// (the mean of g^2 over the last dimension) and a column factor C (over the second-to-last),
// for a vector or 0-dim tensor it is kept whole; per tensor and step t:
//   g = maximize ? -grad : grad
//   beta2_t = 1 - t^beta2_decay;  rho_t = min(lr, 1 / sqrt(t))
//   alpha = max(eps2, RMS(param)) * rho_t                         (param before the decay)
//   param = param * (1 - lr * weight_decay)                       (weight_decay != 0)
//   factored:  R = lerp(R, mean(g^2, dim=-1), 1 - beta2_t);  C = lerp(C, mean(g^2, dim=-2), ..)
//              v = (R @ C) / max(mean(R, dim=-2), eps1)
//   otherwise: v = lerp(variance, g^2, 1 - beta2_t)             (stored as variance)
//   u = rsqrt(max(v, eps1^2)) * g
//   param = param + (-alpha / max(1, RMS(u) / d)) * u
// The scalars (beta2_t, rho_t, alpha, the denominator) are computed in double as torch's Python
// does, norms are rounded to float32 as torch's float32 norms are, and the element-wise math runs
// in float32 operation by operation as torch's.
//
// Memory traffic: the norm of u is needed before the update, so a step reads the gradient three
// times: pass 1 reads param (its norm) and grad (the row and column sums, in tiles of about 2^20
// elements, each sum reduced in a fixed order); pass 2 reads grad (the norm of u); pass 3 reads
// param and grad and writes param: 24 bytes per float32 element. An unfactored tensor updates its
// variance and the norm of u in pass 1 (32 bytes per element with the variance's 8).
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Adafactor (its `eps` pair is `eps1`,
/// `eps2` here).
struct AdafactorOptions {
  /// torch's eps1 = None: the parameter dtype's machine epsilon (float32 2^-23, bfloat16 2^-7).
  static constexpr double kMachineEpsilon = -1.0;

  double lr = 1e-2;            ///< caps the relative step size rho_t, scales weight decay; >= 0
  double beta2_decay = -0.8;   ///< beta2_t = 1 - t^beta2_decay; <= 0
  double eps1 = kMachineEpsilon;  ///< floor of the second moment's square root; >= 0, or kMachineEpsilon
  double eps2 = 1e-3;          ///< floor of RMS(param) in the step size; >= 0
  double d = 1.0;              ///< clipping threshold of RMS(u); >= 1
  double weight_decay = 0.0;   ///< param *= 1 - lr * weight_decay; >= 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &AdafactorOptions::lr);
    f("beta2_decay", &AdafactorOptions::beta2_decay);
    f("eps1", &AdafactorOptions::eps1);
    f("eps2", &AdafactorOptions::eps2);
    f("d", &AdafactorOptions::d);
    f("weight_decay", &AdafactorOptions::weight_decay);
    f("maximize", &AdafactorOptions::maximize);
  }
};

/// ParamBuffers slots for Adafactor (torch.optim.Adafactor's state keys; all start as zeros). A
/// tensor of two or more dimensions (ParamBuffers::rows, cols > 0: its last two sizes; batch =
/// numel / (rows * cols) matrices) keeps row_var (batch * rows floats) and col_var (batch * cols
/// floats); any other keeps variance (numel floats).
struct AdafactorState {
  enum : int { row_var = 0, col_var = 1, variance = 2 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"row_var", "col_var", "variance"};
  static constexpr auto scalar_names = std::array{"step"};
  /// The step reads ParamBuffers::rows and cols (the bindings fill them from the shape).
  static constexpr bool factored = true;
};

/// Runs one Adafactor step on `count` tensors, spread over the worker pool, with the active ISA,
/// in three passes over memory (header comment). Each tensor's step (scalar[AdafactorState::step])
/// is incremented first. A tensor with no elements only counts the step (torch 2.13 raises
/// ZeroDivisionError dividing by its size). bfloat16 parameters and the fused mixed-precision
/// pass (StepIO, grad16, model_copy) are supported as in every step function; compact state is
/// not (the factored state is already small). Throws roundpipe::Error naming the option or
/// `tensors[i].<slot>` when an option is out of range, a required pointer is null, a tensor with
/// elements has one of rows and cols 0 but not both, or its rows * cols does not divide its
/// numel; nothing is modified then.
void adafactor_step(const AdafactorOptions& options, const ParamBuffers* tensors,
                    std::size_t count, StepIO* io = nullptr);

}  // namespace roundpipe
