// Compact storage (roundpipe/compact.hpp), written once over the SIMD vector types: a slice of a
// bfloat16 parameter or of bfloat16 / int8 state read into a float32 buffer, and written back
// (stochastic rounding; blockwise requantisation to the dynamic map).
//
// Quantising to the dynamic map: a table lookup and one comparison per value, in integers. The
// magnitude a = |y| (y = x / absmax) clamped to [2^-23, 1] is cut by the top 16 bits of its
// float32 pattern (exponent and 7 mantissa bits) into 2945 cells; no cell holds more than one of
// the map's midpoints (the narrowest bins, the top decade's, are 1.8 cells wide; checked when the
// table is built), so a cell's entry (QuantMap::cells) holds the code of its lowest value and the
// low 16 bits of the midpoint inside it, if any: the code is the entry's plus one where a's low
// bits pass the midpoint's. Exact for every float (float32 patterns of positive values order as
// integers; every value below 2^-23 is nearer to 0 than to the smallest map value); the
// exhaustive test in cpp_tests/test_compact.cpp checks every float32. It replaced a search by
// decade comparisons, a multiply and a floor with a midpoint fix-up: ~85 instructions per 16
// values (AVX-512) against ~20 and a gather.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "roundpipe/buffers.hpp"
#include "roundpipe/compact.hpp"

namespace roundpipe {
namespace detail {

// One dynamic map with what quantising to it needs; built at compile time (compact.cpp).
struct QuantMap {
  float value[256];    // ascending
  float bound[257];    // code k holds (bound[k], bound[k + 1]]; bound[0] = -inf, bound[256] = inf
  // Cell c holds the magnitudes whose float32 pattern u has u >> 16 == (kCellBase >> 16) + c:
  // (its lowest value's code (for the signed map: among codes 127 .. 255, the magnitudes) << 24)
  // | (the low 16 bits of the midpoint in the cell, or 0x10000 if none).
  static constexpr std::uint32_t kCellBase = 104u << 23;  // 2^-23
  static constexpr std::uint32_t kCellTop = 0x3f800000u;  // 1.0f
  static constexpr std::size_t kCells = ((kCellTop - kCellBase) >> 16) + 1;
  std::uint32_t cells[kCells];
  bool cells_ok;  // no cell holds more than one midpoint (asserted where the maps are built)
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

// One array of a slice of the staged pass (cpp/optim/parallel.hpp) as it is stored, for a kernel
// that converts a vector at a time inside its own loop (compact_slice below) instead of in
// separate passes before and after it. An array is absent when both pointers are null.
struct CompactArray {
  StateFormat format = StateFormat::float32;
  // float32: the array's elements, updated in place. bfloat16: null, or where the stored values
  // are kept as float32 (a parameter the model copy is written from). int8: a float32 buffer of
  // the slice's length that takes the new values before they are quantised.
  float* values = nullptr;
  void* packed = nullptr;         // bfloat16 / int8: the slice's stored elements
  float scale = 0.0f;             // int8: the block's scale before the step
  float* absmax = nullptr;        // int8: where the block's new scale goes
  const QuantMap* map = nullptr;  // int8
  std::uint32_t key = 0;          // bfloat16: stream_key of the array's rounding stream
};

// A slice of at most one int8 block (kQuantBlock elements, block-aligned) of one tensor.
struct CompactSlice {
  std::size_t n = 0;
  std::uint32_t first = 0;       // the low 32 bits of the slice's first element index
  const float* grad = nullptr;   // float32, n elements (staged or the tensor's own)
  CompactArray param;            // float32 or bfloat16
  CompactArray state[ParamBuffers::kMaxState];
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// The code of the map value nearest to y, as integer lanes (V::Bits), ties to the lower code:
// code k holds (bound[k], bound[k + 1]]. |y| > 1 counts as 1; the unsigned map takes a negative
// y as 0. NaN gives some valid code.
template <class V>
inline typename V::Bits quantize_code(const detail::QuantMap& q, V y) {
  using B = typename V::Bits;
  using Q = detail::QuantMap;
  B u = V::bits(y);  // the unsigned map: negative patterns are negative int32, clamped to 0 below
  B neg = V::bits_set1(0);
  if (q.is_signed) {
    neg = V::gt_i32(neg, u);  // all ones where y is negative (-0 too)
    u = V::bit_and(u, V::bits_set1(0x7fffffffu));
  }
  u = V::min_i32(V::max_i32(u, V::bits_set1(Q::kCellBase)), V::bits_set1(Q::kCellTop));
  const B cell = V::lookup_bits(q.cells, V::sub(V::srl(u, 16), V::bits_set1(Q::kCellBase >> 16)));
  // a negative value at a midpoint goes to the larger magnitude (the lower code): low + 1 there
  const B low = V::sub(V::bit_and(u, V::bits_set1(0xffffu)), neg);
  B code = V::sub(V::srl(cell, 24), V::gt_i32(low, V::bit_and(cell, V::bits_set1(0x1ffffu))));
  if (q.is_signed) {  // a negative value's code mirrors its magnitude's: 254 - code (no -1: 0)
    const B mirrored = V::max_i32(V::sub(V::bits_set1(254), code), V::bits_set1(0));
    code = V::bit_xor(code, V::bit_and(V::bit_xor(code, mirrored), neg));
  }
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
    const V v = V::load(x + i);
    // the stored bits directly (a rounded value is a bfloat16: no second rounding)
    v.store_bf16_stochastic(out + i, bits);
    if (kept) v.round_bf16_stochastic(bits, 0).store(kept + i);
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
      (V::lookup(q.value, V::load_u8_bits(codes + i)) * V::set1(scale)).store(out + i);
    });
  }
}

// The absolute maximum of x[begin, end), NaN if any element is (the NaN torch.maximum's order
// would give): the float32 patterns of |x| order as integers (a NaN's above inf's), so an
// integer maximum of them finds it; only a block holding a NaN is searched again in float.
inline float block_absmax(const float* x, std::size_t begin, std::size_t end) {
  Vec::Bits vmax = Vec::bits_set1(0);
  Scalar::Bits smax = 0;
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    const auto a = V::bit_and(V::bits(V::load(x + i)), V::bits_set1(0x7fffffffu));
    if constexpr (std::is_same_v<V, Vec>) vmax = Vec::max_i32(vmax, a);
    else smax = Scalar::max_i32(smax, a);
  });
  float lanes[Vec::width];
  Vec::from_bits(vmax).store(lanes);
  for (float l : lanes) smax = Scalar::max_i32(smax, Scalar::bits(Scalar{l}));
  if (smax <= 0x7f800000u) return bits_float(smax);
  Vec vnan = Vec::set1(0.0f);  // NaN: the float search, for the same NaN as before
  Scalar snan{0.0f};
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    V& acc = lane_acc<V>(vnan, snan);
    acc = maximum(abs(V::load(x + i)), acc);
  });
  vnan.store(lanes);
  float m = snan.v;
  for (std::size_t l = 0; l < Vec::width; ++l) m = maximum(Scalar{lanes[l]}, Scalar{m}).v;
  return m;
}

// codes[begin, end) of the block x[begin, end) whose absolute maximum (block_absmax) is m.
inline void quantize_block(const detail::QuantMap& q, const float* x, std::size_t begin,
                           std::size_t end, float m, std::uint8_t* codes) {
  if (!(m < std::numeric_limits<float>::infinity())) {  // inf or NaN: 0 * m reads back NaN
    std::memset(codes + begin, q.is_signed ? 127 : 0, end - begin);
    return;
  }
  // y = (x * pre) * inv, x / m up to rounding: pre = 2^100 keeps 1 / (m * pre) finite for a
  // tiny m (x * 1 is x: skipped); a block of zeros scales by 0.
  const float pre = m < 0x1p-100f ? 0x1p100f : 1.0f;
  const float inv = m > 0.0f ? 1.0f / (m * pre) : 0.0f;
  if (pre == 1.0f) {
    for_range(begin, end, [&](auto tag, std::size_t i) {
      using V = decltype(tag);
      V::store_u8_bits(codes + i, quantize_code(q, V::load(x + i) * V::set1(inv)));
    });
  } else {
    for_range(begin, end, [&](auto tag, std::size_t i) {
      using V = decltype(tag);
      V::store_u8_bits(codes + i,
                       quantize_code(q, V::load(x + i) * V::set1(pre) * V::set1(inv)));
    });
  }
}

// Codes and absmax of elements [0, n) of x, whole blocks from the first (the last may be
// partial): per block, its absolute maximum (NaN if any element is) and each element's code.
inline void quantize_blocks(const detail::QuantMap& q, const float* x, std::size_t n,
                            std::uint8_t* codes, float* absmax) {
  for (std::size_t b = 0; b < n; b += kQuantBlock) {
    const std::size_t end = b + kQuantBlock < n ? b + kQuantBlock : n;
    const float m = block_absmax(x, b, end);
    absmax[b / kQuantBlock] = m;
    quantize_block(q, x, b, end, m, codes);
  }
}

// Elements [i, i + V::width) of a slice's array (present) of format F (a.format), as float32.
template <class V, StateFormat F>
inline V load_compact(const detail::CompactArray& a, std::size_t i) {
  if constexpr (F == StateFormat::bfloat16) {
    return V::load_bf16(static_cast<const std::uint16_t*>(a.packed) + i);
  } else if constexpr (F == StateFormat::int8) {
    const auto codes = V::load_u8_bits(static_cast<const std::uint8_t*>(a.packed) + i);
    return V::lookup(a.map->value, codes) * V::set1(a.scale);
  } else {
    return V::load(a.values + i);
  }
}

// Stores x as elements [i, i + V::width) of a slice's array (present) of format F: float32 in
// place, bfloat16 rounded stochastically with the bits round_bf16 would use (and kept as float32
// where a.values asks: Kept), int8 into the float32 buffer with the integer maximum of |x|'s
// patterns taken into `amax` (block_absmax's).
template <class V, StateFormat F, bool Kept = false>
inline void store_compact(const detail::CompactArray& a, std::uint32_t first, std::size_t i, V x,
                          typename V::Bits& amax) {
  if constexpr (F == StateFormat::bfloat16) {
    const auto bits = V::random_bits(a.key, first + static_cast<std::uint32_t>(i));
    x.store_bf16_stochastic(static_cast<std::uint16_t*>(a.packed) + i, bits);
    if constexpr (Kept) x.round_bf16_stochastic(bits, 0).store(a.values + i);
  } else if constexpr (F == StateFormat::int8) {
    x.store(a.values + i);
    amax = V::max_i32(amax, V::bit_and(V::bits(x), V::bits_set1(0x7fffffffu)));
  } else {
    x.store(a.values + i);
  }
}

// A software prefetch of a slice's array (present) of format F, as prefetch_streams (for_range.hpp:
// the update's divisions would otherwise issue its loads late).
template <StateFormat F>
inline void prefetch_compact(const detail::CompactArray& a, std::size_t i) {
  if constexpr (F == StateFormat::bfloat16)
    prefetch_streams<Vec>(i, static_cast<const std::uint16_t*>(a.packed));
  else if constexpr (F == StateFormat::int8)
    prefetch_streams<Vec>(i, static_cast<const std::uint8_t*>(a.packed));
  else
    prefetch_streams<Vec>(i, a.values);
}

// compact_slice's loop with the parameter's format PF (and, for a bfloat16 one, whether its
// stored values are Kept as float32), the state's SF and the state arrays present (bit k:
// slot k; every one present has format SF). Branch-free per vector but for the body's own.
template <StateFormat PF, bool Kept, StateFormat SF, unsigned Present, class Body>
inline void compact_slice_with(const detail::CompactSlice& slice, Body body) {
  constexpr int K = ParamBuffers::kMaxState;
  // copies (of the slice and, by value, of the body and what it captures) that the loop's float
  // stores cannot alias: their fields stay in registers instead of being reloaded per vector
  const detail::CompactSlice s = slice;
  Vec::Bits vmax[K];
  Scalar::Bits smax[K];
  for (int k = 0; k < K; ++k) {
    vmax[k] = Vec::bits_set1(0);
    smax[k] = 0;
  }
  for_range(0, s.n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    if constexpr (std::is_same_v<V, Vec>) {
      prefetch_compact<PF>(s.param, i);
      prefetch_streams<Vec>(i, s.grad);
      for (int k = 0; k < K; ++k)
        if (Present >> k & 1u) prefetch_compact<SF>(s.state[k], i);
    }
    V p = load_compact<V, PF>(s.param, i);
    const V g = V::load(s.grad + i);
    V st[K];
    for (int k = 0; k < K; ++k)
      st[k] = Present >> k & 1u ? load_compact<V, SF>(s.state[k], i) : V::set1(0.0f);
    body(p, g, st);
    for (int k = 0; k < K; ++k) {
      if (!(Present >> k & 1u)) continue;
      if constexpr (std::is_same_v<V, Vec>) store_compact<V, SF>(s.state[k], s.first, i, st[k], vmax[k]);
      else store_compact<V, SF>(s.state[k], s.first, i, st[k], smax[k]);
    }
    typename V::Bits unused{};
    store_compact<V, PF, Kept>(s.param, s.first, i, p, unused);
  });
  if constexpr (SF == StateFormat::int8) {
    for (int k = 0; k < K; ++k) {
      if (!(Present >> k & 1u)) continue;
      const detail::CompactArray& a = s.state[k];
      float lanes[Vec::width];
      Vec::from_bits(vmax[k]).store(lanes);
      Scalar::Bits m = smax[k];
      for (float l : lanes) m = Scalar::max_i32(m, Scalar::bits(Scalar{l}));
      const float absmax = m <= 0x7f800000u ? bits_float(m) : block_absmax(a.values, 0, s.n);
      *a.absmax = absmax;
      quantize_block(*a.map, a.values, 0, s.n, absmax, static_cast<std::uint8_t*>(a.packed));
    }
  }
}

// Whether a slice's arrays are in one of the combinations compact_slice runs: a float32 or
// bfloat16 parameter, and the state arrays present in one format, as slots 0, 1 and optionally
// 2; and whether fusing measured faster than the separate passes with this ISA's vector width
// (AdamW, one thread, docs/benchmarks.md): with 16 lanes (AVX-512) always; with 8 (AVX2) for
// bfloat16 arrays only (with a bfloat16 parameter, int8 state took 2.39 -> 2.54 ns per element
// fused, 32M elements); with fewer (NEON, scalar) never (scalar bfloat16 state 4.37 -> 5.41).
inline bool compact_slice_runs(const detail::CompactSlice& s, StateFormat& state_format,
                               unsigned& present) {
  if constexpr (Vec::width < 8) return false;
  present = 0;
  for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
    const detail::CompactArray& a = s.state[k];
    if (!a.values && !a.packed) continue;
    if (present && a.format != state_format) return false;
    state_format = a.format;
    present |= 1u << k;
  }
  if (present != 0b011u && present != 0b111u) return false;
  if (state_format == StateFormat::int8 && Vec::width < 16) return false;

  return s.param.format != StateFormat::int8;
}

// Runs an element-wise update over a slice with every array converted inside the loop, a vector
// at a time: body(p, g, s) gets the parameter, the float32 gradient and the kMaxState state
// values (V, read as load_compact says; an absent slot 2 reads zeros and is not stored) and
// updates p and s in place; they are stored as store_compact says. Then each int8 array's block
// is quantised (quantize_block) with the absolute maximum taken while storing (a NaN block
// searched again by block_absmax, for the same NaN). Every result bit is that of the separate
// passes (widen_bf16 / dequantize_blocks, the kernel, round_bf16 / quantize_blocks) on the same
// slice. Returns false, having done nothing, for a combination it does not run
// (compact_slice_runs): the caller takes the separate passes.
template <class Body>
inline bool compact_slice(const detail::CompactSlice& s, Body&& body) {
  StateFormat sf = StateFormat::float32;
  unsigned present = 0;
  if (!compact_slice_runs(s, sf, present)) return false;
  auto run = [&](auto pf, auto kept) {
    constexpr StateFormat PF = decltype(pf)::value;
    constexpr bool Kept = decltype(kept)::value;
    auto with = [&](auto state) {
      constexpr StateFormat SF = decltype(state)::value;
      if (present == 0b111u) compact_slice_with<PF, Kept, SF, 0b111u>(s, body);
      else compact_slice_with<PF, Kept, SF, 0b011u>(s, body);
    };
    switch (sf) {
      case StateFormat::bfloat16: with(std::integral_constant<StateFormat, StateFormat::bfloat16>{}); break;
      case StateFormat::int8: with(std::integral_constant<StateFormat, StateFormat::int8>{}); break;
      default: with(std::integral_constant<StateFormat, StateFormat::float32>{});
    }
  };
  using Bf16 = std::integral_constant<StateFormat, StateFormat::bfloat16>;
  using F32 = std::integral_constant<StateFormat, StateFormat::float32>;
  if (s.param.format != StateFormat::bfloat16) run(F32{}, std::false_type{});
  else if (s.param.values) run(Bf16{}, std::true_type{});
  else run(Bf16{}, std::false_type{});
  return true;
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
