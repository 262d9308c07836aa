// SGD with optional momentum, dampening, Nesterov momentum, L2 weight decay and maximize: the
// stateless step over caller-owned buffers.
//
// Algorithm: stochastic gradient descent with heavy-ball momentum (Polyak, 1964) and Nesterov
// momentum in the form of Sutskever et al., "On the importance of initialization and momentum in
// deep learning" (2013), exactly as torch.optim.SGD (foreach=False) runs it, operation by
// operation in float32:
//   g = maximize ? -grad : grad;   g = g + weight_decay * p
//   buf = g (first step) | buf = buf * momentum + (1 - dampening) * g;   (momentum != 0)
//   g = nesterov ? g + momentum * buf : buf
//   p = p - lr * g
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.SGD.
struct SGDOptions {
  double lr = 1e-3;            ///< learning rate, >= 0
  double momentum = 0.0;       ///< momentum factor, >= 0 (0: plain SGD, no buffer)
  double dampening = 0.0;      ///< dampening of the momentum update (any value, as torch)
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  bool nesterov = false;       ///< Nesterov momentum; needs momentum > 0 and dampening == 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &SGDOptions::lr);
    f("momentum", &SGDOptions::momentum);
    f("dampening", &SGDOptions::dampening);
    f("weight_decay", &SGDOptions::weight_decay);
    f("nesterov", &SGDOptions::nesterov);
    f("maximize", &SGDOptions::maximize);
  }
};

/// ParamBuffers slots for SGD.
///
/// torch.optim.SGD keeps no step count; its only state is `momentum_buffer`, which does not
/// exist before the first step with momentum != 0 and is then a copy of that step's (decayed)
/// gradient. A float array cannot say "does not exist", so scalar slot 0 says it instead:
///   - momentum_buffer_ready == 0: the buffer holds no value yet (its contents are ignored). The
///     step writes g into it, as torch clones the gradient, and sets the flag to 1.
///   - momentum_buffer_ready == 1: the buffer holds the running momentum; the step updates it.
/// Start a new tensor with the flag at 0 (like every other scalar slot). The flag is not torch
/// state: roundpipe.optim.SGD derives it from whether state["momentum_buffer"] exists. The step
/// writes the flag only when it changes it. With momentum == 0 neither slot is read or written
/// and both may be null.
struct SGDState {
  enum : int { momentum_buffer = 0 };
  enum : int { momentum_buffer_ready = 0 };  // scalar slot (a 0/1 flag, not torch state)
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"momentum_buffer"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: momentum_buffer takes either sign.
  static constexpr auto int8_signed = std::array{true};
  static constexpr auto scalar_names = std::array{"momentum_buffer_ready"};
};

/// Runs one SGD step on `count` tensors, spread over the worker pool, with the active ISA.
/// Throws roundpipe::Error naming the option or `tensors[i].<slot>` when an option is out of
/// range (or nesterov without momentum > 0 and dampening == 0) or a required pointer is null;
/// nothing is modified then.
void sgd_step(const SGDOptions& options, const ParamBuffers* tensors, std::size_t count,
              StepIO* io = nullptr);

}  // namespace roundpipe
