// Runtime ISA detection and selection (roundpipe/isa.hpp).
#include <atomic>
#include <cstdlib>
#include <string>

#include "kernel_table.hpp"
#include "parallel.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/isa.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define ROUNDPIPE_X86 1
#endif

namespace roundpipe {
namespace detail {
const KernelTable& scalar_kernels();
#if defined(ROUNDPIPE_X86)
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();
#endif
#if defined(__aarch64__)
const KernelTable& neon_kernels();
#endif
}  // namespace detail

namespace {

#if defined(ROUNDPIPE_X86)
// XCR0: which register states the OS saves on a context switch.
unsigned long long read_xcr0() {
  unsigned int lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

bool cpu_has(Isa isa) {
  unsigned int a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!osxsave || !avx) return false;
  const unsigned long long xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;          // SSE + AVX state
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;     // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
  if (isa == Isa::avx2) return os_avx && avx2 && fma && f16c;
  if (isa == Isa::avx512) return os_avx && os_avx512 && avx2 && fma && f16c && avx512f;
  return false;
}
#endif

bool supported(Isa isa) {
  switch (isa) {
    case Isa::scalar:
      return true;
#if defined(ROUNDPIPE_X86)
    case Isa::avx2:
    case Isa::avx512:
      return cpu_has(isa);
#endif
#if defined(__aarch64__)
    case Isa::neon:
      return true;
#endif
    default:
      return false;
  }
}

const detail::KernelTable& table_of(Isa isa) {
  switch (isa) {
#if defined(ROUNDPIPE_X86)
    case Isa::avx2:
      return detail::avx2_kernels();
    case Isa::avx512:
      return detail::avx512_kernels();
#endif
#if defined(__aarch64__)
    case Isa::neon:
      return detail::neon_kernels();
#endif
    default:
      return detail::scalar_kernels();
  }
}

std::string supported_list() {
  std::string s;
  for (Isa isa : supported_isas()) s += (s.empty() ? "" : ", ") + std::string(isa_name(isa));
  return s;
}

void check_supported(Isa isa, const char* what) {
  if (!supported(isa))
    throw Error(std::string(what) + ": ISA '" + isa_name(isa) +
                "' is not supported by this CPU, OS or build; supported: " + supported_list());
}

// The active ISA, -1 until the first use chooses one. Lock-free, so that a fork() at any moment
// leaves the child a usable dispatcher, and the tables are compile-time constants (no lazy
// initialisation to interrupt).
std::atomic<int> g_isa{-1};

Isa choose() {
  if (const char* env = std::getenv("ROUNDPIPE_ISA"); env && *env) {
    Isa isa;
    try {
      isa = parse_isa(env);
    } catch (const Error& e) {
      throw Error(std::string("ROUNDPIPE_ISA: ") + e.what() + "; supported: " + supported_list());
    }
    check_supported(isa, "ROUNDPIPE_ISA");
    return isa;
  }
  return supported_isas().back();
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::neon: return "neon";
  }
  return "unknown";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon})
    if (name == isa_name(isa)) return isa;
  throw Error("isa: unknown ISA '" + name + "'; expected one of scalar, avx2, avx512, neon");
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon})
    if (supported(isa)) out.push_back(isa);
  return out;
}

Isa active_isa() {
  int isa = g_isa.load(std::memory_order_acquire);
  if (isa < 0) {
    int none = -1;  // keeps a set_isa() that ran meanwhile
    g_isa.compare_exchange_strong(none, static_cast<int>(choose()), std::memory_order_acq_rel);
    isa = g_isa.load(std::memory_order_acquire);
  }
  return static_cast<Isa>(isa);
}

void set_isa(Isa isa) {
  check_supported(isa, "set_isa");
  g_isa.store(static_cast<int>(isa), std::memory_order_release);
}

namespace detail {
const KernelTable& active_kernels() {
  check_tuning();  // a bad ROUNDPIPE_PREFETCH fails the step before it changes anything
  return table_of(active_isa());
}
}  // namespace detail

}  // namespace roundpipe
