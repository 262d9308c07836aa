// stream_step (roundpipe/stream.hpp): the memory-traffic floor, on the same pool as the steps.
#include "roundpipe/stream.hpp"

#include <string>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {

void stream_step(const StreamOptions& o, const ParamBuffers* tensors, std::size_t count,
                 StepIO* io) {
  constexpr const char* fn = "stream_step";
  if (o.states < 0 || o.states > ParamBuffers::kMaxState)
    throw Error(std::string(fn) + ": states must be in [0, " +
                std::to_string(ParamBuffers::kMaxState) + "], got " + std::to_string(o.states));
  detail::check_buffers<StreamState>(fn, tensors, count, (1u << o.states) - 1u, 0u, io);
  const detail::KernelTable& kernels = detail::active_kernels();
  const std::vector<detail::StreamCoeffs> coeffs(count, detail::StreamCoeffs{o.states});
  detail::run_kernel<StreamState>(kernels.stream, coeffs.data(), tensors, count, io);
}

}  // namespace roundpipe
