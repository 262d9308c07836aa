// Adam's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// AdamCoeffs holds one tensor's float32 coefficients, computed by adam_step (cpp/optim/adam.cpp)
// in double exactly as torch.optim.Adam computes them; the kernel applies, per element, the same
// sequence of float32 operations as torch's single-tensor Adam:
//   g = maximize ? -grad : grad;  g = g + wd * p (L2) | p = p * (1 - lr * wd) (decoupled)
//   m = lerp(m, g, 1 - beta1);    v = fma((1 - beta2) * g, g, v * beta2)
//   vmax = max(vmax, v) (amsgrad);  p = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)
#pragma once
#include <cstddef>

#include "roundpipe/adam.hpp"
#include "moments.hpp"

namespace roundpipe {
namespace detail {

struct AdamCoeffs {
  MomentCoeffs moments;     // gradient, weight decay and the two moments (moments.hpp)
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;     // -lr / bias_correction1
  bool amsgrad;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void adam_kernel(detail::AdamCoeffs c, ParamBuffers t, std::size_t begin,
                        std::size_t end) {
  float* const exp_avg = t.state[AdamState::exp_avg];
  float* const exp_avg_sq = t.state[AdamState::exp_avg_sq];
  float* const max_exp_avg_sq = t.state[AdamState::max_exp_avg_sq];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, exp_avg, exp_avg_sq);
    auto [p, g, m, v] = update_moments<V>(c.moments, t, exp_avg, exp_avg_sq, i);
    if (c.amsgrad) {
      v = maximum(V::load(max_exp_avg_sq + i), v);
      v.store(max_exp_avg_sq + i);
    }
    V denom = sqrt(v) / V::set1(c.bias_correction2_sqrt) + V::set1(c.eps);
    p = p + V::set1(c.neg_step_size) * m / denom;
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
