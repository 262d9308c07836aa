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
  void stream(float* p) const { *p = v; }
  static constexpr std::size_t stream_f32_align = 1;
  static constexpr std::size_t stream_align = 1;
  static Scalar set1(float x) { return {x}; }

  // Compact storage (kernels/compact.hpp): 32 random bits per lane, stochastic rounding to
  // bfloat16, 8-bit codes, table lookups.
  using Bits = std::uint32_t;
  // hash32((first + lane) ^ key): lane i's bits for element `first + i` of a stream `key`.
  static Bits random_bits(std::uint32_t key, std::uint32_t first);
  // The value rounded to a bfloat16 stochastically (returned as the float it equals): the 16
  // bits (r >> shift) & 0xffff are added to the float's bit pattern, which is then cut to its
  // top 16 bits, so it rounds away from zero with probability (dropped bits) / 2^16 and the
  // expected result is the value itself. inf stays inf; NaN stays NaN; a value that rounds up
  // past the largest bfloat16 becomes inf.
  Scalar round_bf16_stochastic(Bits r, int shift) const;
  // round_bf16_stochastic(r, 0) stored as bfloat16: the bits directly.
  void store_bf16_stochastic(std::uint16_t* p, Bits r) const;
  // One byte <-> a float holding its value (0 .. 255; stored values must be such integers).
  static Scalar load_u8(const std::uint8_t* p) { return {static_cast<float>(*p)}; }
  void store_u8(std::uint8_t* p) const { *p = static_cast<std::uint8_t>(v); }
  // table[index] per lane; index holds exact non-negative integers.
  static Scalar lookup(const float* table, Scalar index) {
    return {table[static_cast<std::uint32_t>(index.v)]};
  }
  // table[index] for an 8-entry table (a register permute on the vector ISAs).
  static Scalar lookup8(const float* table, Scalar index) { return lookup(table, index); }
  // Whether any lane of a mask is set.
  static bool any(Mask m) { return m; }

  // Integer lanes, for the int8 blocks (kernels/compact.hpp): the float's bit pattern and
  // back, a byte widened, lane-wise integer arithmetic (wrapping; shifts logical), signed
  // 32-bit max / min / greater (all ones where a > b, else 0), table[index] of a 32-bit or a
  // float table, and the low byte of each lane stored.
  static Bits bits(Scalar x);
  static Scalar from_bits(Bits b);
  static Bits load_u8_bits(const std::uint8_t* p) { return *p; }
  static Scalar lookup(const float* table, Bits index) { return {table[index]}; }
  static Bits bits_set1(std::uint32_t x) { return x; }
  static Bits add(Bits a, Bits b) { return a + b; }
  static Bits sub(Bits a, Bits b) { return a - b; }
  static Bits bit_and(Bits a, Bits b) { return a & b; }
  static Bits bit_xor(Bits a, Bits b) { return a ^ b; }
  static Bits srl(Bits a, int n) { return a >> n; }
  static Bits max_i32(Bits a, Bits b) { return gt_i32(a, b) ? a : b; }
  static Bits min_i32(Bits a, Bits b) { return gt_i32(a, b) ? b : a; }
  static Bits gt_i32(Bits a, Bits b) {
    return static_cast<std::int32_t>(a) > static_cast<std::int32_t>(b) ? ~0u : 0u;
  }
  static Bits lookup_bits(const std::uint32_t* table, Bits index) { return table[index]; }
  static void store_u8_bits(std::uint8_t* p, Bits b) { *p = static_cast<std::uint8_t>(b); }

  friend Scalar operator+(Scalar a, Scalar b) { return {a.v + b.v}; }
  friend Scalar operator-(Scalar a, Scalar b) { return {a.v - b.v}; }
  friend Scalar operator*(Scalar a, Scalar b) { return {a.v * b.v}; }
  friend Scalar operator/(Scalar a, Scalar b) { return {a.v / b.v}; }
  friend Scalar operator-(Scalar a) { return {-a.v}; }

  friend Mask operator<(Scalar a, Scalar b) { return a.v < b.v; }
  friend Mask operator>(Scalar a, Scalar b) { return a.v > b.v; }
  friend Mask operator>=(Scalar a, Scalar b) { return a.v >= b.v; }
  friend Mask operator<=(Scalar a, Scalar b) { return a.v <= b.v; }
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
// minimum(a, bound) for a bound that is never NaN and never a zero of the other sign than a's
// (the vector ISAs' one-instruction form; the same bits as minimum's).
inline Scalar minimum_bound(Scalar a, Scalar bound) { return {bound.v < a.v ? bound.v : a.v}; }
inline Scalar select(bool m, Scalar a, Scalar b) { return m ? a : b; }
inline Scalar floor(Scalar a) { return {__builtin_floorf(a.v)}; }

// A 32-bit integer hash with good avalanche ("lowbias32", from Chris Wellons' hash prospector):
// the stochastic-rounding bits of every ISA, lane for lane the same.
inline std::uint32_t hash32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

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

inline Scalar::Bits Scalar::bits(Scalar x) { return float_bits(x.v); }
inline Scalar Scalar::from_bits(Bits b) { return {bits_float(b)}; }
inline Scalar::Bits Scalar::random_bits(std::uint32_t key, std::uint32_t first) {
  return hash32(first ^ key);
}
inline void Scalar::store_bf16_stochastic(std::uint16_t* p, Bits r) const {
  *p = v != v ? static_cast<std::uint16_t>(0x7fc0u)
              : static_cast<std::uint16_t>((float_bits(v) + (r & 0xffffu)) >> 16);
}
inline Scalar Scalar::round_bf16_stochastic(Bits r, int shift) const {
  if (v != v) return *this;
  return {bits_float((float_bits(v) + ((r >> shift) & 0xffffu)) & 0xffff0000u)};
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
