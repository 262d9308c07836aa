// Adam's element-wise update, written once over the SIMD vector types of roundpipe/simd.
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

namespace roundpipe {
namespace detail {

struct AdamCoeffs {
  float weight_decay;      // L2 coefficient added to the gradient (0: none)
  float decay;             // decoupled: p *= decay (1: none)
  float lerp_weight;       // torch's lerp_ coefficient: w if |w| < 0.5, else w - 1
  bool lerp_from_end;      // |w| >= 0.5: lerp is end + (w - 1) * (end - start)
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;     // -lr / bias_correction1
  bool amsgrad;
  bool maximize;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void adam_kernel(const detail::AdamCoeffs& c, const ParamBuffers& t, std::size_t begin,
                        std::size_t end) {
  float* const exp_avg = t.state[AdamState::exp_avg];
  float* const exp_avg_sq = t.state[AdamState::exp_avg_sq];
  float* const max_exp_avg_sq = t.state[AdamState::max_exp_avg_sq];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    V g = V::load(t.grad + i);
    V p = V::load(t.param + i);
    if (c.maximize) g = -g;
    if (c.weight_decay != 0.0f) g = fmadd(p, V::set1(c.weight_decay), g);
    if (c.decay != 1.0f) p = p * V::set1(c.decay);
    V m = V::load(exp_avg + i);
    m = c.lerp_from_end ? fmadd(V::set1(c.lerp_weight), g - m, g)
                        : fmadd(V::set1(c.lerp_weight), g - m, m);
    // torch's addcmul: self + value * t1 * t2, which ATen's AVX2/AVX-512 kernels compute as
    // fma(value * t1, t2, self); fmadd rounds twice on ISAs without FMA, as ATen's fallback.
    V v = V::load(exp_avg_sq + i) * V::set1(c.beta2);
    v = fmadd(V::set1(c.one_minus_beta2) * g, g, v);
    m.store(exp_avg + i);
    v.store(exp_avg_sq + i);
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
