// Adagrad: the stateless step over caller-owned buffers.
//
// Algorithm: Duchi, Hazan & Singer, "Adaptive Subgradient Methods for Online Learning and
// Stochastic Optimization" (JMLR 2011), with torch.optim.Adagrad's learning-rate decay, L2
// weight decay and maximize. The update matches torch.optim.Adagrad (foreach=False) operation by
// operation: the decayed learning rate clr = lr / (1 + (step - 1) * lr_decay) is computed in
// double from the float32 step count, as torch does, and the element-wise math runs in float32:
//   g = maximize ? -grad : grad;   g = g + weight_decay * p
//   sum = sum + g * g;             p = p - clr * g / (sqrt(sum) + eps)
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Adagrad. initial_accumulator_value is
/// the value `sum` starts with (AdagradState): roundpipe::Adagrad fills new state with it;
/// adagrad_step never reads it (a caller owning the state fills `sum` itself).
struct AdagradOptions {
  double lr = 1e-2;            ///< learning rate, >= 0
  double lr_decay = 0.0;       ///< learning-rate decay per step, >= 0
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  double initial_accumulator_value = 0.0;  ///< start value of `sum`, >= 0
  double eps = 1e-10;          ///< added to the denominator, >= 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &AdagradOptions::lr);
    f("lr_decay", &AdagradOptions::lr_decay);
    f("weight_decay", &AdagradOptions::weight_decay);
    f("initial_accumulator_value", &AdagradOptions::initial_accumulator_value);
    f("eps", &AdagradOptions::eps);
    f("maximize", &AdagradOptions::maximize);
  }
};

/// ParamBuffers slots for Adagrad (torch.optim.Adagrad's state keys). `sum` starts filled with
/// torch's initial_accumulator_value (default 0); torch creates it, and the step count 0, when
/// the optimizer is constructed.
struct AdagradState {
  enum : int { sum = 0 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"sum"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: sum is non-negative.
  static constexpr auto int8_signed = std::array{false};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one Adagrad step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step (scalar[AdagradState::step]) is incremented first and its new value drives
/// the learning-rate decay. Throws roundpipe::Error naming the option or `tensors[i].<slot>`
/// when an option is out of range or a required pointer is null; nothing is modified then.
void adagrad_step(const AdagradOptions& options, const ParamBuffers* tensors, std::size_t count,
                  StepIO* io = nullptr);

}  // namespace roundpipe
