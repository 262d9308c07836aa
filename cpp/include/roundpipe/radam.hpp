// RAdam (and RAdamW through decoupled_weight_decay): the stateless step over caller-owned
// buffers.
//
// Algorithm: Liu et al., "On the Variance of the Adaptive Learning Rate and Beyond" (ICLR 2020):
// Adam whose adaptive step is multiplied by the variance rectification term r_t while the
// length of the approximated simple moving average, rho_t, exceeds 5, and which takes a plain
// bias-corrected momentum step (no adaptive denominator) before that. Decoupled weight decay
// from Loshchilov & Hutter (2019). The update matches torch.optim.RAdam (foreach=False)
// operation by operation: rho_t, r_t and the bias corrections are computed in double from the
// float32 step count, as torch does, and the element-wise math runs in float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.RAdam.
struct RAdamOptions {
  double lr = 1e-3;              ///< learning rate, >= 0
  double beta1 = 0.9;            ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;          ///< second-moment decay, in [0, 1)
  double eps = 1e-8;             ///< added to the denominator, >= 0
  double weight_decay = 0.0;     ///< L2 penalty (or decoupled decay), >= 0
  bool decoupled_weight_decay = false;  ///< RAdamW: p *= 1 - lr * weight_decay
  bool maximize = false;         ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &RAdamOptions::lr);
    f("beta1", &RAdamOptions::beta1);
    f("beta2", &RAdamOptions::beta2);
    f("eps", &RAdamOptions::eps);
    f("weight_decay", &RAdamOptions::weight_decay);
    f("decoupled_weight_decay", &RAdamOptions::decoupled_weight_decay);
    f("maximize", &RAdamOptions::maximize);
  }
};

/// ParamBuffers slots for RAdam (torch.optim.RAdam's state keys; all start as zeros).
struct RAdamState {
  enum : int { exp_avg = 0, exp_avg_sq = 1 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"exp_avg", "exp_avg_sq"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: exp_avg takes either sign; exp_avg_sq is non-negative.
  static constexpr auto int8_signed = std::array{true, false};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one RAdam step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step is incremented first and its new value t drives the bias corrections and
/// rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t), rho_inf = 2 / (1 - beta2) - 1. Where
/// rho_t > 5: p -= lr * m_hat * r_t * sqrt(1 - beta2^t) / (sqrt(v) + eps); otherwise
/// p -= lr * m_hat. Throws roundpipe::Error naming the option or `tensors[i].<slot>` when an
/// option is out of range or a required pointer is null; nothing is modified then.
void radam_step(const RAdamOptions& options, const ParamBuffers* tensors, std::size_t count,
                StepIO* io = nullptr);

}  // namespace roundpipe
