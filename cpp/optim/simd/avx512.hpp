// 16-lane float vector on AVX-512F. Include only from the AVX-512 translation unit (compiled
// with -mavx512f and friends), after defining ROUNDPIPE_ISA_NS; see scalar.hpp for why.
#pragma once
#include <immintrin.h>

#include "scalar.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

struct Vec {
  struct Mask {
    __mmask16 m;
  };
  static constexpr std::size_t width = 16;
  __m512 v;

  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  // 16 bfloat16 / IEEE half values (bit patterns); rounding as in scalar.hpp.
  static Vec load_bf16(const std::uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  void store_bf16(std::uint16_t* p) const { store16(p, bf16_bits(), false); }
  void store_f16(std::uint16_t* p) const { store16(p, f16_bits(), false); }
  // Non-temporal versions (p 32-byte aligned): for a write-only stream, no read for ownership.
  void stream_bf16(std::uint16_t* p) const { store16(p, bf16_bits(), true); }
  void stream_f16(std::uint16_t* p) const { store16(p, f16_bits(), true); }
  // Orders this thread's non-temporal stores before what follows.
  static void stream_fence() { _mm_sfence(); }
  static constexpr std::size_t stream_align = 32;

 private:
  static void store16(std::uint16_t* p, __m256i bits, bool nontemporal) {
    if (nontemporal)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bits);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
  }
  __m256i bf16_bits() const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  __m256i f16_bits() const { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

 public:
  static Vec load_f16(const std::uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }

  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a) {
    return {_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v),
                                                 _mm512_set1_epi32(INT32_MIN)))};
  }

  friend Mask operator<(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
  friend Mask operator>(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
  friend Mask operator==(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ)}; }
  friend Mask operator!=(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_NEQ_UQ)}; }
};

inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec sqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }
inline Vec abs(Vec a) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v),
                                               _mm512_set1_epi32(INT32_MAX)))};
}
inline Vec select(Vec::Mask m, Vec a, Vec b) { return {_mm512_mask_blend_ps(m.m, b.v, a.v)}; }
// max_ps(a, b) yields b when either is NaN; patch the lanes where a is NaN.
inline Vec maximum(Vec a, Vec b) {
  return select({_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm512_max_ps(a.v, b.v)});
}
inline Vec minimum(Vec a, Vec b) {
  return select({_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm512_min_ps(a.v, b.v)});
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
