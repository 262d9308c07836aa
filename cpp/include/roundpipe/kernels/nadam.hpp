// NAdam's element-wise update, written once over the SIMD vector types of roundpipe/simd.
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

namespace roundpipe {
namespace detail {

struct NAdamCoeffs {
  float weight_decay;       // L2 coefficient added to the gradient (0: none)
  float decay;              // decoupled: p *= decay (1: none)
  float lerp_weight;        // torch's lerp_ coefficient: w if |w| < 0.5, else w - 1
  bool lerp_from_end;       // |w| >= 0.5: lerp is end + (w - 1) * (end - start)
  float beta2;
  float one_minus_beta2;
  float bias_correction2;   // 1 - beta2^t
  float eps;
  float grad_coeff;         // -lr * (1 - mu_t) / (1 - mu_product_t)
  float exp_avg_coeff;      // -lr * mu_{t+1} / (1 - mu_product_t * mu_{t+1})
  bool maximize;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void nadam_kernel(const detail::NAdamCoeffs& c, const ParamBuffers& t, std::size_t begin,
                         std::size_t end) {
  float* const exp_avg = t.state[NAdamState::exp_avg];
  float* const exp_avg_sq = t.state[NAdamState::exp_avg_sq];
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
    V v = V::load(exp_avg_sq + i) * V::set1(c.beta2);
    v = fmadd(V::set1(c.one_minus_beta2) * g, g, v);  // addcmul_: fma(value * t1, t2, self)
    m.store(exp_avg + i);
    v.store(exp_avg_sq + i);
    const V denom = sqrt(v / V::set1(c.bias_correction2)) + V::set1(c.eps);
    p = p + V::set1(c.grad_coeff) * g / denom;
    p = p + V::set1(c.exp_avg_coeff) * m / denom;
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
