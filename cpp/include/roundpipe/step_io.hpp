// Per-call options and results of the mixed-precision path of every step function.
#pragma once

namespace roundpipe {

/// Optional last argument of every `<algo>_step(options, tensors, count, io)`.
///
/// With `io` given (or any tensor with ParamBuffers::grad16 / model_copy set), each chunk of a
/// tensor runs as: gradient -> float32 (from bfloat16/float16 if grad16 is set), multiplied by
/// `1 / grad_scale` rounded to float32 (as torch's GradScaler unscales), checked for inf/NaN and
/// optionally squared and summed, then multiplied by `grad_clip` rounded to float32 (a second
/// rounding, as torch.nn.utils.clip_grad_norm_ after GradScaler.unscale_; skipped when it is
/// 1), into a small per-thread buffer that stays in L1; the
/// algorithm's unchanged update on it; the updated parameter rounded into model_copy. The
/// result is bit-identical to converting and unscaling the gradient into a float32 tensor,
/// stepping, and rounding the parameter separately, with only the bytes of the fused pass moved
/// (e.g. Adam with bf16 gradient and copy: 2 + 24 + 2 bytes per element instead of 40).
///
/// The update is applied even when a gradient is inf or NaN (the algorithm's arithmetic then
/// spreads it, as torch.optim would); `found_inf` reports it afterwards. To skip such a step,
/// check the gradients first.
struct StepIO {
  double grad_scale = 1.0;      ///< in: gradients are multiplied by float(1 / grad_scale); > 0, finite
  double grad_clip = 1.0;       ///< in: then by float(grad_clip) (clipping coefficient); finite
  bool want_grad_norm = false;  ///< in: compute grad_norm_sq
  bool found_inf = false;       ///< out: some unscaled gradient element was inf or NaN
  double grad_norm_sq = 0.0;    ///< out: sum of squares of the unscaled gradients (if wanted),
                                ///< before grad_clip;
                                ///< summed per 16384-element chunk in a fixed order, so the
                                ///< result does not depend on the thread count
};

}  // namespace roundpipe
