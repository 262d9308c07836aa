// Internal: the table of kernel entry points one ISA translation unit provides, and the
// dispatcher's accessor for the active one.
#pragma once
#include <cstddef>

#include "roundpipe/kernels/adadelta.hpp"
#include "roundpipe/kernels/adagrad.hpp"
#include "roundpipe/kernels/adam.hpp"
#include "roundpipe/kernels/adamax.hpp"
#include "roundpipe/kernels/asgd.hpp"
#include "roundpipe/kernels/mixed.hpp"
#include "roundpipe/kernels/nadam.hpp"
#include "roundpipe/kernels/radam.hpp"
#include "roundpipe/kernels/rmsprop.hpp"
#include "roundpipe/kernels/rprop.hpp"
#include "roundpipe/kernels/sgd.hpp"
#include "roundpipe/kernels/stream.hpp"

namespace roundpipe {
namespace detail {

struct KernelTable {
  void (*adam)(const AdamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adadelta)(const AdadeltaCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adamax)(const AdamaxCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*asgd)(const AsgdCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*nadam)(const NAdamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*radam)(const RAdamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*rprop)(const RpropCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*sgd)(const SGDCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*stream)(const StreamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adagrad)(const AdagradCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*rmsprop)(const RMSpropCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  // the mixed-precision pass (kernels/mixed.hpp)
  void (*stage_grad)(const ParamBuffers&, std::size_t begin, std::size_t n, float inv_scale,
                     bool norm, float* out, GradStats& stats);
  void (*store_model_copy)(const ParamBuffers&, std::size_t begin, std::size_t n);
};

// The table of the active ISA (roundpipe::active_isa()); throws roundpipe::Error as that does.
const KernelTable& active_kernels();

}  // namespace detail
}  // namespace roundpipe
