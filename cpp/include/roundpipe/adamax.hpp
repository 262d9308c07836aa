// Adamax: the stateless step over caller-owned buffers.
//
// Algorithm: Kingma & Ba, "Adam: A Method for Stochastic Optimization" (2015), section 7.1 (Adam
// based on the infinity norm), as torch.optim.Adamax defines it: eps enters inside the maximum,
// exp_inf = max(beta2 * exp_inf, |g| + eps), with L2 weight decay and maximize. The update matches
// torch.optim.Adamax (foreach=False) operation by operation: the bias-corrected step size is
// computed in double from the float32 step count, as torch does; the element-wise math runs in
// float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Adamax.
struct AdamaxOptions {
  double lr = 2e-3;            ///< learning rate, >= 0
  double beta1 = 0.9;          ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;        ///< decay of the infinity norm, in [0, 1)
  double eps = 1e-8;           ///< added to |g| inside the maximum, >= 0
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &AdamaxOptions::lr);
    f("beta1", &AdamaxOptions::beta1);
    f("beta2", &AdamaxOptions::beta2);
    f("eps", &AdamaxOptions::eps);
    f("weight_decay", &AdamaxOptions::weight_decay);
    f("maximize", &AdamaxOptions::maximize);
  }
};

/// ParamBuffers slots for Adamax (torch.optim.Adamax's state keys; all start as zeros).
struct AdamaxState {
  enum : int { exp_avg = 0, exp_inf = 1 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"exp_avg", "exp_inf"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: exp_avg takes either sign; exp_inf is non-negative.
  static constexpr auto int8_signed = std::array{true, false};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one Adamax step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step (scalar[AdamaxState::step]) is incremented first and its new value drives
/// the bias correction. Throws roundpipe::Error naming the option or `tensors[i].<slot>` when an
/// option is out of range or a required pointer is null; nothing is modified then.
void adamax_step(const AdamaxOptions& options, const ParamBuffers* tensors, std::size_t count,
                 StepIO* io = nullptr);

}  // namespace roundpipe
