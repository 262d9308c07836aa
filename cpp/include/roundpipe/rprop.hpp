// Rprop: the stateless step over caller-owned buffers.
//
// Algorithm: Riedmiller & Braun, "A Direct Adaptive Method for Faster Backpropagation
// Learning: The RPROP Algorithm" (1993), in the variant of torch.optim.Rprop: each element has
// its own step size, multiplied by etaplus where the gradient kept its sign since the last step
// and by etaminus where it changed sign, then clamped to [step_size_min, step_size_max]; where
// the sign changed, the gradient counts as zero (no move, and zero is remembered as the previous
// gradient); the parameter moves by -sign(gradient) * step size. The update matches
// torch.optim.Rprop (foreach=False) operation by operation, in float32, including its handling
// of NaN (torch.sign(NaN) is 0: a NaN gradient leaves the step size and the parameter as they
// are, and is remembered as the previous gradient, which then leaves the next step size alone).
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

/// Hyperparameters, named and defaulted as in torch.optim.Rprop (etas = (etaminus, etaplus),
/// step_sizes = (step_size_min, step_size_max)).
struct RpropOptions {
  /// The initial step size: rprop_step does not read it (torch.optim.Rprop uses lr only when it
  /// creates a tensor's step_size state); rprop_init_state fills step_size with it.
  double lr = 1e-2;
  double etaminus = 0.5;        ///< step-size factor after a sign change, in (0, 1)
  double etaplus = 1.2;         ///< step-size factor while the sign holds, > 1
  double step_size_min = 1e-6;  ///< lower clamp of the step size
  double step_size_max = 50.0;  ///< upper clamp of the step size. Not checked, as in torch: as
                                ///< torch's clamp, max wins when it is below min, and a NaN
                                ///< bound makes every step size NaN
  bool maximize = false;        ///< ascend instead of descend

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("lr", &RpropOptions::lr);
    f("etaminus", &RpropOptions::etaminus);
    f("etaplus", &RpropOptions::etaplus);
    f("step_size_min", &RpropOptions::step_size_min);
    f("step_size_max", &RpropOptions::step_size_max);
    f("maximize", &RpropOptions::maximize);
  }
};

/// ParamBuffers slots for Rprop (torch.optim.Rprop's state keys). prev starts as zeros,
/// step_size filled with the learning rate (rounded to float32), step as 0.
struct RpropState {
  enum : int { prev = 0, step_size = 1 };
  enum : int { step = 0 };  // scalar slot
  /// The slots' names, in slot order (torch.optim's state keys), for messages and bindings.
  static constexpr auto state_names = std::array{"prev", "step_size"};
  static constexpr auto scalar_names = std::array{"step"};
};

/// Sets a tensor's state as torch.optim.Rprop creates it: step = 0, prev = 0, step_size = lr.
/// Throws roundpipe::Error when lr < 0 (or NaN) or a state pointer is null (numel > 0).
void rprop_init_state(const RpropOptions& options, const ParamBuffers& tensor);

/// Runs one Rprop step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's step is incremented (torch's count; the update does not use it). Throws
/// roundpipe::Error naming the option or `tensors[i].<slot>` when an option is out of range or
/// a required pointer is null; nothing is modified then.
void rprop_step(const RpropOptions& options, const ParamBuffers* tensors, std::size_t count,
                StepIO* io = nullptr);

}  // namespace roundpipe
