// AVX-512F kernels: the only translation unit compiled with -mavx512f.
#define ROUNDPIPE_ISA_NS avx512
#include "simd/avx512.hpp"
#include "isa_table.inc"
