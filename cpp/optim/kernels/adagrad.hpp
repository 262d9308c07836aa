// Adagrad's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// AdagradCoeffs holds one tensor's float32 coefficients, computed by adagrad_step
// (cpp/optim/adagrad.cpp) in double as torch.optim.Adagrad computes them; the kernel applies,
// per element, the same sequence of float32 operations as torch's single-tensor Adagrad. ATen's
// addcmul(a, x, y, value=v) is fmadd(v * x, y, a) (its a + v * x * y is contracted into an FMA in
// torch's AVX2/AVX-512 builds, and is not in its no-FMA build, as our fmadd); addcdiv(a, x, y,
// value=v) is a + (v * x) / y:
//   g = maximize ? -grad : grad;   g = fmadd(p, wd, g)                        (wd != 0)
//   sum = fmadd(g, g, sum);        p = p + (-clr * g) / (sqrt(sum) + eps)
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/adagrad.hpp"

namespace roundpipe {
namespace detail {

struct AdagradCoeffs {
  GradCoeffs grad;     // maximize, L2 weight decay (gradient.hpp)
  float eps;
  float neg_clr;       // -lr / (1 + (step - 1) * lr_decay)
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void adagrad_kernel(detail::AdagradCoeffs c, ParamBuffers t,
                           std::size_t begin, std::size_t end) {
  float* const sum = t.state[AdagradState::sum];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, sum);
    V p = V::load(t.param + i);
    const V g = load_grad(c.grad, t, i, p);
    const V s = fmadd(g, g, V::load(sum + i));
    s.store(sum + i);
    const V std = sqrt(s) + V::set1(c.eps);
    p = p + V::set1(c.neg_clr) * g / std;
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
