// Dequantization of NF4 / int8 weight blocks (roundpipe/dequant.hpp), written once over the SIMD
// vector types: per block, full vectors of Vec::lookup_nf4 / Vec::load_i8 times the block's scale,
// stored in the output dtype; the last partial block, and the whole of the scalar ISA, one value
// at a time (the same product and rounding, so the same bits).
#pragma once
#include <cstddef>
#include <cstdint>

#include "roundpipe/buffers.hpp"
#include "roundpipe/dequant.hpp"

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {
namespace dequant_detail {

// Stores v (any lane type) at element i of `out`, in dtype D.
template <Dtype D, class V>
inline void store_as(V v, void* out, std::size_t i) {
  if constexpr (D == Dtype::float32) v.store(static_cast<float*>(out) + i);
  else if constexpr (D == Dtype::bfloat16) v.store_bf16(static_cast<std::uint16_t*>(out) + i);
  else v.store_f16(static_cast<std::uint16_t*>(out) + i);
}

// Index of value i in packed NF4 codes (high nibble first).
inline unsigned nf4_index(const std::uint8_t* codes, std::size_t i) {
  return i & 1 ? codes[i / 2] & 15u : codes[i / 2] >> 4;
}

// The two code formats, read as float: a vector of V::width codes from element i, or one.
struct Nf4Codes {
  const std::uint8_t* codes;
  template <class V>
  V vector(std::size_t i) const { return V::lookup_nf4(kNf4Code, codes + i / 2); }
  float one(std::size_t i) const { return kNf4Code[nf4_index(codes, i)]; }
};
struct Int8Codes {
  const std::int8_t* codes;
  template <class V>
  V vector(std::size_t i) const { return V::load_i8(codes + i); }
  float one(std::size_t i) const { return static_cast<float>(codes[i]); }
};

// Values [0, n) from the start of a block run: each code's value times its block's scale,
// stored in dtype D. V is the vector type (Scalar: one at a time).
template <Dtype D, class V, class Codes>
inline void blocks_run(Codes codes, const float* scale, std::size_t n, void* out) {
  for (std::size_t b = 0; b < n; b += kWeightBlock) {
    const std::size_t end = b + kWeightBlock < n ? b + kWeightBlock : n;
    const Scalar s{scale[b / kWeightBlock]};
    std::size_t i = b;
    if constexpr (V::width > 1) {
      const V vs = V::set1(s.v);
      for (; i + V::width <= end; i += V::width)
        store_as<D>(codes.template vector<V>(i) * vs, out, i);
    }
    for (; i < end; ++i) store_as<D>(Scalar{codes.one(i)} * s, out, i);
  }
}

template <class Codes>
inline void blocks(Codes codes, const float* scale, std::size_t n, Dtype dtype, void* out) {
  switch (dtype) {
    case Dtype::float32: return blocks_run<Dtype::float32, Vec>(codes, scale, n, out);
    case Dtype::bfloat16: return blocks_run<Dtype::bfloat16, Vec>(codes, scale, n, out);
    case Dtype::float16: return blocks_run<Dtype::float16, Vec>(codes, scale, n, out);
  }
}

}  // namespace dequant_detail

// out[0, n) from the packed codes and absmax of the blocks starting at `codes` / `absmax`.
inline void dequantize_nf4_blocks(const std::uint8_t* codes, const float* absmax, std::size_t n,
                                  Dtype dtype, void* out) {
  dequant_detail::blocks(dequant_detail::Nf4Codes{codes}, absmax, n, dtype, out);
}

// out[0, n) from the int8 codes and scales (absmax / 127) of the blocks starting at `codes`.
inline void dequantize_int8_blocks(const std::int8_t* codes, const float* scale, std::size_t n,
                                   Dtype dtype, void* out) {
  dequant_detail::blocks(dequant_detail::Int8Codes{codes}, scale, n, dtype, out);
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
