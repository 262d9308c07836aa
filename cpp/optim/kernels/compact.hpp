// Compact storage (roundpipe/compact.hpp), written once over the SIMD vector types: a slice of a
// bfloat16 parameter or of bfloat16 / int8 state read into a float32 buffer, and written back
// (stochastic rounding; blockwise requantisation to the dynamic map).
//
// Quantising to the dynamic map: the decade of |y| (y = x / absmax) comes from six comparisons
// (its constants from an 8-entry table, a register permute), the bin inside it from one
// multiply and a floor (within a decade the map's values are the centres of equal bins, so the
// bin holding |y| holds the nearest value), which gives the code up to one place: a value near a
// decade's edge may be nearest to the neighbouring decade's extreme value, and the float
// arithmetic may put |y| one bin off near a bin's edge. Vectors with a lane in such a place are
// compared with the code's two float32 midpoints (`bound`, two table gathers), which moves it to
// the nearest code; the others (most) skip the gathers. The exhaustive test in
// cpp_tests/test_compact.cpp checks every float32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "roundpipe/buffers.hpp"
#include "roundpipe/compact.hpp"

namespace roundpipe {
namespace detail {

// One dynamic map with what quantising to it needs; built at compile time (compact.cpp).
struct QuantMap {
  float value[256];    // ascending
  float bound[257];    // code k holds (bound[k], bound[k + 1]]; bound[0] = -inf, bound[256] = inf
  // per decade i = 0..6 (8-entry tables for register permutes): its lower edge 10^(i-7), bins
  // per unit 1 / width, the code of its first value (among the positive values), its number of
  // bins minus one
  float decade_low[8];
  float bins_per_unit[8];
  float first_code[8];
  float last_bin[8];
  bool is_signed;
};

const QuantMap& quant_map(bool is_signed);

// The 32-bit key of one consumer of a tensor's rounding stream (0: the parameter, 1 + k: state
// slot k) for the elements whose index has the high word `index_high`.
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline std::uint32_t stream_key(std::uint64_t seed, unsigned consumer, std::uint64_t index_high) {
  return static_cast<std::uint32_t>(
      splitmix64(seed ^ splitmix64((static_cast<std::uint64_t>(consumer) << 48) ^ index_high)));
}

// The seed a step uses for a tensor: its rounding_seed with its step count mixed in.
inline std::uint64_t step_seed(std::uint64_t seed, double step) {
  return splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(step)));
}

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// The code of the map value nearest to y (|y| <= 1 up to rounding; the unsigned map takes a
// negative y as 0), as a float 0 .. 255. NaN gives some valid code.
template <class V>
inline V quantize_code(const detail::QuantMap& q, V y) {
  const V zero = V::set1(0.0f), one = V::set1(1.0f);
  V a = q.is_signed ? abs(y) : select(y > zero, y, zero);
  a = select(a < one, a, one);
  V decade = zero;  // how many decade edges lie at or below a
  for (int k = 1; k < 7; ++k) decade = decade + select(a >= V::set1(q.decade_low[k]), one, zero);
  const V last = V::lookup8(q.last_bin, decade);
  const V raw = (a - V::lookup8(q.decade_low, decade)) * V::lookup8(q.bins_per_unit, decade);
  V bin = floor(raw);
  const V frac = raw - bin;
  bin = select(bin > zero, bin, zero);  // also NaN -> 0
  bin = select(bin < last, bin, last);
  const V first = V::lookup8(q.first_code, decade);
  V code;
  if (q.is_signed)
    code = select(y < zero, V::set1(126.0f) - first - bin, V::set1(128.0f) + first + bin);
  else
    code = one + first + bin;
  // Inside a bin, away from its edges, the bin's value is the nearest. Lanes elsewhere are
  // checked against the code's two float32 midpoints, which moves them by at most one place:
  // near a bin edge (float rounding); in a decade's first bin below 0.2 of it, where the midpoint
  // with the decade below lies (decade widths grow 5-fold per bin: (low - 0.1 w + low + 0.5 w) /
  // 2), which also covers the region below the lowest decade and the midpoint with 0; in a
  // decade's last bin above 0.75 of it, where the top decade meets 1 (the last value is
  // 1 - 0.5 w), or past its end (|y| at the next decade's edge, rounded into this one).
  constexpr float kEdge = 1.0f / 1024;
  const V inner = minimum(raw - V::set1(0.2f), last + V::set1(0.75f) - raw);
  const V centre = abs(frac - V::set1(0.5f));
  if (!V::any(inner < V::set1(kEdge)) && !V::any(centre > V::set1(0.5f - kEdge))) return code;
  code = select(V::lookup(q.bound + 1, code) < y, code + one, code);
  code = select(y <= V::lookup(q.bound, code), code - one, code);
  return code;
}

// out[0, n) = x[0, n) widened from bfloat16.
inline void widen_bf16(const std::uint16_t* x, std::size_t n, float* out) {
  for_range(0, n, [&](auto tag, std::size_t i) { decltype(tag)::load_bf16(x + i).store(out + i); });
}

// out[0, n) = x[0, n) rounded to bfloat16 stochastically, with the bits of stream `key` for the
// elements numbered first, first + 1, ...; `kept` (if not null; it may be x) takes the values
// stored, as floats.
inline void round_bf16(const float* x, std::size_t n, std::uint32_t key, std::uint32_t first,
                       std::uint16_t* out, float* kept) {
  for_range(0, n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    const auto bits = V::random_bits(key, first + static_cast<std::uint32_t>(i));
    if (!kept) {
      V::load(x + i).store_bf16_stochastic(out + i, bits);
      return;
    }
    const V r = V::load(x + i).round_bf16_stochastic(bits, 0);
    r.store(kept + i);
    r.store_bf16(out + i);
  });
}

// out[0, n) = map[codes[i]] * absmax[i / kQuantBlock]: the elements of whole blocks from the
// first (the last block may be partial).
inline void dequantize_blocks(const detail::QuantMap& q, const std::uint8_t* codes,
                              const float* absmax, std::size_t n, float* out) {
  for (std::size_t b = 0; b < n; b += kQuantBlock) {
    const std::size_t end = b + kQuantBlock < n ? b + kQuantBlock : n;
    const float scale = absmax[b / kQuantBlock];
    for_range(b, end, [&](auto tag, std::size_t i) {
      using V = decltype(tag);
      (V::lookup(q.value, V::load_u8(codes + i)) * V::set1(scale)).store(out + i);
    });
  }
}

// Codes and absmax of elements [0, n) of x, whole blocks from the first (the last may be
// partial): per block, its absolute maximum (NaN if any element is) and each element's code.
inline void quantize_blocks(const detail::QuantMap& q, const float* x, std::size_t n,
                            std::uint8_t* codes, float* absmax) {
  for (std::size_t b = 0; b < n; b += kQuantBlock) {
    const std::size_t end = b + kQuantBlock < n ? b + kQuantBlock : n;
    Vec vmax = Vec::set1(0.0f);
    Scalar smax{0.0f};
    for_range(b, end, [&](auto tag, std::size_t i) {
      using V = decltype(tag);
      V& acc = lane_acc<V>(vmax, smax);
      acc = maximum(abs(V::load(x + i)), acc);
    });
    float lanes[Vec::width];
    vmax.store(lanes);
    float m = smax.v;
    for (std::size_t l = 0; l < Vec::width; ++l) m = maximum(Scalar{lanes[l]}, Scalar{m}).v;
    absmax[b / kQuantBlock] = m;
    if (!(m < std::numeric_limits<float>::infinity())) {  // inf or NaN: 0 * m reads back NaN
      std::memset(codes + b, q.is_signed ? 127 : 0, end - b);
      continue;
    }
    // y = (x * pre) * inv, x / m up to rounding: pre = 2^100 keeps 1 / (m * pre) finite for a
    // tiny m; a block of zeros scales by 0.
    const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
    const float inv = m > 0.0f ? 1.0f / (m * pre) : 0.0f;
    for_range(b, end, [&](auto tag, std::size_t i) {
      using V = decltype(tag);
      quantize_code(q, V::load(x + i) * V::set1(pre) * V::set1(inv)).store_u8(codes + i);
    });
  }
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
