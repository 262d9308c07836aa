// 8-lane float vector on AVX2 + FMA. Include only from the AVX2 translation unit (compiled with
// -mavx2 -mfma -mf16c), after defining ROUNDPIPE_ISA_NS; see scalar.hpp for why.
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
  // 8 bfloat16 / IEEE half values (bit patterns); rounding as in scalar.hpp (F16C for half).
  static Vec load_bf16(const std::uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  void store_bf16(std::uint16_t* p) const { store16(p, bf16_bits(), false); }
  void store_f16(std::uint16_t* p) const { store16(p, f16_bits(), false); }
  // Non-temporal versions (p 16-byte aligned): for a write-only stream, no read for ownership.
  void stream_bf16(std::uint16_t* p) const { store16(p, bf16_bits(), true); }
  void stream_f16(std::uint16_t* p) const { store16(p, f16_bits(), true); }
  // Non-temporal float32 store (p 32-byte aligned), for a write-only stream.
  void stream(float* p) const { _mm256_stream_ps(p, v); }
  static constexpr std::size_t stream_f32_align = 32;
  // Orders this thread's non-temporal stores before what follows.
  static void stream_fence() { _mm_sfence(); }
  static constexpr std::size_t stream_align = 16;

 private:
  static void store16(std::uint16_t* p, __m128i bits, bool nontemporal) {
    if (nontemporal)
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), bits);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
  }
  __m128i bf16_bits() const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  __m128i f16_bits() const { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

 public:
  static Vec load_f16(const std::uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }

  // Compact storage: as Scalar's (scalar.hpp), 8 lanes.
  struct Bits {
    __m256i v;
  };
  static Bits random_bits(std::uint32_t key, std::uint32_t first) {
    const __m256i lanes = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    __m256i x = _mm256_xor_si256(
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), lanes),
        _mm256_set1_epi32(static_cast<int>(key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return {x};
  }
  Vec round_bf16_stochastic(Bits r, int shift) const {
    const __m256i add = _mm256_and_si256(_mm256_srl_epi32(r.v, _mm_cvtsi32_si128(shift)),
                                         _mm256_set1_epi32(0xffff));
    const __m256i u = _mm256_and_si256(_mm256_add_epi32(_mm256_castps_si256(v), add),
                                       _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    return {_mm256_blendv_ps(_mm256_castsi256_ps(u), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q))};
  }
  void store_bf16_stochastic(std::uint16_t* p, Bits r) const {
    const __m256i add = _mm256_and_si256(r.v, _mm256_set1_epi32(0xffff));
    __m256i u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), add), 16);
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    store16(p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)), false);
  }
  static Vec load_u8(const std::uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))};
  }
  void store_u8(std::uint8_t* p) const {
    // byte 0 of every 32-bit lane, within each 128-bit half, then the two halves' 4 bytes
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(_mm256_cvttps_epi32(v), pick);
    const __m128i out = _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), out);
  }
  static Vec lookup(const float* table, Vec index) {
    return {_mm256_i32gather_ps(table, _mm256_cvttps_epi32(index.v), 4)};
  }
  static Vec lookup8(const float* table, Vec index) {
    return {_mm256_permutevar8x32_ps(_mm256_loadu_ps(table), _mm256_cvttps_epi32(index.v))};
  }
  // Quantized weights (kernels/dequant.hpp): table[index] for the 8 4-bit indices packed in
  // p[0, 4) (high nibble first): two permutes of the table's halves, bit 3 picks one; 8 int8
  // values widened.
  static Vec lookup_nf4(const float* table, const std::uint8_t* p) {
    std::int32_t four;
    std::memcpy(&four, p, sizeof four);
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m128i nib = _mm_set1_epi8(15);
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(
        _mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib)));
    const __m256 low = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), idx);
    const __m256 high = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), idx);
    return {_mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)))};
  }
  static Vec load_i8(const std::int8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))};
  }
  static bool any(Mask m) { return _mm256_movemask_ps(m.m) != 0; }
  // Integer lanes: as Scalar's (scalar.hpp), 8 lanes.
  static Bits bits(Vec x) { return {_mm256_castps_si256(x.v)}; }
  static Vec from_bits(Bits b) { return {_mm256_castsi256_ps(b.v)}; }
  static Bits load_u8_bits(const std::uint8_t* p) {
    return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))};
  }
  static Vec lookup(const float* table, Bits index) {
    return {_mm256_i32gather_ps(table, index.v, 4)};
  }
  static Bits bits_set1(std::uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x))}; }
  static Bits add(Bits a, Bits b) { return {_mm256_add_epi32(a.v, b.v)}; }
  static Bits sub(Bits a, Bits b) { return {_mm256_sub_epi32(a.v, b.v)}; }
  static Bits bit_and(Bits a, Bits b) { return {_mm256_and_si256(a.v, b.v)}; }
  static Bits bit_xor(Bits a, Bits b) { return {_mm256_xor_si256(a.v, b.v)}; }
  static Bits srl(Bits a, int n) { return {_mm256_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
  static Bits max_i32(Bits a, Bits b) { return {_mm256_max_epi32(a.v, b.v)}; }
  static Bits min_i32(Bits a, Bits b) { return {_mm256_min_epi32(a.v, b.v)}; }
  static Bits gt_i32(Bits a, Bits b) { return {_mm256_cmpgt_epi32(a.v, b.v)}; }
  static Bits lookup_bits(const std::uint32_t* table, Bits index) {
    return {_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index.v, 4)};
  }
  static void store_u8_bits(std::uint8_t* p, Bits b) {
    // byte 0 of every 32-bit lane, as store_u8
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    const __m256i s = _mm256_shuffle_epi8(b.v, pick);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
  }

  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }

  friend Mask operator<(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
  friend Mask operator>(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)}; }
  friend Mask operator>=(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GE_OQ)}; }
  friend Mask operator<=(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LE_OQ)}; }
  friend Mask operator==(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)}; }
  friend Mask operator!=(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_NEQ_UQ)}; }
};

inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec sqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }
inline Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline Vec select(Vec::Mask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m.m)}; }
inline Vec floor(Vec a) { return {_mm256_floor_ps(a.v)}; }
// max_ps(a, b) yields b when either is NaN; patch the lanes where a is NaN.
inline Vec maximum(Vec a, Vec b) {
  return select({_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm256_max_ps(a.v, b.v)});
}
inline Vec minimum(Vec a, Vec b) {
  return select({_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm256_min_ps(a.v, b.v)});
}
// minimum(a, bound) in one instruction, for a bound that is never NaN and never a zero of the
// other sign than a's: min_ps(x, y) returns y when either is NaN or when they are equal.
inline Vec minimum_bound(Vec a, Vec bound) { return {_mm256_min_ps(bound.v, a.v)}; }

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
