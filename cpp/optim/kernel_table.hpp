// Internal: the table of kernel entry points one ISA translation unit provides, and the
// dispatcher's accessor for the active one.
#pragma once
#include <cstddef>

#include "roundpipe/kernels/adagrad.hpp"
#include "roundpipe/kernels/adam.hpp"
#include "roundpipe/kernels/rmsprop.hpp"
#include "roundpipe/kernels/sgd.hpp"

namespace roundpipe {
namespace detail {

struct KernelTable {
  void (*adam)(const AdamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*sgd)(const SGDCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adagrad)(const AdagradCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*rmsprop)(const RMSpropCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
};

// The table of the active ISA (roundpipe::active_isa()); throws roundpipe::Error as that does.
const KernelTable& active_kernels();

}  // namespace detail
}  // namespace roundpipe
