// The opening every algorithm's update shares, written once: the gradient as torch.optim's
// single-tensor code prepares it,
//   g = maximize ? -grad : grad;   g = g + weight_decay * p   (if weight_decay != 0)
// (`grad.add(param, alpha=weight_decay)`, which ATen computes as fmadd(p, wd, g): fused on ISAs
// with FMA, rounded twice on the others, as our fmadd). torch decides `weight_decay != 0` in
// Python, on the double, and rounds the coefficient to float32 only inside the op, so
// grad_coeffs does the same: a weight decay that rounds to 0 in float32 still adds 0 * p (NaN
// where p is inf or NaN, as in torch).
#pragma once
#include <cstddef>

#include "roundpipe/buffers.hpp"

namespace roundpipe {
namespace detail {

struct GradCoeffs {
  bool maximize;
  bool l2;             // add weight_decay * p (weight_decay != 0, decided on the double)
  float weight_decay;  // rounded to float32, as ATen rounds the op's alpha
};

// `weight_decay` is the L2 coefficient added to the gradient: 0 for algorithms without it and
// for decoupled weight decay (which scales the parameter instead).
inline GradCoeffs grad_coeffs(double weight_decay, bool maximize) {
  return GradCoeffs{maximize, weight_decay != 0.0, static_cast<float>(weight_decay)};
}

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// Elements [i, i + V::width) of the gradient of `t`, prepared as above; `p` holds the same
// elements of the parameter (loaded by the caller, which updates it).
// The gradient g prepared as above, given the same elements p of the parameter.
template <class V>
inline V prepare_grad(const detail::GradCoeffs& c, V g, V p) {
  if (c.maximize) g = -g;
  if (c.l2) g = fmadd(p, V::set1(c.weight_decay), g);
  return g;
}

template <class V>
inline V load_grad(const detail::GradCoeffs& c, const ParamBuffers& t, std::size_t i, V p) {
  return prepare_grad(c, V::load(t.grad + i), p);
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
