// The buffers of one parameter tensor, as every step function takes them.
#pragma once
#include <cstddef>
#include <cstdint>

namespace roundpipe {

/// Element type of a mixed-precision gradient or model-copy array (ParamBuffers::grad16,
/// ParamBuffers::model_copy). bfloat16 and float16 arrays hold the 16-bit patterns.
enum class Dtype : std::uint8_t { float32, bfloat16, float16 };

/// How a state array is stored (ParamBuffers::state_format; roundpipe/compact.hpp):
/// - float32: `state[k]`, float32[numel];
/// - bfloat16: `packed_state[k]`, std::uint16_t[numel] (bfloat16 bit patterns), read as float32
///   and rounded stochastically when stored;
/// - int8: `packed_state[k]`, std::uint8_t[numel] codes of the 8-bit dynamic map, with
///   `state_absmax[k]`, float[quant_blocks(numel)]: one scale per block of kQuantBlock elements.
enum class StateFormat : std::uint8_t { float32, bfloat16, int8 };

/// One parameter tensor for a step call: contiguous float32 arrays (the gradient may instead be
/// bfloat16/float16, the parameter bfloat16 and the state compact, below) of `numel` elements and the
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
  /// The last two sizes of a tensor of two or more dimensions (numel / (rows * cols) matrices);
  /// 0 for a vector or a 0-dim tensor. Only algorithms that factor their state (Adafactor)
  /// read them.
  std::size_t rows = 0, cols = 0;

  /// Mixed precision (optional; see roundpipe/step_io.hpp). When `grad16` is set, the gradient
  /// is read from it as `grad16_dtype` (bfloat16 or float16) and `grad` is ignored: no float32
  /// gradient array is needed. When `model_copy` is set, the updated parameter is also written
  /// to it as `model_copy_dtype`, rounded to nearest even, in the same pass.
  const std::uint16_t* grad16 = nullptr;
  Dtype grad16_dtype = Dtype::bfloat16;
  void* model_copy = nullptr;
  Dtype model_copy_dtype = Dtype::bfloat16;

  /// Compact storage (optional; roundpipe/compact.hpp). Each chunk of the tensor is then read
  /// into small float32 buffers that stay in L1, updated by the algorithm's unchanged float32
  /// arithmetic and written back in its compact form, in the same pass over memory: no float32
  /// copy of a compact array ever exists.
  /// - `param_bf16`: the parameter is this bfloat16 array (`param` is ignored), written back
  ///   with stochastic rounding (seeded by `rounding_seed`; the expected stored value is the
  ///   float32 update).
  /// - `state_format[k]`, `packed_state[k]`, `state_absmax[k]`: state slot k stored as
  ///   StateFormat says; bfloat16 state is rounded stochastically too; int8 state is
  ///   requantised per block with the block's new absolute maximum (round to nearest code).
  /// - `rounding_seed`: this tensor's stream of rounding bits. Step functions of algorithms that
  ///   count steps mix in the tensor's new step count, so a constant seed per tensor (e.g.
  ///   roundpipe::rounding_seed(seed, index)) gives new bits at every step; SGD, which keeps no
  ///   step, uses it as given (vary it between steps). The bits depend only on the seed, the
  ///   step and the element's index: not on the thread count or how the work is split.
  std::uint16_t* param_bf16 = nullptr;
  StateFormat state_format[kMaxState] = {};
  void* packed_state[kMaxState] = {};
  float* state_absmax[kMaxState] = {};
  std::uint64_t rounding_seed = 0;
};

}  // namespace roundpipe
