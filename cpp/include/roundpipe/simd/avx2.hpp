// 8-lane float vector on AVX2 + FMA. Include only from the AVX2 translation unit (compiled with
// -mavx2 -mfma), after defining ROUNDPIPE_ISA_NS; see scalar.hpp for why.
#pragma once
#include <immintrin.h>

#include "scalar.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

struct Vec {
  struct Mask {
    __m256 m;
  };
  static constexpr std::size_t width = 8;
  __m256 v;

  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }

  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }

  friend Mask operator<(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
  friend Mask operator>(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)}; }
  friend Mask operator==(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)}; }
  friend Mask operator!=(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_NEQ_UQ)}; }
};

inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec sqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }
inline Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline Vec select(Vec::Mask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m.m)}; }
// max_ps(a, b) yields b when either is NaN; patch the lanes where a is NaN.
inline Vec maximum(Vec a, Vec b) {
  return select({_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm256_max_ps(a.v, b.v)});
}
inline Vec minimum(Vec a, Vec b) {
  return select({_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm256_min_ps(a.v, b.v)});
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
