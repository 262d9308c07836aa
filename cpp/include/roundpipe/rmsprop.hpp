// RMSprop, plain or centered, with optional momentum: the stateless step over caller-owned
// buffers.
//
// Algorithm: Hinton, Srivastava & Swersky, "Neural Networks for Machine Learning", lecture 6e
// (2012); the centered variant from Graves, "Generating Sequences With Recurrent Neural
// Networks" (2013). The update matches torch.optim.RMSprop (foreach=False) operation by
// operation in float32 (note that eps is added after the square root, and the centered variance
// is square_avg - grad_avg^2, which rounding can make negative: its square root is then NaN, as
// in torch):
//   g = maximize ? -grad : grad;   g = g + weight_decay * p
//   square_avg = square_avg * alpha + (1 - alpha) * g * g
//   avg = sqrt(square_avg) + eps, or, centered:
//     grad_avg = lerp(grad_avg, g, 1 - alpha);  avg = sqrt(square_avg - grad_avg^2) + eps
//   momentum > 0: buf = buf * momentum + g / avg;  p = p - lr * buf
//   otherwise:    p = p - lr * g / avg
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.RMSprop.
struct RMSpropOptions {
  double lr = 1e-2;            ///< learning rate, >= 0
  double alpha = 0.99;         ///< smoothing constant, >= 0 (torch sets no upper bound)
  double eps = 1e-8;           ///< added to the denominator, >= 0
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  double momentum = 0.0;       ///< momentum factor, >= 0 (0: no momentum buffer)
  bool centered = false;       ///< normalise by the variance estimate instead of the 2nd moment
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &RMSpropOptions::lr);
    f("alpha", &RMSpropOptions::alpha);
    f("eps", &RMSpropOptions::eps);
    f("weight_decay", &RMSpropOptions::weight_decay);
    f("momentum", &RMSpropOptions::momentum);
    f("centered", &RMSpropOptions::centered);
    f("maximize", &RMSpropOptions::maximize);
  }
};

/// ParamBuffers slots for RMSprop (torch.optim.RMSprop's state keys; all start as zeros).
struct RMSpropState {
  enum : int {
    square_avg = 0,
    momentum_buffer = 1 /* iff momentum > 0 */,
    grad_avg = 2 /* iff centered */
  };
  enum : int { step = 0 };  // scalar slot: counted as torch does, read by nothing
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"square_avg", "momentum_buffer", "grad_avg"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: square_avg is non-negative; momentum_buffer and grad_avg take either sign.
  static constexpr auto int8_signed = std::array{false, true, true};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one RMSprop step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step (scalar[RMSpropState::step]) is incremented. Throws roundpipe::Error
/// naming the option or `tensors[i].<slot>` when an option is out of range or a required
/// pointer is null; nothing is modified then.
void rmsprop_step(const RMSpropOptions& options, const ParamBuffers* tensors, std::size_t count,
                  StepIO* io = nullptr);

}  // namespace roundpipe
