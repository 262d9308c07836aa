// rmsprop_step (roundpipe/rmsprop.hpp): checks, per-tensor float32 coefficients as
// torch.optim.RMSprop passes them to its tensor ops, then the active ISA's kernel over all
// tensors on the worker pool.
#include "roundpipe/rmsprop.hpp"

#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void rmsprop_step(const RMSpropOptions& o, const ParamBuffers* tensors, std::size_t count,
                  StepIO* io) {
  constexpr const char* fn = "rmsprop_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "alpha", o.alpha, 0.0);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_range(fn, "momentum", o.momentum, 0.0);
  const unsigned mask = 0b001u | (o.momentum > 0.0 ? 0b010u : 0u) | (o.centered ? 0b100u : 0u);
  detail::check_buffers<RMSpropState>(fn, tensors, count, mask,
                                      detail::all_scalars<RMSpropState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::Lerp lerp = detail::lerp_coeff(1.0 - o.alpha);
  const detail::RMSpropCoeffs c{
      detail::grad_coeffs(o.weight_decay, o.maximize),
      static_cast<float>(o.alpha),
      static_cast<float>(1.0 - o.alpha),
      lerp.weight,
      lerp.from_end,
      static_cast<float>(o.eps),
      static_cast<float>(o.momentum),
      o.momentum > 0.0,
      static_cast<float>(-o.lr),
      o.centered,
  };
  for (std::size_t i = 0; i < count; ++i) *tensors[i].scalar[RMSpropState::step] += 1.0f;
  const std::vector<detail::RMSpropCoeffs> coeffs(count, c);
  detail::run_kernel<RMSpropState>(kernels.rmsprop, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
