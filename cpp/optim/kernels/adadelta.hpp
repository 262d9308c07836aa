// Adadelta's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// AdadeltaCoeffs holds the float32 coefficients adadelta_step (cpp/optim/adadelta.cpp) derives
// from the options as torch.optim.Adadelta does; the kernel applies, per element, the same
// sequence of float32 operations as torch's single-tensor Adadelta:
//   g = maximize ? -grad : grad;   g = g + wd * p                      (grad.add(p, alpha=wd))
//   sq = fma((1 - rho) * g, g, sq * rho)                    (mul_(rho).addcmul_(g, g, 1 - rho))
//   delta = sqrt(acc + eps) / sqrt(sq + eps) * g
//   acc = fma((1 - rho) * delta, delta, acc * rho);   p = fma(delta, -lr, p)
// torch's addcmul is self + value * t1 * t2 in C++, and GCC contracts it (vector and scalar
// lambdas alike) into fma(value * t1, t2, self) in ATen's AVX2 and AVX-512 kernels; its
// DEFAULT (no FMA) kernels round twice, as our scalar ISA's fmadd does.
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/adadelta.hpp"

namespace roundpipe {
namespace detail {

struct AdadeltaCoeffs {
  GradCoeffs grad;         // maximize, L2 weight decay (gradient.hpp)
  float rho;
  float one_minus_rho;
  float eps;
  float neg_lr;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void adadelta_kernel(detail::AdadeltaCoeffs c, ParamBuffers t,
                            std::size_t begin, std::size_t end) {
  float* const square_avg = t.state[AdadeltaState::square_avg];
  float* const acc_delta = t.state[AdadeltaState::acc_delta];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, square_avg, acc_delta);
    V p = V::load(t.param + i);
    const V g = load_grad(c.grad, t, i, p);
    const V rho = V::set1(c.rho), one_minus_rho = V::set1(c.one_minus_rho), eps = V::set1(c.eps);
    V sq = V::load(square_avg + i) * rho;
    sq = fmadd(one_minus_rho * g, g, sq);
    const V std_ = sqrt(sq + eps);
    V acc = V::load(acc_delta + i);
    const V delta = sqrt(acc + eps) / std_ * g;
    acc = acc * rho;
    acc = fmadd(one_minus_rho * delta, delta, acc);
    p = fmadd(delta, V::set1(c.neg_lr), p);
    sq.store(square_avg + i);
    acc.store(acc_delta + i);
    p.store(t.param + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
