// The mixed-precision pass (roundpipe/step_io.hpp) against its unfused composition, for any
// algorithm: gradient converted and unscaled into a float32 array by the reference conversions
// below (written here, independent of the library's SIMD code), the plain float32 step, the
// updated parameter rounded by the same reference conversions. Every buffer must be identical.
#pragma once
#include <cstdint>

#include "support.hpp"

namespace rptest {

inline std::uint32_t bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// bfloat16 <-> float: widening shifts the bits; narrowing picks the nearer of the two bfloat16
// neighbours (compared in double), the one with an even last bit on a tie; NaN -> 0x7fc0.
inline float bf16_to_float(std::uint16_t h) { return from_bits(std::uint32_t(h) << 16); }
inline std::uint16_t float_to_bf16(float x) {
  if (std::isnan(x)) return 0x7fc0;
  const std::uint32_t down = bits(x) & 0xffff0000u;  // toward zero
  if (down == bits(x)) return std::uint16_t(down >> 16);
  const std::uint32_t up = down + 0x10000u;          // away from zero (may become inf)
  const double dd = std::fabs(double(x) - double(from_bits(down)));
  const double du = std::isinf(from_bits(up)) ? std::fabs(double(x) - std::ldexp(1.0, 128) *
                                                                           (x < 0 ? -1 : 1))
                                              : std::fabs(double(x) - double(from_bits(up)));
  const bool pick_up = du < dd || (du == dd && ((down >> 16) & 1u));
  return std::uint16_t((pick_up ? up : down) >> 16);
}

// IEEE half <-> float from the format's definition, in double (portable: no compiler half
// type): a half is (-1)^s * 2^(e - 15) * (1 + m / 1024), or 2^-14 * m / 1024 when e == 0.
// Narrowing rounds x / quantum to the nearest integer, ties to even (std::nearbyint in the
// default rounding mode); magnitudes that round to 65536 or more become inf; NaN -> 0x7e00.
inline float f16_to_float(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? NAN : float(sign * INFINITY);
  return float(sign * (e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25)));
}
inline std::uint16_t float_to_f16(float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7e00;
  const double a = std::fabs(double(x));
  const int exponent = a < std::ldexp(1.0, -14) ? -14 : std::ilogb(a);  // of the binade
  const double units = std::nearbyint(std::ldexp(a, 10 - exponent));     // quantum 2^(e-10)
  const double rounded = std::ldexp(units, exponent - 10);
  if (rounded >= 65536.0) return sign | 0x7c00;
  if (rounded < std::ldexp(1.0, -14)) return sign | std::uint16_t(std::ldexp(rounded, 24));
  const int e = std::ilogb(rounded);  // rounding may have carried into the next binade
  return sign | std::uint16_t((e + 15) << 10) |
         std::uint16_t(std::ldexp(rounded, 10 - e) - 1024.0);
}

inline float to_float(std::uint16_t h, roundpipe::Dtype d) {
  return d == roundpipe::Dtype::bfloat16 ? bf16_to_float(h) : f16_to_float(h);
}
inline std::uint16_t from_float(float x, roundpipe::Dtype d) {
  return d == roundpipe::Dtype::bfloat16 ? float_to_bf16(x) : float_to_f16(x);
}

// The fused pass equals its composition: on every ISA, sizes across vector widths, the 2048
// staging slice and the 16384 chunk; gradients given as float32, bfloat16 or float16 (each case
// with a non-finite element or not); a model copy as none, float32, bfloat16 or float16;
// grad_scale 1 or 1024; the copy aligned for non-temporal stores or not. Also checks found_inf and grad_norm_sq (against
// a float64 sum of the unscaled gradients' squares).
template <class Options>
void expect_mixed_precision_like_composition(const Algorithm<Options>& a, const Options& o,
                                             int steps = 2) {
  using roundpipe::Dtype;
  const Dtype grad_types[] = {Dtype::float32, Dtype::bfloat16, Dtype::float16};
  const int copy_types[] = {-1, int(Dtype::float32), int(Dtype::bfloat16), int(Dtype::float16)};
  for_each_isa([&](roundpipe::Isa) {
    std::mt19937 rng(11);
    // two chunks and a tail natively; under emulation (quick) one staging slice and a tail
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{37}, std::size_t{2048 + 19},
                          scaled(16384 * 2 + 5, 0)})
      for (Dtype gd : grad_types)
        for (int cd : copy_types)
          for (double scale : {1.0, 1024.0})
            for (bool inject_inf : {false, true}) {
              if (inject_inf && (n == 0 || scale != 1.0)) continue;
              SCOPED_TRACE("n=" + std::to_string(n) + " grad dtype " + std::to_string(int(gd)) +
                           " copy dtype " + std::to_string(cd) + " scale " + std::to_string(scale) +
                           (inject_inf ? " with inf" : ""));
              Host fused = a.init(randn(n, rng), o), plain = fused;
              // the 16-bit copy 64-byte aligned (non-temporal stores) for scale 1, one element
              // past that (plain stores) for scale 1024
              std::vector<std::uint16_t> copy_buffer(n + 64, 0xdead);
              std::uint16_t* copy = copy_buffer.data();
              while (reinterpret_cast<std::uintptr_t>(copy) % 64 != 0) ++copy;
              if (scale != 1.0) ++copy;
              std::vector<float> copy32(n, -1.0f);
              for (int s = 0; s < steps; ++s) {
                // the gradient as the caller holds it, and the float32 the composition uses
                std::vector<float> g32 = randn(n, rng, float(scale));
                std::vector<std::uint16_t> g16(n);
                if (inject_inf && s == steps - 1) g32[n / 2] = INFINITY;
                if (gd != Dtype::float32)
                  for (std::size_t i = 0; i < n; ++i) g16[i] = from_float(g32[i], gd);
                const float inv = float(1.0 / scale);
                std::vector<float> unscaled(n);
                double norm_sq = 0.0;
                for (std::size_t i = 0; i < n; ++i) {
                  const float g = gd == Dtype::float32 ? g32[i] : to_float(g16[i], gd);
                  unscaled[i] = g * inv;
                  norm_sq += double(unscaled[i]) * unscaled[i];
                }
                roundpipe::ParamBuffers t = fused.view(g32);
                if (gd != Dtype::float32) {
                  t.grad = nullptr;
                  t.grad16 = g16.data();
                  t.grad16_dtype = gd;
                }
                if (cd >= 0) {
                  t.model_copy = Dtype(cd) == Dtype::float32 ? static_cast<void*>(copy32.data())
                                                             : static_cast<void*>(copy);
                  t.model_copy_dtype = Dtype(cd);
                }
                roundpipe::StepIO io;
                io.grad_scale = scale;
                io.want_grad_norm = true;
                a.step(o, &t, 1, &io);
                const roundpipe::ParamBuffers u = plain.view(unscaled);
                a.step(o, &u, 1, nullptr);
                EXPECT_EQ(io.found_inf, inject_inf && s == steps - 1);
                if (!io.found_inf) {
                  EXPECT_NEAR(io.grad_norm_sq, norm_sq, 1e-5 * norm_sq + 1e-30);
                }
              }
              expect_identical(fused, plain, "fused vs composition");
              if (cd == int(Dtype::float32)) expect_identical(copy32, plain.param, "copy");
              if (cd == int(Dtype::bfloat16) || cd == int(Dtype::float16)) {
                int reported = 0;
                for (std::size_t i = 0; i < n; ++i) {
                  const std::uint16_t want = from_float(plain.param[i], Dtype(cd));
                  if (copy[i] != want && reported++ < 5)
                    ADD_FAILURE() << "copy[" << i << "] = " << copy[i] << ", want " << want
                                  << " (param " << plain.param[i] << ")";
                }
              }
            }
  });
}

}  // namespace rptest
