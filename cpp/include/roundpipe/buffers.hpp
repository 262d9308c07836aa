// The buffers of one parameter tensor, as every step function takes them.
#pragma once
#include <cstddef>
#include <cstdint>

namespace roundpipe {

/// Element type of a mixed-precision gradient or model-copy array (ParamBuffers::grad16,
/// ParamBuffers::model_copy). bfloat16 and float16 arrays hold the 16-bit patterns.
enum class Dtype : std::uint8_t { float32, bfloat16, float16 };

/// One parameter tensor for a step call: contiguous float32 arrays (the gradient may instead be
/// bfloat16/float16, below) of `numel` elements and the
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

  /// Mixed precision (optional; see roundpipe/step_io.hpp). When `grad16` is set, the gradient
  /// is read from it as `grad16_dtype` (bfloat16 or float16) and `grad` is ignored: no float32
  /// gradient array is needed. When `model_copy` is set, the updated parameter is also written
  /// to it as `model_copy_dtype`, rounded to nearest even, in the same pass.
  const std::uint16_t* grad16 = nullptr;
  Dtype grad16_dtype = Dtype::bfloat16;
  void* model_copy = nullptr;
  Dtype model_copy_dtype = Dtype::bfloat16;
};

}  // namespace roundpipe
