// asgd_step (roundpipe/asgd.hpp): checks, per-tensor coefficients from the stored eta and mu,
// the new eta and mu in double as torch.optim.ASGD computes them, then the active ISA's kernel
// over all tensors on the worker pool.
#include "roundpipe/asgd.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void asgd_step(const ASGDOptions& o, const ParamBuffers* tensors, std::size_t count,
               StepIO* io) {
  constexpr const char* fn = "asgd_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<ASGDState>(fn, tensors, count, detail::all_states<ASGDState>(),
                                   detail::all_scalars<ASGDState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::GradCoeffs grad = detail::grad_coeffs(o.weight_decay, o.maximize);
  std::vector<detail::ASGDCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[ASGDState::step];
    float& eta_t = *tensors[i].scalar[ASGDState::eta];
    float& mu_t = *tensors[i].scalar[ASGDState::mu];
    step_t += 1.0f;
    // This step uses the stored eta and mu (torch: eta_value = eta.item(); mu.item() != 1).
    const double eta = eta_t;
    coeffs[i] = detail::ASGDCoeffs{
        grad,
        /*decay=*/static_cast<float>(1.0 - o.lambd * eta),
        /*neg_eta=*/static_cast<float>(-eta),
        /*average=*/mu_t != 1.0f,
        mu_t,
        /*stream_ax=*/tensors[i].state_format[ASGDState::ax] == StateFormat::float32,
    };
    // Then the values for the next step, in Python floats, stored through float32 tensors:
    //   eta = lr / ((1 + lambd * lr * step) ** alpha);  mu = 1 / max(1, step - t0)
    // (Python's max(1, x) keeps 1 unless x > 1, NaN included.)
    const double step = step_t;
    eta_t = static_cast<float>(o.lr / std::pow(1.0 + o.lambd * o.lr * step, o.alpha));
    const double since_t0 = step - o.t0;
    mu_t = static_cast<float>(1.0 / (since_t0 > 1.0 ? since_t0 : 1.0));
  }
  detail::run_kernel<ASGDState>(kernels.asgd, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
