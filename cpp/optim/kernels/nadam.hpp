// NAdam's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// NAdamCoeffs holds one tensor's float32 coefficients, computed by nadam_step
// (cpp/optim/nadam.cpp) in double exactly as torch.optim.NAdam computes them; the kernel applies,
// per element, the same sequence of float32 operations as torch's single-tensor NAdam:
//   g = maximize ? -grad : grad;  g = g + wd * p (L2) | p = p * (1 - lr * wd) (decoupled)
//   m = lerp(m, g, 1 - beta1);    v = v * beta2 + (1 - beta2) * g * g
//   denom = sqrt(v / bias_correction2) + eps
//   p = p + (grad_coeff * g) / denom;  p = p + (exp_avg_coeff * m) / denom   (two addcdiv_)
#pragma once
#include <cstddef>

#include "roundpipe/nadam.hpp"
#include "moments.hpp"

namespace roundpipe {
namespace detail {

struct NAdamCoeffs {
  MomentCoeffs moments;     // gradient, weight decay and the two moments (moments.hpp)
  float bias_correction2;   // 1 - beta2^t
  float eps;
  float grad_coeff;         // -lr * (1 - mu_t) / (1 - mu_product_t)
  float exp_avg_coeff;      // -lr * mu_{t+1} / (1 - mu_product_t * mu_{t+1})
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void nadam_kernel(detail::NAdamCoeffs c, ParamBuffers t, std::size_t begin,
                         std::size_t end) {
  float* const exp_avg = t.state[NAdamState::exp_avg];
  float* const exp_avg_sq = t.state[NAdamState::exp_avg_sq];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, exp_avg, exp_avg_sq);
    auto [p, g, m, v] = update_moments<V>(c.moments, t, exp_avg, exp_avg_sq, i);
    const V denom = sqrt(v / V::set1(c.bias_correction2)) + V::set1(c.eps);
    p = p + V::set1(c.grad_coeff) * g / denom;
    p = p + V::set1(c.exp_avg_coeff) * m / denom;
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
