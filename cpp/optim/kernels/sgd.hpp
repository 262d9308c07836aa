// SGD's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// SGDCoeffs holds one tensor's float32 coefficients, computed by sgd_step (cpp/optim/sgd.cpp) as
// torch.optim.SGD computes them; the kernel applies, per element, the same sequence of float32
// operations as torch's single-tensor SGD (`add(x, alpha=a)` is fmadd(x, a, .) in ATen):
//   g = maximize ? -grad : grad;   g = fmadd(p, wd, g)                        (wd != 0)
//   buf = g (fresh) | buf = fmadd(g, 1 - dampening, buf * momentum)          (momentum != 0)
//   g = nesterov ? fmadd(buf, momentum, g) : buf
//   p = fmadd(g, -lr, p)
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/sgd.hpp"

namespace roundpipe {
namespace detail {

struct SGDCoeffs {
  GradCoeffs grad;            // maximize, L2 weight decay (gradient.hpp)
  float momentum;
  float one_minus_dampening;
  float neg_lr;               // -lr
  bool use_momentum;          // momentum != 0 (decided in double, as torch)
  bool fresh;                 // the momentum buffer holds no value yet: it becomes g
  bool nesterov;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void sgd_kernel(detail::SGDCoeffs c, ParamBuffers t, std::size_t begin,
                       std::size_t end) {
  float* const buf = t.state[SGDState::momentum_buffer];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad);
    V p = V::load(t.param + i);
    V g = load_grad(c.grad, t, i, p);
    if (c.use_momentum) {
      V b = c.fresh ? g
                    : fmadd(g, V::set1(c.one_minus_dampening),
                            V::load(buf + i) * V::set1(c.momentum));
      b.store(buf + i);
      g = c.nesterov ? fmadd(b, V::set1(c.momentum), g) : b;
    }
    p = fmadd(g, V::set1(c.neg_lr), p);
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
