// The buffers of one parameter tensor, as every step function takes them.
#pragma once
#include <cstddef>

namespace roundpipe {

/// One parameter tensor for a step call: contiguous float32 arrays of `numel` elements and the
/// tensor's 0-dim float32 state values (torch.optim keeps these as 0-dim float32 tensors).
///
/// What each `state` and `scalar` slot holds is fixed per algorithm and named in its header
/// (e.g. AdamState::exp_avg). In an algorithm that counts steps (all but SGD), `scalar[0]` is
/// the step count, which the step function increments. SGD keeps no step (torch.optim.SGD has
/// none); its `scalar[0]` is a 0/1 flag saying whether the momentum buffer holds a value yet,
/// which is not torch state (SGDState in roundpipe/sgd.hpp). Arrays may be null when numel == 0;
/// a slot the algorithm does not use (or, like Adam's max_exp_avg_sq, uses only under an option)
/// may be null. New state starts as torch initialises it: zeros unless the algorithm's header
/// says otherwise (Adagrad's sum starts at initial_accumulator_value).
struct ParamBuffers {
  static constexpr int kMaxState = 3;
  static constexpr int kMaxScalar = 3;

  float* param = nullptr;               ///< updated in place
  const float* grad = nullptr;          ///< read only
  float* state[kMaxState] = {};         ///< per-element state, updated in place
  float* scalar[kMaxScalar] = {};       ///< 0-dim state ([0]: step), updated in place
  std::size_t numel = 0;
};

}  // namespace roundpipe
