// adam_step (roundpipe/adam.hpp): checks, per-tensor scalars in double as torch.optim.Adam
// computes them, then the active ISA's kernel over all tensors on the worker pool.
#include "roundpipe/adam.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void adam_step(const AdamOptions& o, const ParamBuffers* tensors, std::size_t count,
               StepIO* io) {
  constexpr const char* fn = "adam_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta1", o.beta1, 0.0, 1.0, true);
  detail::check_range(fn, "beta2", o.beta2, 0.0, 1.0, true);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<AdamState>(fn, tensors, count, o.amsgrad ? 0b111u : 0b011u,
                                   detail::all_scalars<AdamState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::MomentCoeffs moments = detail::moment_coeffs(
      o.lr, o.beta1, o.beta2, o.weight_decay, o.decoupled_weight_decay, o.maximize);
  std::vector<detail::AdamCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[AdamState::step];
    step_t += 1.0f;
    const double step = step_t;
    const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    coeffs[i] = detail::AdamCoeffs{
        moments,
        static_cast<float>(std::pow(bias_correction2, 0.5)),
        static_cast<float>(o.eps),
        static_cast<float>(-(o.lr / bias_correction1)),
        o.amsgrad,
    };
  }
  detail::run_kernel<AdamState>(kernels.adam, coeffs.data(), tensors, count, io,
                                kernels.adam_compact);
}

}  // namespace roundpipe
