// 4-lane float vector on AArch64 Advanced SIMD (NEON). Include only from the NEON translation
// unit, after defining ROUNDPIPE_ISA_NS; see scalar.hpp for why.
#pragma once
#include <arm_neon.h>

#include "scalar.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

struct Vec {
  struct Mask {
    uint32x4_t m;
  };
  static constexpr std::size_t width = 4;
  float32x4_t v;

  static Vec load(const float* p) { return {vld1q_f32(p)}; }
  void store(float* p) const { vst1q_f32(p, v); }
  static Vec set1(float x) { return {vdupq_n_f32(x)}; }

  friend Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a) { return {vnegq_f32(a.v)}; }

  friend Mask operator<(Vec a, Vec b) { return {vcltq_f32(a.v, b.v)}; }
  friend Mask operator>(Vec a, Vec b) { return {vcgtq_f32(a.v, b.v)}; }
  friend Mask operator==(Vec a, Vec b) { return {vceqq_f32(a.v, b.v)}; }
  friend Mask operator!=(Vec a, Vec b) { return {vmvnq_u32(vceqq_f32(a.v, b.v))}; }
};

inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec sqrt(Vec a) { return {vsqrtq_f32(a.v)}; }
inline Vec abs(Vec a) { return {vabsq_f32(a.v)}; }
inline Vec select(Vec::Mask m, Vec a, Vec b) { return {vbslq_f32(m.m, a.v, b.v)}; }
// vmaxq/vminq already propagate NaN from either operand, as torch.maximum does.
inline Vec maximum(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec minimum(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
