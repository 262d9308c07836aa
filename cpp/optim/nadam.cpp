// nadam_step (roundpipe/nadam.hpp): checks, per-tensor scalars in double as torch.optim.NAdam
// computes them, then the active ISA's kernel over all tensors on the worker pool.
#include "roundpipe/nadam.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void nadam_step(const NAdamOptions& o, const ParamBuffers* tensors, std::size_t count,
                StepIO* io) {
  constexpr const char* fn = "nadam_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta1", o.beta1, 0.0, 1.0, true);
  detail::check_range(fn, "beta2", o.beta2, 0.0, 1.0, true);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_range(fn, "momentum_decay", o.momentum_decay, 0.0);
  detail::check_buffers<NAdamState>(fn, tensors, count, detail::all_states<NAdamState>(),
                                    detail::all_scalars<NAdamState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::MomentCoeffs moments = detail::moment_coeffs(
      o.lr, o.beta1, o.beta2, o.weight_decay, o.decoupled_weight_decay, o.maximize);
  std::vector<detail::NAdamCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[NAdamState::step];
    float& mu_product_t = *tensors[i].scalar[NAdamState::mu_product];
    step_t += 1.0f;
    const double step = step_t;
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    const double mu = o.beta1 * (1.0 - 0.5 * std::pow(0.96, step * o.momentum_decay));
    const double mu_next = o.beta1 * (1.0 - 0.5 * std::pow(0.96, (step + 1.0) * o.momentum_decay));
    // torch: `mu_product *= mu` on a 0-dim float32 tensor, i.e. a float32 product with mu
    // rounded to float32; the step sizes then read it back as a double (.item()).
    mu_product_t *= static_cast<float>(mu);
    const double mu_product = mu_product_t;
    const double mu_product_next = mu_product * mu_next;
    // With a float lr torch computes the two step sizes below in double and rounds them to
    // float32 in addcdiv_; with a tensor lr its expressions become float32 tensor arithmetic,
    // so torch's coefficients may then differ from these by an ulp or so.
    coeffs[i] = detail::NAdamCoeffs{
        moments,
        static_cast<float>(bias_correction2),
        static_cast<float>(o.eps),
        static_cast<float>(-o.lr * (1.0 - mu) / (1.0 - mu_product)),
        static_cast<float>((-o.lr * mu_next) / (1.0 - mu_product_next)),
    };
  }
  detail::run_kernel<NAdamState>(kernels.nadam, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
