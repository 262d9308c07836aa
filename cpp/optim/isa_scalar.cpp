// Scalar kernels: the portable fallback, compiled with the baseline flags only.
#define ROUNDPIPE_ISA_NS scalar
#include "simd/scalar.hpp"
namespace roundpipe {
namespace scalar {
using Vec = Scalar;
}  // namespace scalar
}  // namespace roundpipe
#include "isa_table.inc"
