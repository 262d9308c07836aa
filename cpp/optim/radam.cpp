// radam_step (roundpipe/radam.hpp): checks, per-tensor scalars in double as torch.optim.RAdam
// computes them (including the choice of branch, rho_t > 5), then the active ISA's kernel over
// all tensors on the worker pool.
#include "roundpipe/radam.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void radam_step(const RAdamOptions& o, const ParamBuffers* tensors, std::size_t count,
                StepIO* io) {
  constexpr const char* fn = "radam_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta1", o.beta1, 0.0, 1.0, true);
  detail::check_range(fn, "beta2", o.beta2, 0.0, 1.0, true);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<RAdamState>(fn, tensors, count, detail::all_states<RAdamState>(),
                                    detail::all_scalars<RAdamState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::MomentCoeffs moments = detail::moment_coeffs(
      o.lr, o.beta1, o.beta2, o.weight_decay, o.decoupled_weight_decay, o.maximize);
  // Maximum length of the approximated simple moving average.
  const double rho_inf = 2.0 / (1.0 - o.beta2) - 1.0;
  std::vector<detail::RAdamCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[RAdamState::step];
    step_t += 1.0f;
    const double step = step_t;
    const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    const double rho_t = rho_inf - 2.0 * step * std::pow(o.beta2, step) / bias_correction2;
    const bool rectified = rho_t > 5.0;
    const double rect =
        rectified ? std::pow((rho_t - 4.0) * (rho_t - 2.0) * rho_inf /
                                 ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t),
                             0.5)
                  : 0.0;
    coeffs[i] = detail::RAdamCoeffs{
        moments,
        static_cast<float>(bias_correction1),
        static_cast<float>(o.lr),
        rectified,
        static_cast<float>(std::pow(bias_correction2, 0.5)),
        static_cast<float>(o.eps),
        static_cast<float>(rect),
    };
  }
  detail::run_kernel<RAdamState>(kernels.radam, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
