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
  // Non-temporal float32 store (p 64-byte aligned), for a write-only stream.
  void stream(float* p) const { _mm512_stream_ps(p, v); }
  static constexpr std::size_t stream_f32_align = 64;
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

  // Compact storage: as Scalar's (scalar.hpp), 16 lanes.
  struct Bits {
    __m512i v;
  };
  static Bits random_bits(std::uint32_t key, std::uint32_t first) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i x = _mm512_xor_si512(
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lanes),
        _mm512_set1_epi32(static_cast<int>(key)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return {x};
  }
  Vec round_bf16_stochastic(Bits r, int shift) const {
    const __m512i add = _mm512_and_si512(_mm512_srl_epi32(r.v, _mm_cvtsi32_si128(shift)),
                                         _mm512_set1_epi32(0xffff));
    const __m512i u = _mm512_and_si512(_mm512_add_epi32(_mm512_castps_si512(v), add),
                                       _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(u), v)};
  }
  // round_bf16_stochastic(r, 0) stored as bfloat16: the bits directly.
  void store_bf16_stochastic(std::uint16_t* p, Bits r) const {
    const __m512i add = _mm512_and_si512(r.v, _mm512_set1_epi32(0xffff));
    __m512i u = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v), add), 16);
    u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    store16(p, _mm512_cvtepi32_epi16(u), false);
  }
  static Vec load_u8(const std::uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))};
  }
  void store_u8(std::uint8_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
  }
  static Vec lookup(const float* table, Vec index) {
    return {_mm512_i32gather_ps(_mm512_cvttps_epi32(index.v), table, 4)};
  }
  // table[index] for an 8-entry table (index exact, 0 .. 7): a permute within registers.
  static Vec lookup8(const float* table, Vec index) {
    const __m512 t = _mm512_castps256_ps512(_mm256_loadu_ps(table));
    return {_mm512_permutexvar_ps(_mm512_cvttps_epi32(index.v), t)};
  }
  // Quantized weights (kernels/dequant.hpp): table[index] for the 16 4-bit indices packed in
  // p[0, 8) (high nibble first), one permute; 16 int8 values widened.
  static Vec lookup_nf4(const float* table, const std::uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i idx = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nib),
                                          _mm_and_si128(b, nib));
    return {_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(idx), _mm512_loadu_ps(table))};
  }
  static Vec load_i8(const std::int8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
  }
  // Whether any lane of a mask is set.
  static bool any(Mask m) { return m.m != 0; }
  // Integer lanes: as Scalar's (scalar.hpp), 16 lanes.
  static Bits bits(Vec x) { return {_mm512_castps_si512(x.v)}; }
  static Vec from_bits(Bits b) { return {_mm512_castsi512_ps(b.v)}; }
  static Bits load_u8_bits(const std::uint8_t* p) {
    return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  static Vec lookup(const float* table, Bits index) {
    return {_mm512_i32gather_ps(index.v, table, 4)};
  }
  static Bits bits_set1(std::uint32_t x) { return {_mm512_set1_epi32(static_cast<int>(x))}; }
  static Bits add(Bits a, Bits b) { return {_mm512_add_epi32(a.v, b.v)}; }
  static Bits sub(Bits a, Bits b) { return {_mm512_sub_epi32(a.v, b.v)}; }
  static Bits bit_and(Bits a, Bits b) { return {_mm512_and_si512(a.v, b.v)}; }
  static Bits bit_xor(Bits a, Bits b) { return {_mm512_xor_si512(a.v, b.v)}; }
  static Bits srl(Bits a, int n) { return {_mm512_srl_epi32(a.v, _mm_cvtsi32_si128(n))}; }
  static Bits max_i32(Bits a, Bits b) { return {_mm512_max_epi32(a.v, b.v)}; }
  static Bits min_i32(Bits a, Bits b) { return {_mm512_min_epi32(a.v, b.v)}; }
  static Bits gt_i32(Bits a, Bits b) {
    return {_mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(a.v, b.v), _mm512_set1_epi32(-1))};
  }
  static Bits lookup_bits(const std::uint32_t* table, Bits index) {
    return {_mm512_i32gather_epi32(index.v, table, 4)};
  }
  static void store_u8_bits(std::uint8_t* p, Bits b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(b.v));
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
  friend Mask operator>=(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GE_OQ)}; }
  friend Mask operator<=(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ)}; }
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
inline Vec floor(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}
// max_ps(a, b) yields b when either is NaN; patch the lanes where a is NaN.
inline Vec maximum(Vec a, Vec b) {
  return select({_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm512_max_ps(a.v, b.v)});
}
inline Vec minimum(Vec a, Vec b) {
  return select({_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}, a, {_mm512_min_ps(a.v, b.v)});
}
// minimum(a, bound) in one instruction, for a bound that is never NaN and never a zero of the
// other sign than a's: min_ps(x, y) returns y when either is NaN or when they are equal.
inline Vec minimum_bound(Vec a, Vec bound) { return {_mm512_min_ps(bound.v, a.v)}; }

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
