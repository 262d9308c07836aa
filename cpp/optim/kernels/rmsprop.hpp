// RMSprop's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// RMSpropCoeffs holds one tensor's float32 coefficients, computed by rmsprop_step
// (cpp/optim/rmsprop.cpp) as torch.optim.RMSprop computes them; the kernel applies, per element,
// the same sequence of float32 operations as torch's single-tensor RMSprop. ATen's
// addcmul(a, x, y, value=v) is fmadd(v * x, y, a) (contracted into an FMA in torch's AVX2/AVX-512
// builds, not in its no-FMA build, as our fmadd); addcdiv(a, x, y, value=v) is a + (v * x) / y;
// lerp as detail::lerp_coeff:
//   g = maximize ? -grad : grad;   g = fmadd(p, wd, g)                        (wd != 0)
//   sa = sa * alpha;  sa = fmadd((1 - alpha) * g, g, sa)
//   centered: ga = lerp(ga, g, 1 - alpha);  avg = sqrt(fmadd(-ga, ga, sa))  (addcmul, value=-1)
//   else:     avg = sqrt(sa)
//   avg = avg + eps
//   momentum > 0: buf = buf * momentum;  buf = buf + g / avg;  p = fmadd(buf, -lr, p)
//   otherwise:    p = p + (-lr * g) / avg
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/rmsprop.hpp"

namespace roundpipe {
namespace detail {

struct RMSpropCoeffs {
  GradCoeffs grad;         // maximize, L2 weight decay (gradient.hpp)
  float alpha;
  float one_minus_alpha;
  float lerp_weight;       // torch's lerp_ coefficient for 1 - alpha (detail::lerp_coeff)
  bool lerp_from_end;
  float eps;
  float momentum;
  bool use_momentum;       // momentum > 0 (decided in double, as torch)
  float neg_lr;            // -lr
  bool centered;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void rmsprop_kernel(detail::RMSpropCoeffs c, ParamBuffers t,
                           std::size_t begin, std::size_t end) {
  float* const square_avg = t.state[RMSpropState::square_avg];
  float* const momentum_buffer = t.state[RMSpropState::momentum_buffer];
  float* const grad_avg = t.state[RMSpropState::grad_avg];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, square_avg);
    V p = V::load(t.param + i);
    const V g = load_grad(c.grad, t, i, p);
    V sa = V::load(square_avg + i) * V::set1(c.alpha);
    sa = fmadd(V::set1(c.one_minus_alpha) * g, g, sa);
    sa.store(square_avg + i);
    V var = sa;
    if (c.centered) {
      V ga = V::load(grad_avg + i);
      ga = torch_lerp(ga, g, c.lerp_weight, c.lerp_from_end);
      ga.store(grad_avg + i);
      var = fmadd(-ga, ga, sa);
    }
    const V avg = sqrt(var) + V::set1(c.eps);
    if (c.use_momentum) {
      V b = V::load(momentum_buffer + i) * V::set1(c.momentum);
      b = b + g / avg;
      b.store(momentum_buffer + i);
      p = fmadd(b, V::set1(c.neg_lr), p);
    } else {
      p = p + V::set1(c.neg_lr) * g / avg;
    }
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
