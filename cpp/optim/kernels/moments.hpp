// The first part of the Adam family's update (Adam/AdamW, NAdam, RAdam), written once: torch's
// single-tensor code for the three is the same up to here.
//   g = maximize ? -grad : grad;  g = fmadd(p, wd, g) (L2) | p = p * (1 - lr * wd) (decoupled)
//   m = lerp(m, g, 1 - beta1);    v = fma((1 - beta2) * g, g, v * beta2)   (stored)
// torch's addcmul (self + value * t1 * t2) is what ATen's AVX2/AVX-512 kernels compute as
// fma(value * t1, t2, self); fmadd rounds twice on ISAs without FMA, as ATen's fallback does.
#pragma once

#include "gradient.hpp"
#include "roundpipe/buffers.hpp"

namespace roundpipe {
namespace detail {

struct MomentCoeffs {
  GradCoeffs grad;         // maximize, L2 weight decay (gradient.hpp; 0 when decoupled)
  float decay;             // decoupled: p *= decay (1: none)
  float lerp_weight;       // torch's lerp_ coefficient: w if |w| < 0.5, else w - 1
  bool lerp_from_end;      // |w| >= 0.5: lerp is end + (w - 1) * (end - start)
  float beta2;
  float one_minus_beta2;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

template <class V>
struct Moments {
  V p, g, m, v;  // decayed parameter, gradient, new exp_avg and exp_avg_sq
};

// Elements [i, i + V::width): loads grad, param and the moments, updates and stores the moments,
// returns what the algorithm's own update needs.
// The same on values: parameter p, raw gradient grad, exp_avg m and exp_avg_sq v as loaded.
template <class V>
inline Moments<V> step_moments(const detail::MomentCoeffs& c, V p, V grad, V m, V v) {
  const V g = prepare_grad(c.grad, grad, p);
  if (c.decay != 1.0f) p = p * V::set1(c.decay);
  m = torch_lerp(m, g, c.lerp_weight, c.lerp_from_end);
  v = fmadd(V::set1(c.one_minus_beta2) * g, g, v * V::set1(c.beta2));
  return {p, g, m, v};
}

template <class V>
inline Moments<V> update_moments(const detail::MomentCoeffs& c, const ParamBuffers& t,
                                 float* exp_avg, float* exp_avg_sq, std::size_t i) {
  const Moments<V> r = step_moments(c, V::load(t.param + i), V::load(t.grad + i),
                                    V::load(exp_avg + i), V::load(exp_avg_sq + i));
  r.m.store(exp_avg + i);
  r.v.store(exp_avg_sq + i);
  return r;
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
