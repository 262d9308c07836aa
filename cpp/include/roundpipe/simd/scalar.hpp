// One-lane vector type: the portable fallback ISA and the tail handler of every other ISA.
//
// Include only from a translation unit that defines ROUNDPIPE_ISA_NS (scalar, avx2, avx512,
// neon): everything here lands in namespace roundpipe::ROUNDPIPE_ISA_NS, so the copy compiled
// with one ISA's flags is a different symbol from the copy compiled with another's (the ODR trap
// of DESIGN.md §3). `fmadd` fuses exactly when the ISA has FMA, so an element gives the same bits
// whether it falls in a vector body or in the tail.
#pragma once
#ifndef ROUNDPIPE_ISA_NS
#error "define ROUNDPIPE_ISA_NS before including a roundpipe/simd header"
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

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
