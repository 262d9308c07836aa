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
  void stream(float* p) const { store(p); }
  static constexpr std::size_t stream_f32_align = 1;
  // Orders this thread's non-temporal stores before what follows.
  static void stream_fence() {  }
  static constexpr std::size_t stream_align = 1;
  static Vec load_f16(const std::uint16_t* p) {
    return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)))};
  }
  void store_f16(std::uint16_t* p) const {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }

  // Compact storage: as Scalar's (scalar.hpp), 4 lanes.
  struct Bits {
    uint32x4_t v;
  };
  static Bits random_bits(std::uint32_t key, std::uint32_t first) {
    const uint32_t lane_init[4] = {0, 1, 2, 3};
    uint32x4_t x = veorq_u32(vaddq_u32(vdupq_n_u32(first), vld1q_u32(lane_init)), vdupq_n_u32(key));
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    x = vmulq_u32(x, vdupq_n_u32(0x7feb352du));
    x = veorq_u32(x, vshrq_n_u32(x, 15));
    x = vmulq_u32(x, vdupq_n_u32(0x846ca68bu));
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    return {x};
  }
  Vec round_bf16_stochastic(Bits r, int shift) const {
    const uint32x4_t add = vandq_u32(vshlq_u32(r.v, vdupq_n_s32(-shift)), vdupq_n_u32(0xffff));
    const uint32x4_t u = vandq_u32(vaddq_u32(vreinterpretq_u32_f32(v), add), vdupq_n_u32(0xffff0000u));
    return {vbslq_f32(vceqq_f32(v, v), vreinterpretq_f32_u32(u), v)};
  }
  void store_bf16_stochastic(std::uint16_t* p, Bits r) const {
    const uint32x4_t add = vandq_u32(r.v, vdupq_n_u32(0xffff));
    const uint16x4_t u = vshrn_n_u32(vaddq_u32(vreinterpretq_u32_f32(v), add), 16);
    const uint16x4_t nan = vmovn_u32(vmvnq_u32(vceqq_f32(v, v)));
    vst1_u16(p, vbsl_u16(nan, vdup_n_u16(0x7fc0), u));
  }
  static Vec load_u8(const std::uint8_t* p) {
    std::uint32_t four;
    std::memcpy(&four, p, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(four));
    return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))))};
  }
  void store_u8(std::uint8_t* p) const {
    const uint16x4_t h = vmovn_u32(vcvtq_u32_f32(v));
    const uint8x8_t b = vmovn_u16(vcombine_u16(h, h));
    const std::uint32_t four = vget_lane_u32(vreinterpret_u32_u8(b), 0);
    std::memcpy(p, &four, 4);
  }
  static Vec lookup(const float* table, Vec index) {
    const uint32x4_t i = vcvtq_u32_f32(index.v);
    float32x4_t r = vdupq_n_f32(table[vgetq_lane_u32(i, 0)]);
    r = vsetq_lane_f32(table[vgetq_lane_u32(i, 1)], r, 1);
    r = vsetq_lane_f32(table[vgetq_lane_u32(i, 2)], r, 2);
    r = vsetq_lane_f32(table[vgetq_lane_u32(i, 3)], r, 3);
    return {r};
  }
  static Vec lookup8(const float* table, Vec index) { return lookup(table, index); }
  // Quantized weights (kernels/dequant.hpp): table[index] for the 4 4-bit indices packed in
  // p[0, 2) (high nibble first): one tbl over the table's 64 bytes (byte 4k + j of lane k is
  // byte j of table[index_k]); 4 int8 values widened.
  static Vec lookup_nf4(const float* table, const std::uint8_t* p) {
    const uint8x8_t b = vcreate_u8(static_cast<std::uint64_t>(p[0]) |
                                   static_cast<std::uint64_t>(p[1]) << 8);
    const uint8x8_t nib = vzip1_u8(vshr_n_u8(b, 4), vand_u8(b, vdup_n_u8(15)));
    static const std::uint8_t spread[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
    static const std::uint8_t byte[16] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
    const uint8x16_t lane = vqtbl1q_u8(vcombine_u8(nib, nib), vld1q_u8(spread));
    const uint8x16_t idx = vaddq_u8(vshlq_n_u8(lane, 2), vld1q_u8(byte));
    const std::uint8_t* bytes = reinterpret_cast<const std::uint8_t*>(table);
    const uint8x16x4_t t = {{vld1q_u8(bytes), vld1q_u8(bytes + 16), vld1q_u8(bytes + 32),
                             vld1q_u8(bytes + 48)}};
    return {vreinterpretq_f32_u8(vqtbl4q_u8(t, idx))};
  }
  static Vec load_i8(const std::int8_t* p) {
    std::int32_t four;
    std::memcpy(&four, p, sizeof four);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)))};
  }
  static bool any(Mask m) { return vmaxvq_u32(m.m) != 0; }
  // Integer lanes: as Scalar's (scalar.hpp), 4 lanes.
  static Bits bits(Vec x) { return {vreinterpretq_u32_f32(x.v)}; }
  static Vec from_bits(Bits b) { return {vreinterpretq_f32_u32(b.v)}; }
  static Bits load_u8_bits(const std::uint8_t* p) {
    std::uint32_t four;
    std::memcpy(&four, p, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(four));
    return {vmovl_u16(vget_low_u16(vmovl_u8(b)))};
  }
  static Vec lookup(const float* table, Bits index) {
    float32x4_t r = vdupq_n_f32(table[vgetq_lane_u32(index.v, 0)]);
    r = vsetq_lane_f32(table[vgetq_lane_u32(index.v, 1)], r, 1);
    r = vsetq_lane_f32(table[vgetq_lane_u32(index.v, 2)], r, 2);
    r = vsetq_lane_f32(table[vgetq_lane_u32(index.v, 3)], r, 3);
    return {r};
  }
  static Bits bits_set1(std::uint32_t x) { return {vdupq_n_u32(x)}; }
  static Bits add(Bits a, Bits b) { return {vaddq_u32(a.v, b.v)}; }
  static Bits sub(Bits a, Bits b) { return {vsubq_u32(a.v, b.v)}; }
  static Bits bit_and(Bits a, Bits b) { return {vandq_u32(a.v, b.v)}; }
  static Bits bit_xor(Bits a, Bits b) { return {veorq_u32(a.v, b.v)}; }
  static Bits srl(Bits a, int n) { return {vshlq_u32(a.v, vdupq_n_s32(-n))}; }
  static Bits max_i32(Bits a, Bits b) {
    return {vreinterpretq_u32_s32(vmaxq_s32(vreinterpretq_s32_u32(a.v), vreinterpretq_s32_u32(b.v)))};
  }
  static Bits min_i32(Bits a, Bits b) {
    return {vreinterpretq_u32_s32(vminq_s32(vreinterpretq_s32_u32(a.v), vreinterpretq_s32_u32(b.v)))};
  }
  static Bits gt_i32(Bits a, Bits b) {
    return {vcgtq_s32(vreinterpretq_s32_u32(a.v), vreinterpretq_s32_u32(b.v))};
  }
  static Bits lookup_bits(const std::uint32_t* table, Bits index) {
    uint32x4_t r = vdupq_n_u32(table[vgetq_lane_u32(index.v, 0)]);
    r = vsetq_lane_u32(table[vgetq_lane_u32(index.v, 1)], r, 1);
    r = vsetq_lane_u32(table[vgetq_lane_u32(index.v, 2)], r, 2);
    r = vsetq_lane_u32(table[vgetq_lane_u32(index.v, 3)], r, 3);
    return {r};
  }
  static void store_u8_bits(std::uint8_t* p, Bits b) {
    const uint16x4_t h = vmovn_u32(b.v);
    const uint8x8_t c = vmovn_u16(vcombine_u16(h, h));
    const std::uint32_t four = vget_lane_u32(vreinterpret_u32_u8(c), 0);
    std::memcpy(p, &four, 4);
  }

  friend Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.v, b.v)}; }
  friend Vec operator-(Vec a) { return {vnegq_f32(a.v)}; }

  friend Mask operator<(Vec a, Vec b) { return {vcltq_f32(a.v, b.v)}; }
  friend Mask operator>(Vec a, Vec b) { return {vcgtq_f32(a.v, b.v)}; }
  friend Mask operator>=(Vec a, Vec b) { return {vcgeq_f32(a.v, b.v)}; }
  friend Mask operator<=(Vec a, Vec b) { return {vcleq_f32(a.v, b.v)}; }
  friend Mask operator==(Vec a, Vec b) { return {vceqq_f32(a.v, b.v)}; }
  friend Mask operator!=(Vec a, Vec b) { return {vmvnq_u32(vceqq_f32(a.v, b.v))}; }
};

inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec sqrt(Vec a) { return {vsqrtq_f32(a.v)}; }
inline Vec abs(Vec a) { return {vabsq_f32(a.v)}; }
inline Vec select(Vec::Mask m, Vec a, Vec b) { return {vbslq_f32(m.m, a.v, b.v)}; }
inline Vec floor(Vec a) { return {vrndmq_f32(a.v)}; }
// vmaxq/vminq already propagate NaN from either operand, as torch.maximum does.
inline Vec maximum(Vec a, Vec b) { return {vmaxq_f32(a.v, b.v)}; }
inline Vec minimum(Vec a, Vec b) { return {vminq_f32(a.v, b.v)}; }
// minimum(a, bound) for a bound that is never NaN and never a zero of the other sign than a's
// (one instruction on x86 too).
inline Vec minimum_bound(Vec a, Vec bound) { return minimum(a, bound); }

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
