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

// Values [0, n) from the start of a block run; V is the vector type (Scalar: one at a time).
template <Dtype D, class V>
inline void nf4_run(const std::uint8_t* codes, const float* absmax, std::size_t n, void* out) {
  for (std::size_t b = 0; b < n; b += kWeightBlock) {
    const std::size_t end = b + kWeightBlock < n ? b + kWeightBlock : n;
    const Scalar scale{absmax[b / kWeightBlock]};
    std::size_t i = b;
    if constexpr (V::width > 1) {
      const V vscale = V::set1(scale.v);
      for (; i + V::width <= end; i += V::width)
        store_as<D>(V::lookup_nf4(kNf4Code, codes + i / 2) * vscale, out, i);
    }
    for (; i < end; ++i) store_as<D>(Scalar{kNf4Code[nf4_index(codes, i)]} * scale, out, i);
  }
}

template <Dtype D, class V>
inline void int8_run(const std::int8_t* codes, const float* scale, std::size_t n, void* out) {
  for (std::size_t b = 0; b < n; b += kWeightBlock) {
    const std::size_t end = b + kWeightBlock < n ? b + kWeightBlock : n;
    const Scalar s{scale[b / kWeightBlock]};
    std::size_t i = b;
    if constexpr (V::width > 1) {
      const V vs = V::set1(s.v);
      for (; i + V::width <= end; i += V::width) store_as<D>(V::load_i8(codes + i) * vs, out, i);
    }
    for (; i < end; ++i) store_as<D>(Scalar{static_cast<float>(codes[i])} * s, out, i);
  }
}

}  // namespace dequant_detail

// out[0, n) from the packed codes and absmax of the blocks starting at `codes` / `absmax`.
inline void dequantize_nf4_blocks(const std::uint8_t* codes, const float* absmax, std::size_t n,
                           Dtype dtype, void* out) {
  using namespace dequant_detail;
  switch (dtype) {
    case Dtype::float32: return nf4_run<Dtype::float32, Vec>(codes, absmax, n, out);
    case Dtype::bfloat16: return nf4_run<Dtype::bfloat16, Vec>(codes, absmax, n, out);
    case Dtype::float16: return nf4_run<Dtype::float16, Vec>(codes, absmax, n, out);
  }
}

inline void dequantize_int8_blocks(const std::int8_t* codes, const float* scale, std::size_t n,
                            Dtype dtype, void* out) {
  using namespace dequant_detail;
  switch (dtype) {
    case Dtype::float32: return int8_run<Dtype::float32, Vec>(codes, scale, n, out);
    case Dtype::bfloat16: return int8_run<Dtype::bfloat16, Vec>(codes, scale, n, out);
    case Dtype::float16: return int8_run<Dtype::float16, Vec>(codes, scale, n, out);
  }
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
