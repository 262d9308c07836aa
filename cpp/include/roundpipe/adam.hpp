// Adam (and AdamW through decoupled_weight_decay): the stateless step over caller-owned buffers.
//
// Algorithm: Kingma & Ba, "Adam: A Method for Stochastic Optimization" (2015); AMSGrad from
// Reddi et al., "On the Convergence of Adam and Beyond" (2018); decoupled weight decay from
// Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019). The update matches
// torch.optim.Adam (foreach=False) operation by operation: scalars such as the bias corrections
// are computed in double from the float32 step count, as torch does, and the element-wise math
// runs in float32.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Adam.
struct AdamOptions {
  double lr = 1e-3;            ///< learning rate, >= 0
  double beta1 = 0.9;          ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;        ///< second-moment decay, in [0, 1)
  double eps = 1e-8;           ///< added to the denominator, >= 0
  double weight_decay = 0.0;   ///< L2 penalty (or decoupled decay), >= 0
  bool amsgrad = false;        ///< keep the running maximum of exp_avg_sq
  bool maximize = false;       ///< ascend instead of descend
  bool decoupled_weight_decay = false;  ///< AdamW: p *= 1 - lr * weight_decay

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &AdamOptions::lr);
    f("beta1", &AdamOptions::beta1);
    f("beta2", &AdamOptions::beta2);
    f("eps", &AdamOptions::eps);
    f("weight_decay", &AdamOptions::weight_decay);
    f("amsgrad", &AdamOptions::amsgrad);
    f("maximize", &AdamOptions::maximize);
    f("decoupled_weight_decay", &AdamOptions::decoupled_weight_decay);
  }
};

/// ParamBuffers slots for Adam (torch.optim.Adam's state keys; all start as zeros).
struct AdamState {
  enum : int { exp_avg = 0, exp_avg_sq = 1, max_exp_avg_sq = 2 /* iff amsgrad */ };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  /// int8 state (roundpipe/compact.hpp) is allowed; per slot, whether it takes the signed
  /// dynamic map: exp_avg takes either sign; exp_avg_sq and max_exp_avg_sq are non-negative.
  static constexpr auto int8_signed = std::array{true, false, false};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Runs one Adam step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step (scalar[AdamState::step]) is incremented first and its new value drives
/// the bias corrections. Throws roundpipe::Error naming the option or `tensors[i].<slot>` when
/// an option is out of range or a required pointer is null; nothing is modified then.
void adam_step(const AdamOptions& options, const ParamBuffers* tensors, std::size_t count,
               StepIO* io = nullptr);
}  // namespace roundpipe
