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
  // 4 bfloat16 / IEEE half values (bit patterns); rounding as in scalar.hpp (FPCR's default
  // round-to-nearest-even for half).
  static Vec load_bf16(const std::uint16_t* p) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16))};
  }
  void store_bf16(std::uint16_t* p) const {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint16x4_t r = vshrn_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    const uint16x4_t nan = vmovn_u32(vmvnq_u32(vceqq_f32(v, v)));
    vst1_u16(p, vbsl_u16(nan, vdup_n_u16(0x7fc0), r));
  }
  // No non-temporal stores here: the plain ones.
  void stream_bf16(std::uint16_t* p) const { store_bf16(p); }
  void stream_f16(std::uint16_t* p) const { store_f16(p); }
  // Orders this thread's non-temporal stores before what follows.
  static void stream_fence() {  }
  static constexpr std::size_t stream_align = 1;
  static Vec load_f16(const std::uint16_t* p) {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))};
  }
  void store_f16(std::uint16_t* p) const {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }

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
