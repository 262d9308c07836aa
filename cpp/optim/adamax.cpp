// adamax_step (roundpipe/adamax.hpp): checks, per-tensor step sizes in double as
// torch.optim.Adamax computes them, then the active ISA's kernel over all tensors on the pool.
#include "roundpipe/adamax.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void adamax_step(const AdamaxOptions& o, const ParamBuffers* tensors, std::size_t count,
                 StepIO* io) {
  constexpr const char* fn = "adamax_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta1", o.beta1, 0.0, 1.0, true);
  detail::check_range(fn, "beta2", o.beta2, 0.0, 1.0, true);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<AdamaxState>(fn, tensors, count, detail::all_states<AdamaxState>(),
                                     detail::all_scalars<AdamaxState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::GradCoeffs grad = detail::grad_coeffs(o.weight_decay, o.maximize);
  const detail::Lerp lerp = detail::lerp_coeff(1.0 - o.beta1);
  std::vector<detail::AdamaxCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[AdamaxState::step];
    step_t += 1.0f;
    // torch: bias_correction = 1 - beta1 ** step_t.item(); clr = lr / bias_correction.
    const double bias_correction = 1.0 - std::pow(o.beta1, static_cast<double>(step_t));
    const double clr = o.lr / bias_correction;
    coeffs[i] = detail::AdamaxCoeffs{
        grad,
        lerp.weight,
        lerp.from_end,
        static_cast<float>(o.beta2),
        static_cast<float>(o.eps),
        static_cast<float>(-clr),
    };
  }
  detail::run_kernel<AdamaxState>(kernels.adamax, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
