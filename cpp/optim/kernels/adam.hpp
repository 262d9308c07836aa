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
#include "compact.hpp"
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// The parameter's update from the decayed parameter p and the moments m and v (v the maximum
// so far with amsgrad).
template <class V>
inline V adam_param(const detail::AdamCoeffs& c, V p, V m, V v) {
  V denom = sqrt(v) / V::set1(c.bias_correction2_sqrt) + V::set1(c.eps);
  return p + V::set1(c.neg_step_size) * m / denom;
}

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
    adam_param(c, p, m, v).store(t.param + i);
  });
}

// The same update on a slice of compact storage, each array converted inside the loop
// (compact_slice in kernels/compact.hpp): the same bits as the staged passes around adam_kernel.
// False, having done nothing, where compact_slice does not run the slice's combination.
inline bool adam_compact_kernel(detail::AdamCoeffs c, const detail::CompactSlice& s) {
  return compact_slice(s, [c](auto& p, auto g, auto* st) {
    auto [q, g2, m, v] = step_moments(c.moments, p, g, st[AdamState::exp_avg],
                                      st[AdamState::exp_avg_sq]);
    st[AdamState::exp_avg] = m;
    st[AdamState::exp_avg_sq] = v;
    if (c.amsgrad) {
      v = maximum(st[AdamState::max_exp_avg_sq], v);
      st[AdamState::max_exp_avg_sq] = v;
    }
    p = adam_param(c, q, m, v);
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
