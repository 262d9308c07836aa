// AVX2 + FMA kernels: the only translation unit compiled with -mavx2 -mfma.
#define ROUNDPIPE_ISA_NS avx2
#include "simd/avx2.hpp"
#include "isa_table.inc"
