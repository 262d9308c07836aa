// Instruction-set selection: which SIMD implementation of the optimizer kernels runs.
//
// The library carries one build of every kernel per ISA (scalar, AVX2+FMA, AVX-512F on x86-64;
// scalar and NEON on AArch64) and picks, on first use, the widest one that both the CPU (cpuid)
// and the OS (xgetbv: the OS saves the registers) support. The environment variable
// ROUNDPIPE_ISA=scalar|avx2|avx512|neon forces one; set_isa() does the same at run time.
#pragma once
#include <string>
#include <vector>

namespace roundpipe {

enum class Isa { scalar, avx2, avx512, neon };

/// "scalar", "avx2", "avx512" or "neon".
const char* isa_name(Isa isa);

/// Parses an ISA name as isa_name() spells it. Throws roundpipe::Error for an unknown name.
Isa parse_isa(const std::string& name);

/// The ISAs this build carries and this CPU + OS can run, narrowest first ("scalar" always).
std::vector<Isa> supported_isas();

/// The ISA the kernels use now. On the first call this reads ROUNDPIPE_ISA (if set) or picks the
/// widest supported ISA; throws roundpipe::Error if ROUNDPIPE_ISA names an unknown or unsupported
/// ISA (the message lists the supported ones), and tries again on the next call.
Isa active_isa();

/// Forces `isa` for all later kernel calls in the process. Throws roundpipe::Error (listing the
/// supported ISAs) if this CPU, OS or build cannot run it. Not to be called while a step runs.
void set_isa(Isa isa);

}  // namespace roundpipe
