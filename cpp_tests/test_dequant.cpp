// Quantized weights (roundpipe/dequant.hpp): NF4 and int8 dequantization into float32, bfloat16
// and float16 against a float64 reference written here (the published NF4 code book; the exact
// product in double, rounded to float32, then to the output format to nearest even), bit for
// bit, on every ISA, at every tail size, and over the worker pool for big tensors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/roundpipe.hpp"
#include "support.hpp"

namespace {

using roundpipe::Dtype;

// QLoRA's NF4 data type (Dettmers et al. 2023, appendix E; bitsandbytes' get_4bit_type("nf4")).
const double kNf4[16] = {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                         0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                         0.7229568362236023, 1.0};

// x rounded to nearest even with `mantissa` explicit bits and the smallest normal exponent
// `emin` (below it, the subnormal quantum); above `max` (the largest finite value), inf. In
// double, exactly (x / quantum is exact).
double round_format(double x, int mantissa, int emin, double max) {
  if (x == 0 || std::isnan(x) || std::isinf(x)) return x;
  int e = std::ilogb(x);
  if (e < emin) e = emin;
  const double quantum = std::ldexp(1.0, e - mantissa);
  const double r = std::nearbyint(x / quantum) * quantum;  // default mode: to nearest even
  return std::fabs(r) > max ? std::copysign(INFINITY, r) : r;
}

// The reference value of code value c times scale s in `dtype`, as a double.
double reference(double c, float s, Dtype dtype) {
  const double f32 = static_cast<float>(c * static_cast<double>(s));  // exact product, one rounding
  if (dtype == Dtype::float32) return f32;
  if (dtype == Dtype::bfloat16) return round_format(f32, 7, -126, 0x1.fep127);
  return round_format(f32, 10, -14, 65504.0);
}

// Element i of an output array of `dtype`, decoded here (not with the library's conversions).
double decoded(const std::vector<std::uint8_t>& out, std::size_t i, Dtype dtype) {
  if (dtype == Dtype::float32) {
    float f;
    std::memcpy(&f, out.data() + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, out.data() + 2 * i, 2);
  if (dtype == Dtype::bfloat16) {
    const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  const double mag = exp == 31 ? (man ? NAN : INFINITY)
                     : exp == 0 ? std::ldexp(man, -24)
                                : std::ldexp(1024 + man, exp - 25);
  return sign ? -mag : mag;
}

const char* name(Dtype d) {
  return d == Dtype::float32 ? "float32" : d == Dtype::bfloat16 ? "bfloat16" : "float16";
}

// Per-block scales over many magnitudes (float16 overflow and subnormals included), some zero.
std::vector<float> scales(std::size_t blocks, std::mt19937& rng) {
  std::uniform_real_distribution<float> exponent(-30.0f, 20.0f);
  std::vector<float> s(blocks);
  for (std::size_t b = 0; b < blocks; ++b) s[b] = b % 13 == 5 ? 0.0f : std::exp2(exponent(rng));
  return s;
}

std::vector<std::size_t> sizes() {
  std::vector<std::size_t> n = rptest::sizes();
  n.push_back(64);
  n.push_back(65);
  n.push_back(64 * 1024 * 3 + 31);  // several pool tasks and a partial last block
  return n;
}

// Dequantizes n values of `dtype` with `dequantize(out)` into a buffer with 8 guard bytes and
// expects every value to equal want(i), the float64 reference (the sign of a zero included),
// and nothing past the n values to be written.
template <class Dequantize, class Want>
void expect_reference(std::size_t n, Dtype dtype, Dequantize dequantize, Want want) {
  const std::size_t width = dtype == Dtype::float32 ? 4 : 2;
  std::vector<std::uint8_t> out(n * width + 8, 0xab);
  dequantize(out.data());
  int bad = 0;
  for (std::size_t i = 0; i < n && bad < 5; ++i) {
    const double w = want(i);
    const double got = decoded(out, i, dtype);
    if (!(got == w && std::signbit(got) == std::signbit(w))) {
      ADD_FAILURE() << "value " << i << ": got " << got << ", want " << w;
      ++bad;
    }
  }
  for (std::size_t k = n * width; k < out.size(); ++k)
    ASSERT_EQ(out[k], 0xab) << "wrote past the end";
}

TEST(Dequant, Nf4MatchesFloat64Reference) {
  std::mt19937 rng(7);
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (std::size_t n : sizes()) {
      const std::size_t blocks = roundpipe::weight_blocks(n);
      std::vector<std::uint8_t> codes(blocks * roundpipe::kWeightBlock / 2);
      for (auto& c : codes) c = static_cast<std::uint8_t>(rng());
      const std::vector<float> absmax = scales(blocks, rng);
      for (Dtype dtype : {Dtype::float32, Dtype::bfloat16, Dtype::float16}) {
        SCOPED_TRACE(std::string(name(dtype)) + " n=" + std::to_string(n));
        expect_reference(
            n, dtype,
            [&](void* out) {
              roundpipe::dequantize_nf4(codes.data(), absmax.data(), n, dtype, out);
            },
            [&](std::size_t i) {
              const unsigned idx = i % 2 ? codes[i / 2] & 15 : codes[i / 2] >> 4;
              return reference(kNf4[idx], absmax[i / 64], dtype);
            });
      }
    }
  });
}

TEST(Dequant, Int8MatchesFloat64Reference) {
  std::mt19937 rng(11);
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (std::size_t n : sizes()) {
      const std::size_t blocks = roundpipe::weight_blocks(n);
      std::vector<std::int8_t> codes(blocks * roundpipe::kWeightBlock);
      for (auto& c : codes) c = static_cast<std::int8_t>(static_cast<int>(rng() % 255) - 127);
      const std::vector<float> scale = scales(blocks, rng);
      for (Dtype dtype : {Dtype::float32, Dtype::bfloat16, Dtype::float16}) {
        SCOPED_TRACE(std::string(name(dtype)) + " n=" + std::to_string(n));
        expect_reference(
            n, dtype,
            [&](void* out) {
              roundpipe::dequantize_int8(codes.data(), scale.data(), n, dtype, out);
            },
            [&](std::size_t i) { return reference(codes[i], scale[i / 64], dtype); });
      }
    }
  });
}

TEST(Dequant, SameBitsOnAnyThreadCount) {
  std::mt19937 rng(3);
  const std::size_t n = rptest::scaled(1'000'003, 70'001);
  std::vector<std::uint8_t> codes(roundpipe::weight_blocks(n) * 32);
  for (auto& c : codes) c = static_cast<std::uint8_t>(rng());
  const std::vector<float> absmax = scales(roundpipe::weight_blocks(n), rng);
  std::vector<std::uint16_t> one(n), many(n);
  {
    roundpipe::ThreadCountScope scope(1);
    roundpipe::dequantize_nf4(codes.data(), absmax.data(), n, Dtype::bfloat16, one.data());
  }
  {
    roundpipe::ThreadCountScope scope(4);
    roundpipe::dequantize_nf4(codes.data(), absmax.data(), n, Dtype::bfloat16, many.data());
  }
  EXPECT_EQ(one, many);
}

TEST(Dequant, ArgumentErrors) {
  std::vector<std::uint8_t> codes(32);
  std::vector<float> absmax(1), out(64);
  EXPECT_THROW(roundpipe::dequantize_nf4(nullptr, absmax.data(), 64, Dtype::float32, out.data()),
               roundpipe::Error);
  EXPECT_THROW(roundpipe::dequantize_int8(reinterpret_cast<const std::int8_t*>(codes.data()),
                                          nullptr, 64, Dtype::float32, out.data()),
               roundpipe::Error);
  EXPECT_THROW(roundpipe::dequantize_nf4(codes.data(), absmax.data(), 64, Dtype::float32, nullptr),
               roundpipe::Error);
  EXPECT_THROW(roundpipe::dequantize_nf4(codes.data(), absmax.data(), 64,
                                         static_cast<Dtype>(7), out.data()),
               roundpipe::Error);
  roundpipe::dequantize_nf4(nullptr, nullptr, 0, Dtype::float32, nullptr);  // n == 0: nothing
}

}  // namespace
