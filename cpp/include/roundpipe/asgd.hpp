// ASGD (averaged stochastic gradient descent): the stateless step over caller-owned buffers.
//
// Algorithm: Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging" (1992),
// with the step-size and averaging schedules of Bottou, "Stochastic Gradient Descent Tricks"
// (2012), as torch.optim.ASGD defines them:
//   p = p * (1 - lambd * eta) - eta * g;   ax = mu == 1 ? p : ax + (p - ax) * mu
//   then eta = lr / (1 + lambd * lr * step)^alpha,  mu = 1 / max(1, step - t0)
// This step uses the eta and mu stored by the previous one. The update matches torch.optim.ASGD
// (foreach=False) operation by operation: eta and mu are computed in double from the float32
// step count and stored as float32, as torch does; the element-wise math runs in float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.ASGD (which checks only lr and
/// weight_decay; lambd, alpha and t0 may be any value, as there).
struct ASGDOptions {
  double lr = 1e-2;            ///< initial learning rate, >= 0
  double lambd = 1e-4;         ///< decay term
  double alpha = 0.75;         ///< power of the eta schedule
  double t0 = 1e6;             ///< step from which averaging starts
  double weight_decay = 0.0;   ///< L2 penalty, >= 0
  bool maximize = false;       ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &ASGDOptions::lr);
    f("lambd", &ASGDOptions::lambd);
    f("alpha", &ASGDOptions::alpha);
    f("t0", &ASGDOptions::t0);
    f("weight_decay", &ASGDOptions::weight_decay);
    f("maximize", &ASGDOptions::maximize);
  }
};

/// ParamBuffers slots for ASGD (torch.optim.ASGD's state keys). `ax` starts as zeros; the 0-dim
/// values start as torch sets them: step 0, eta = lr (rounded to float32), mu = 1.
struct ASGDState {
  enum : int { ax = 0 };
  enum : int { step = 0, eta = 1, mu = 2 };  // scalar slots
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"ax"};
  static constexpr auto scalar_names = std::array{"step", "eta", "mu"};
};

/// Runs one ASGD step on `count` tensors, spread over the worker pool, with the active ISA.
/// Per tensor: the step is incremented, the update uses the stored eta and mu, and then eta and
/// mu are replaced by their values for the new step. Throws roundpipe::Error naming the option
/// or `tensors[i].<slot>` when an option is out of range or a required pointer is null; nothing
/// is modified then.
void asgd_step(const ASGDOptions& options, const ParamBuffers* tensors, std::size_t count,
               StepIO* io = nullptr);

/// The old names (now spelled as torch.optim.ASGD, like SGD and NAdam): kept for one release.
using AsgdOptions [[deprecated("renamed roundpipe::ASGDOptions")]] = ASGDOptions;
using AsgdState [[deprecated("renamed roundpipe::ASGDState")]] = ASGDState;

}  // namespace roundpipe
