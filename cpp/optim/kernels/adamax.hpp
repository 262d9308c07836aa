// Adamax's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// AdamaxCoeffs holds one tensor's float32 coefficients, computed by adamax_step
// (cpp/optim/adamax.cpp) in double as torch.optim.Adamax computes them; the kernel applies, per
// element, the same sequence of float32 operations as torch's single-tensor Adamax:
//   g = maximize ? -grad : grad;   g = g + wd * p                      (grad.add(p, alpha=wd))
//   m = lerp(m, g, 1 - beta1)
//   u = maximum(u * beta2, |g| + eps)          (torch.maximum: a NaN in either operand wins)
//   p = p + (-clr * m) / u,  clr = lr / (1 - beta1^step)      (addcdiv_(m, u, value=-clr))
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/adamax.hpp"

namespace roundpipe {
namespace detail {

struct AdamaxCoeffs {
  GradCoeffs grad;         // maximize, L2 weight decay (gradient.hpp)
  float lerp_weight;       // torch's lerp_ coefficient: w if |w| < 0.5, else w - 1
  bool lerp_from_end;      // |w| >= 0.5: lerp is end + (w - 1) * (end - start)
  float beta2;
  float eps;
  float neg_clr;           // -lr / (1 - beta1^step)
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void adamax_kernel(detail::AdamaxCoeffs c, ParamBuffers t,
                          std::size_t begin, std::size_t end) {
  float* const exp_avg = t.state[AdamaxState::exp_avg];
  float* const exp_inf = t.state[AdamaxState::exp_inf];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, exp_avg, exp_inf);
    V p = V::load(t.param + i);
    const V g = load_grad(c.grad, t, i, p);
    V m = V::load(exp_avg + i);
    m = torch_lerp(m, g, c.lerp_weight, c.lerp_from_end);
    V u = V::load(exp_inf + i) * V::set1(c.beta2);
    u = maximum(u, abs(g) + V::set1(c.eps));
    p = p + V::set1(c.neg_clr) * m / u;
    m.store(exp_avg + i);
    u.store(exp_inf + i);
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
