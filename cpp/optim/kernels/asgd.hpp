// ASGD's element-wise update, written once over the SIMD vector types of cpp/optim/simd.
//
// ASGDCoeffs holds one tensor's float32 coefficients, computed by asgd_step (cpp/optim/asgd.cpp)
// from the tensor's stored eta and mu as torch.optim.ASGD computes them; the kernel applies, per
// element, the same sequence of float32 operations as torch's single-tensor ASGD:
//   g = maximize ? -grad : grad;   g = g + wd * p                      (grad.add(p, alpha=wd))
//   p = p * (1 - lambd * eta);     p = p + (-eta) * g                  (add_(g, alpha=-eta))
//   ax = mu != 1 ? ax + (p - ax) * mu : p              (ax.add_(p.sub(ax).mul_(mu)) / copy_)
// ax = p (before averaging starts) is a write-only stream: where the ISA has non-temporal stores
// and ax is aligned, they write it without first reading its cache lines (a read for ownership
// per line otherwise, which, with no load of ax to start the prefetchers, left ASGD at ~65% of
// the traffic floor).
#pragma once
#include <cstddef>
#include <cstdint>

#include "gradient.hpp"
#include "roundpipe/asgd.hpp"

namespace roundpipe {
namespace detail {

struct ASGDCoeffs {
  GradCoeffs grad;         // maximize, L2 weight decay (gradient.hpp)
  float decay;             // 1 - lambd * eta
  float neg_eta;
  bool average;            // mu != 1: ax moves towards p by mu; otherwise ax = p
  float mu;
  bool stream_ax;          // ax is the tensor's own float32 array (not a staged copy): ax = p
                           // may be written with non-temporal stores
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

inline void asgd_kernel(detail::ASGDCoeffs c, ParamBuffers t, std::size_t begin,
                        std::size_t end) {
  float* const ax = t.state[ASGDState::ax];
  const bool stream = !c.average && c.stream_ax &&
                      reinterpret_cast<std::uintptr_t>(ax + begin) % Vec::stream_f32_align == 0;
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad);
    V p = V::load(t.param + i);
    const V g = load_grad(c.grad, t, i, p);
    p = p * V::set1(c.decay);
    p = fmadd(g, V::set1(c.neg_eta), p);
    p.store(t.param + i);
    if (c.average) {
      const V a = V::load(ax + i);
      (a + (p - a) * V::set1(c.mu)).store(ax + i);
    } else if (stream) {
      p.stream(ax + i);
    } else {
      p.store(ax + i);
    }
  });
  if (stream) Vec::stream_fence();
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
