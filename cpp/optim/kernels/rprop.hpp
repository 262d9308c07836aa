// Rprop's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// RpropCoeffs holds the float32 hyperparameters (torch rounds each where it enters a float32
// tensor op); the kernel applies, per element, torch's single-tensor Rprop sequence literally:
//   g = maximize ? -grad : grad
//   s = sign(g * prev)            torch.sign: +1, -1, or 0 (for +-0 and for NaN)
//   s = s > 0 ? etaplus : s;  s = s < 0 ? etaminus : s;  s = s == 0 ? 1 : s
//   step_size = clamp(step_size * s, min, max)    (NaN in, or as a bound: NaN; max wins when max < min)
//   g = s == etaminus ? 0 : g
//   p = p + (-sign(g)) * step_size;  prev = g
// Written as torch's masked assignments, not as the textbook three cases, so that corner
// cases land where torch puts them: etas that round to 1 or 0 in float32, 0 * inf = NaN
// when a zeroed gradient meets an infinite step size, and NaN products.
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/rprop.hpp"

namespace roundpipe {
namespace detail {

struct RpropCoeffs {
  GradCoeffs grad;         // maximize (no weight decay: gradient.hpp)
  float etaminus;
  float etaplus;
  float step_size_min;
  float step_size_max;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// torch.sign for float: (0 < x) - (x < 0); NaN and -0 give +0.
template <class V>
inline V rprop_sign(V x) {
  const V zero = V::set1(0.0f);
  return select(x > zero, V::set1(1.0f), zero) - select(x < zero, V::set1(1.0f), zero);
}

inline void rprop_kernel(detail::RpropCoeffs c, ParamBuffers t, std::size_t begin,
                         std::size_t end) {
  float* const prev = t.state[RpropState::prev];
  float* const step_size = t.state[RpropState::step_size];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad, prev, step_size);
    const V zero = V::set1(0.0f);
    const V etaminus = V::set1(c.etaminus);
    const V p = V::load(t.param + i);
    V g = load_grad(c.grad, t, i, p);
    V s = rprop_sign(g * V::load(prev + i));
    s = select(s > zero, V::set1(c.etaplus), s);
    s = select(s < zero, etaminus, s);
    s = select(s == zero, V::set1(1.0f), s);
    V ss = V::load(step_size + i) * s;
    ss = minimum(maximum(ss, V::set1(c.step_size_min)), V::set1(c.step_size_max));
    ss.store(step_size + i);
    g = select(s == etaminus, zero, g);
    (p + -rprop_sign(g) * ss).store(t.param + i);
    g.store(prev + i);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
