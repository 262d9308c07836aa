// NEON kernels for AArch64 (Advanced SIMD is part of the AArch64 baseline).
#define ROUNDPIPE_ISA_NS neon
#include "simd/neon.hpp"
#include "isa_table.inc"
