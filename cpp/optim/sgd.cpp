// sgd_step (roundpipe/sgd.hpp): checks, per-tensor float32 coefficients as torch.optim.SGD
// passes them to its tensor ops, the momentum-buffer flags, then the active ISA's kernel over
// all tensors on the worker pool.
#include "roundpipe/sgd.hpp"

#include <string>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void sgd_step(const SGDOptions& o, const ParamBuffers* tensors, std::size_t count,
              StepIO* io) {
  constexpr const char* fn = "sgd_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "momentum", o.momentum, 0.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  if (o.nesterov && !(o.momentum > 0.0 && o.dampening == 0.0))
    throw Error(std::string(fn) + ": nesterov requires momentum > 0 and dampening == 0, got " +
                "momentum " + detail::fmt(o.momentum) + ", dampening " +
                detail::fmt(o.dampening));
  const bool use_momentum = o.momentum != 0.0;
  detail::check_buffers<SGDState>(fn, tensors, count, use_momentum ? 0b1u : 0u,
                                  use_momentum ? 0b1u : 0u, io);
  const detail::KernelTable& kernels = detail::active_kernels();

  const detail::GradCoeffs grad = detail::grad_coeffs(o.weight_decay, o.maximize);
  std::vector<detail::SGDCoeffs> coeffs(count);
  for (std::size_t i = 0; i < count; ++i) {
    float* const ready = tensors[i].scalar[SGDState::momentum_buffer_ready];
    const bool fresh = use_momentum && *ready == 0.0f;
    coeffs[i] = detail::SGDCoeffs{
        grad,
        static_cast<float>(o.momentum),
        static_cast<float>(1.0 - o.dampening),
        static_cast<float>(-o.lr),
        use_momentum,
        fresh,
        o.nesterov,
    };
    // Written only on the change, so a caller may pass one shared flag for ready buffers.
    if (fresh) *ready = 1.0f;
  }
  detail::run_kernel<SGDState>(kernels.sgd, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
