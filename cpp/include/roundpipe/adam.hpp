// Adam (and AdamW through decoupled_weight_decay): the stateless step over caller-owned buffers.
//
// Algorithm: Kingma & Ba, "Adam: A Method for Stochastic Optimization" (2015); AMSGrad from
// Reddi et al., "On the Convergence of Adam and Beyond" (2018); decoupled weight decay from
// Loshchilov & Hutter, "Decoupled Weight Decay Regularization" (2019). The update matches
// torch.optim.Adam (foreach=False) operation by operation: scalars such as the bias corrections
// are computed in double from the float32 step count, as torch does, and the element-wise math
// runs in float32.
#pragma once
#include <cstddef>

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
};

/// One parameter tensor's buffers: contiguous float32 arrays of `numel` elements each (any may
/// be null when numel == 0), all distinct except that grad is only read.
struct AdamTensor {
  float* param = nullptr;           ///< updated in place
  const float* grad = nullptr;      ///< read only
  float* exp_avg = nullptr;         ///< first moment, updated in place (start: zeros)
  float* exp_avg_sq = nullptr;      ///< second moment, updated in place (start: zeros)
  float* max_exp_avg_sq = nullptr;  ///< required iff amsgrad (start: zeros), else ignored
  float* step = nullptr;            ///< this tensor's step count (torch's float32 `step`); += 1
  std::size_t numel = 0;
};

/// Runs one Adam step on `count` tensors, spread over the worker pool, with the active ISA.
/// Each tensor's `*step` is incremented first and its new value drives the bias corrections.
/// Throws roundpipe::Error naming the option or `tensors[i].<field>` when an option is out of
/// range or a required pointer is null; nothing is modified then.
void adam_step(const AdamOptions& options, const AdamTensor* tensors, std::size_t count);

}  // namespace roundpipe
