// Internal: the table of kernel entry points one ISA translation unit provides, and the
// dispatcher's accessor for the active one.
#pragma once
#include <cstddef>

#include "roundpipe/kernels/adadelta.hpp"
#include "roundpipe/kernels/adam.hpp"
#include "roundpipe/kernels/adamax.hpp"
#include "roundpipe/kernels/asgd.hpp"

namespace roundpipe {
namespace detail {

struct KernelTable {
  void (*adam)(const AdamCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adadelta)(const AdadeltaCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*adamax)(const AdamaxCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
  void (*asgd)(const AsgdCoeffs&, const ParamBuffers&, std::size_t begin, std::size_t end);
};

// The table of the active ISA (roundpipe::active_isa()); throws roundpipe::Error as that does.
const KernelTable& active_kernels();

}  // namespace detail
}  // namespace roundpipe
