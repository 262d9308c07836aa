// RAdam's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// RAdamCoeffs holds one tensor's float32 coefficients, computed by radam_step
// (cpp/optim/radam.cpp) in double exactly as torch.optim.RAdam computes them; the kernel applies,
// per element, the same sequence of float32 operations as torch's single-tensor RAdam:
//   g = maximize ? -grad : grad;  g = g + wd * p (L2) | p = p * (1 - lr * wd) (decoupled)
//   m = lerp(m, g, 1 - beta1);    v = v * beta2 + (1 - beta2) * g * g
//   m_hat = m / bias_correction1
//   rectified (rho_t > 5):  p = p - ((m_hat * lr) * ((1 / (sqrt(v) + eps)) * sqrt(bc2))) * rect
//   otherwise:              p = p - m_hat * lr
// (torch writes the adaptive term as `bias_correction2 ** 0.5 / (sqrt(v) + eps)`, a Python float
// divided by a tensor, which Tensor.__rtruediv__ evaluates as reciprocal() * float.)
#pragma once
#include <cstddef>

#include "roundpipe/radam.hpp"
#include "moments.hpp"

namespace roundpipe {
namespace detail {

struct RAdamCoeffs {
  MomentCoeffs moments;     // gradient, weight decay and the two moments (moments.hpp)
  float bias_correction1;   // 1 - beta1^t
  float lr;
  bool rectified;           // rho_t > 5
  float bias_correction2_sqrt;  // (1 - beta2^t)^0.5   (rectified only)
  float eps;                //                          (rectified only)
  float rect;               // r_t                      (rectified only)
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void radam_kernel(detail::RAdamCoeffs c, ParamBuffers t, std::size_t begin,
                         std::size_t end) {
  float* const exp_avg = t.state[RAdamState::exp_avg];
  float* const exp_avg_sq = t.state[RAdamState::exp_avg_sq];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, exp_avg, exp_avg_sq);
    auto [p, g, m, v] = update_moments<V>(c.moments, t, exp_avg, exp_avg_sq, i);
    V update = m / V::set1(c.bias_correction1) * V::set1(c.lr);
    if (c.rectified) {
      const V adaptive = V::set1(1.0f) / (sqrt(v) + V::set1(c.eps)) *
                         V::set1(c.bias_correction2_sqrt);
      update = update * adaptive * V::set1(c.rect);
    }
    p = p - update;
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
