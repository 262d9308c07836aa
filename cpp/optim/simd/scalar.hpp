// One-lane vector type: the portable fallback ISA and the tail handler of every other ISA.
//
// Include only from a translation unit that defines ROUNDPIPE_ISA_NS (scalar, avx2, avx512,
// neon): everything here lands in namespace roundpipe::ROUNDPIPE_ISA_NS, so the copy compiled
// with one ISA's flags is a different symbol from the copy compiled with another's (the ODR trap
// of docs/design.md §3). `fmadd` fuses exactly when the ISA has FMA, so an element gives the same bits
// whether it falls in a vector body or in the tail.
#pragma once
#ifndef ROUNDPIPE_ISA_NS
#error "define ROUNDPIPE_ISA_NS before including a simd/ header"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

struct Scalar {
  using Mask = bool;
  static constexpr std::size_t width = 1;
  float v;

  static Scalar load(const float* p) { return {*p}; }
  void store(float* p) const { *p = v; }
  // 16-bit formats (bfloat16, IEEE half), as their bit patterns; conversions below.
  static Scalar load_bf16(const std::uint16_t* p);
  static Scalar load_f16(const std::uint16_t* p);
  void store_bf16(std::uint16_t* p) const;
  void store_f16(std::uint16_t* p) const;
  // One element: no non-temporal store, the plain one.
  void stream_bf16(std::uint16_t* p) const { store_bf16(p); }
  void stream_f16(std::uint16_t* p) const { store_f16(p); }
  static void stream_fence() {}
  static constexpr std::size_t stream_align = 1;
  static Scalar set1(float x) { return {x}; }

  friend Scalar operator+(Scalar a, Scalar b) { return {a.v + b.v}; }
  friend Scalar operator-(Scalar a, Scalar b) { return {a.v - b.v}; }
  friend Scalar operator*(Scalar a, Scalar b) { return {a.v * b.v}; }
  friend Scalar operator/(Scalar a, Scalar b) { return {a.v / b.v}; }
  friend Scalar operator-(Scalar a) { return {-a.v}; }

  friend Mask operator<(Scalar a, Scalar b) { return a.v < b.v; }
  friend Mask operator>(Scalar a, Scalar b) { return a.v > b.v; }
  friend Mask operator==(Scalar a, Scalar b) { return a.v == b.v; }
  friend Mask operator!=(Scalar a, Scalar b) { return a.v != b.v; }
};

// a * b + c, rounded once where the ISA has FMA and twice where it does not.
inline Scalar fmadd(Scalar a, Scalar b, Scalar c) {
#if defined(__FMA__) || defined(__aarch64__)
  return {__builtin_fmaf(a.v, b.v, c.v)};
#else
  return {a.v * b.v + c.v};
#endif
}
inline Scalar sqrt(Scalar a) { return {__builtin_sqrtf(a.v)}; }
inline Scalar abs(Scalar a) { return {__builtin_fabsf(a.v)}; }
// NaN-propagating, as torch.maximum / torch.minimum.
inline Scalar maximum(Scalar a, Scalar b) {
  return {(a.v != a.v || a.v > b.v) ? a.v : b.v};
}
inline Scalar minimum(Scalar a, Scalar b) {
  return {(a.v != a.v || a.v < b.v) ? a.v : b.v};
}
inline Scalar select(bool m, Scalar a, Scalar b) { return m ? a : b; }

// Float <-> 16-bit conversions, exact (widening) or rounded to nearest even (narrowing), as
// torch's .to(torch.bfloat16) / .to(torch.float16): a NaN becomes the quiet NaN 0x7fc0 (bf16, as
// c10::BFloat16) or 0x7e00 with its sign (fp16); fp16 overflows to inf, underflows through the subnormals to 0.
inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline Scalar Scalar::load_bf16(const std::uint16_t* p) {
  return {bits_float(static_cast<std::uint32_t>(*p) << 16)};
}
inline void Scalar::store_bf16(std::uint16_t* p) const {
  const std::uint32_t u = float_bits(v);
  *p = v != v ? static_cast<std::uint16_t>(0x7fc0u)
              : static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline Scalar Scalar::load_f16(const std::uint16_t* p) {
  const std::uint32_t h = *p, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                      man = h & 0x3ffu;
  if (exp == 0x1f) return {bits_float(sign | 0x7f800000u | (man << 13))};  // inf, NaN
  if (exp != 0) return {bits_float(sign | ((exp + 112u) << 23) | (man << 13))};
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
  return {sign ? -mag : mag};
}
inline void Scalar::store_f16(std::uint16_t* p) const {
  const std::uint32_t u = float_bits(v), sign = (u >> 16) & 0x8000u, abs = u & 0x7fffffffu;
  std::uint32_t h;
  if (abs > 0x7f800000u) {
    h = 0x7e00u;                                   // NaN
  } else if (abs >= 0x477ff000u) {
    h = 0x7c00u;                                   // rounds to >= 65536: inf
  } else if (abs >= 0x38800000u) {                 // normal half (>= 2^-14)
    const std::uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u) - (112u << 23);
    h = r >> 13;
  } else if (abs >= 0x33000000u) {                 // subnormal half or rounds to 2^-24
    const std::uint32_t e = abs >> 23, m = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - e;          // 14..24 bits dropped below the half's lsb
    const std::uint32_t half_bit = 1u << (shift - 1), rest = m & ((half_bit << 1) - 1u);
    h = m >> shift;
    if (rest > half_bit || (rest == half_bit && (h & 1u))) ++h;
  } else {
    h = 0;                                         // below half of 2^-24: zero
  }
  *p = static_cast<std::uint16_t>(sign | h);
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
