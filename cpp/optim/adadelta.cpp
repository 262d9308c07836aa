// adadelta_step (roundpipe/adadelta.hpp): checks, coefficients as torch.optim.Adadelta derives
// them, then the active ISA's kernel over all tensors on the worker pool.
#include "roundpipe/adadelta.hpp"

#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void adadelta_step(const AdadeltaOptions& o, const ParamBuffers* tensors, std::size_t count,
                   StepIO* io) {
  constexpr const char* fn = "adadelta_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "rho", o.rho, 0.0, 1.0);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<AdadeltaState>(fn, tensors, count, detail::all_states<AdadeltaState>(),
                                       detail::all_scalars<AdadeltaState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  // The same for every tensor: Adadelta's update does not depend on the step count.
  const detail::AdadeltaCoeffs c{
      detail::grad_coeffs(o.weight_decay, o.maximize),
      static_cast<float>(o.rho),
      static_cast<float>(1.0 - o.rho),
      static_cast<float>(o.eps),
      static_cast<float>(-o.lr),
  };
  for (std::size_t i = 0; i < count; ++i) *tensors[i].scalar[AdadeltaState::step] += 1.0f;
  const std::vector<detail::AdadeltaCoeffs> coeffs(count, c);
  detail::run_kernel<AdadeltaState>(kernels.adadelta, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
