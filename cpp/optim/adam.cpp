// adam_step (roundpipe/adam.hpp): checks, per-tensor scalars in double as torch.optim.Adam
// computes them, then the active ISA's kernel over all tensors on the worker pool.
#include "roundpipe/adam.hpp"

#include <cmath>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void adam_step(const AdamOptions& o, const AdamTensor* tensors, std::size_t count) {
  constexpr const char* fn = "adam_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta1", o.beta1, 0.0, 1.0, true);
  detail::check_range(fn, "beta2", o.beta2, 0.0, 1.0, true);
  detail::check_range(fn, "eps", o.eps, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  if (count != 0 && tensors == nullptr) throw Error("adam_step: tensors is null");
  for (std::size_t i = 0; i < count; ++i) {
    const AdamTensor& t = tensors[i];
    detail::check_buffer(fn, i, "param", t.param, t.numel);
    detail::check_buffer(fn, i, "grad", t.grad, t.numel);
    detail::check_buffer(fn, i, "exp_avg", t.exp_avg, t.numel);
    detail::check_buffer(fn, i, "exp_avg_sq", t.exp_avg_sq, t.numel);
    if (o.amsgrad) detail::check_buffer(fn, i, "max_exp_avg_sq", t.max_exp_avg_sq, t.numel);
    detail::check_step(fn, i, t.step);
  }
  const detail::KernelTable& kernels = detail::active_kernels();

  const bool decoupled = o.decoupled_weight_decay && o.weight_decay != 0.0;
  const detail::Lerp lerp = detail::lerp_coeff(1.0 - o.beta1);
  std::vector<detail::AdamCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    *tensors[i].step += 1.0f;
    const double step = *tensors[i].step;
    const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
    const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
    coeffs[i] = detail::AdamCoeffs{
        /*weight_decay=*/decoupled ? 0.0f : static_cast<float>(o.weight_decay),
        /*decay=*/decoupled ? static_cast<float>(1.0 - o.lr * o.weight_decay) : 1.0f,
        lerp.weight,
        lerp.from_end,
        static_cast<float>(o.beta2),
        static_cast<float>(1.0 - o.beta2),
        static_cast<float>(std::pow(bias_correction2, 0.5)),
        static_cast<float>(o.eps),
        static_cast<float>(-(o.lr / bias_correction1)),
        o.amsgrad,
        o.maximize,
    };
  }
  detail::for_each_chunk(
      count, [&](std::size_t i) { return tensors[i].numel; },
      [&](std::size_t i, std::size_t begin, std::size_t end) {
        const AdamTensor& t = tensors[i];
        kernels.adam(coeffs[i], {t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.max_exp_avg_sq},
                     begin, end);
      });
}

}  // namespace roundpipe
