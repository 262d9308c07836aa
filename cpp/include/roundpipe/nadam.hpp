// NAdam (and NAdamW through decoupled_weight_decay): the stateless step over caller-owned
// buffers.
//
// Algorithm: Dozat, "Incorporating Nesterov Momentum into Adam" (ICLR 2016 workshop), with the
// momentum schedule mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)) and decoupled weight
// decay from Loshchilov & Hutter (2019). The update matches torch.optim.NAdam (foreach=False)
// operation by operation: mu_t, mu_{t+1}, the bias correction and the two step sizes are
// computed in double from the float32 step count, as torch does; the running product of the
// mu_t is a float32 value (torch keeps it as a 0-dim float32 tensor and multiplies it by mu_t,
// rounded to float32, at every step); the element-wise math runs in float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.NAdam.
struct NAdamOptions {
  double lr = 2e-3;              ///< learning rate, >= 0
  double beta1 = 0.9;            ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;          ///< second-moment decay, in [0, 1)
  double eps = 1e-8;             ///< added to the denominator, >= 0
  double weight_decay = 0.0;     ///< L2 penalty (or decoupled decay), >= 0
  double momentum_decay = 4e-3;  ///< psi in mu_t = beta1 * (1 - 0.5 * 0.96^(t * psi)), >= 0
  bool decoupled_weight_decay = false;  ///< NAdamW: p *= 1 - lr * weight_decay
  bool maximize = false;         ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &NAdamOptions::lr);
    f("beta1", &NAdamOptions::beta1);
    f("beta2", &NAdamOptions::beta2);
    f("eps", &NAdamOptions::eps);
    f("weight_decay", &NAdamOptions::weight_decay);
    f("momentum_decay", &NAdamOptions::momentum_decay);
    f("decoupled_weight_decay", &NAdamOptions::decoupled_weight_decay);
    f("maximize", &NAdamOptions::maximize);
  }
};

/// ParamBuffers slots for NAdam (torch.optim.NAdam's state keys). exp_avg and exp_avg_sq start
/// as zeros, step as 0 and mu_product as 1.
struct NAdamState {
  enum : int { exp_avg = 0, exp_avg_sq = 1 };
  enum : int { step = 0, mu_product = 1 };  // scalar slots
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"exp_avg", "exp_avg_sq"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: exp_avg takes either sign; exp_avg_sq is non-negative.
  static constexpr auto int8_signed = std::array{true, false};
  static constexpr auto scalar_names = std::array{"step", "mu_product"};
};

/// Runs one NAdam step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step is incremented first and its new value t drives mu_t and mu_{t+1};
/// mu_product is multiplied by mu_t. Throws roundpipe::Error naming the option or
/// `tensors[i].<slot>` when an option is out of range or a required pointer is null; nothing
/// is modified then.
void nadam_step(const NAdamOptions& options, const ParamBuffers* tensors, std::size_t count,
                StepIO* io = nullptr);

}  // namespace roundpipe
