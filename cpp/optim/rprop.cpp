// rprop_step and rprop_init_state (roundpipe/rprop.hpp): checks, the float32 hyperparameters,
// then the active ISA's kernel over all tensors on the worker pool.
#include "roundpipe/rprop.hpp"

#include <algorithm>
#include <string>

#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {
namespace {

// torch.optim.Rprop's constructor check, 0 < etaminus < 1 < etaplus, one option at a time. The
// step sizes are not checked, as in torch: a NaN bound makes every step size NaN.
void check_options(const char* fn, const RpropOptions& o) {
  if (!(o.etaminus > 0.0 && o.etaminus < 1.0))
    throw Error(std::string(fn) + ": etaminus must be in (0, 1), got " + detail::fmt(o.etaminus));
  if (!(o.etaplus > 1.0))
    throw Error(std::string(fn) + ": etaplus must be in (1, inf], got " + detail::fmt(o.etaplus));
}

}  // namespace

void rprop_init_state(const RpropOptions& o, const ParamBuffers& t) {
  constexpr const char* fn = "rprop_init_state";
  detail::check_range(fn, "lr", o.lr, 0.0);
  if (!t.scalar[RpropState::step]) throw Error(std::string(fn) + ": tensor.step is null");
  for (int k : {RpropState::prev, RpropState::step_size})
    if (t.numel != 0 && !t.state[k])
      throw Error(std::string(fn) + ": tensor." + RpropState::state_names[k] + " is null (numel " +
                  std::to_string(t.numel) + ")");
  *t.scalar[RpropState::step] = 0.0f;
  if (t.numel == 0) return;
  std::fill(t.state[RpropState::prev], t.state[RpropState::prev] + t.numel, 0.0f);
  std::fill(t.state[RpropState::step_size], t.state[RpropState::step_size] + t.numel,
            static_cast<float>(o.lr));
}

void rprop_step(const RpropOptions& o, const ParamBuffers* tensors, std::size_t count,
                StepIO* io) {
  constexpr const char* fn = "rprop_step";
  check_options(fn, o);
  detail::check_buffers<RpropState>(fn, tensors, count, detail::all_states<RpropState>(),
                                    detail::all_scalars<RpropState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  for (std::size_t i = 0; i < count; ++i) *tensors[i].scalar[RpropState::step] += 1.0f;
  const detail::RpropCoeffs c{
      detail::grad_coeffs(0.0, o.maximize),
      static_cast<float>(o.etaminus),
      static_cast<float>(o.etaplus),
      static_cast<float>(o.step_size_min),
      static_cast<float>(o.step_size_max),
  };
  const std::vector<detail::RpropCoeffs> coeffs(count, c);
  detail::run_kernel<RpropState>(kernels.rprop, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
