// adagrad_step (roundpipe/adagrad.hpp): checks, per-tensor scalars in double as
// torch.optim.Adagrad computes them, then the active ISA's kernel over all tensors on the worker
// pool.
#include "roundpipe/adagrad.hpp"

#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void adagrad_step(const AdagradOptions& o, const ParamBuffers* tensors, std::size_t count,
                  StepIO* io) {
  constexpr const char* fn = "adagrad_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "lr_decay", o.lr_decay, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_buffers<AdagradState>(fn, tensors, count, detail::all_states<AdagradState>(),
                                      detail::all_scalars<AdagradState>(), io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::GradCoeffs grad = detail::grad_coeffs(o.weight_decay, o.maximize);
  std::vector<detail::AdagradCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float& step_t = *tensors[i].scalar[AdagradState::step];
    step_t += 1.0f;
    const double step = step_t;
    const double clr = o.lr / (1.0 + (step - 1.0) * o.lr_decay);
    coeffs[i] = detail::AdagradCoeffs{grad, static_cast<float>(o.eps), static_cast<float>(-clr)};
  }
  detail::run_kernel<AdagradState>(kernels.adagrad, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
