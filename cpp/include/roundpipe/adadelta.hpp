// Adadelta: the stateless step over caller-owned buffers.
//
// Algorithm: Zeiler, "ADADELTA: An Adaptive Learning Rate Method" (2012), with torch.optim.Adadelta's
// lr (a factor on the delta), L2 weight decay and maximize. The update matches
// torch.optim.Adadelta (foreach=False) operation by operation, in float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Adadelta.
struct AdadeltaOptions {
  double lr = 1.0;             ///< factor on the delta, >= 0
  double rho = 0.9;            ///< decay of both running averages, in [0, 1]
  double eps = 1e-6;           ///< added inside both square roots, >= 0
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &AdadeltaOptions::lr);
    f("rho", &AdadeltaOptions::rho);
    f("eps", &AdadeltaOptions::eps);
    f("weight_decay", &AdadeltaOptions::weight_decay);
    f("maximize", &AdadeltaOptions::maximize);
  }
};

/// ParamBuffers slots for Adadelta (torch.optim.Adadelta's state keys; all start as zeros).
struct AdadeltaState {
  enum : int { square_avg = 0, acc_delta = 1 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"square_avg", "acc_delta"};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one Adadelta step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step (scalar[AdadeltaState::step]) is incremented (Adadelta itself does not
/// use it). Throws roundpipe::Error naming the option or `tensors[i].<slot>` when an option is
/// out of range or a required pointer is null; nothing is modified then.
void adadelta_step(const AdadeltaOptions& options, const ParamBuffers* tensors, std::size_t count,
                   StepIO* io = nullptr);

}  // namespace roundpipe
