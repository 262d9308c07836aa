// Compact storage (roundpipe/compact.hpp): the dynamic maps against their definition written
// here, quantisation to the nearest code, round-trip errors bounded by the block's scale,
// stochastic rounding (unbiased, a neighbour of the value, reproducible, the same on every ISA and
// thread count), and compact state and bfloat16 parameters inside the step functions against a
// float64 reference of the same quantised algorithm, on every ISA.
//
// The quantiser's one-place correction is proven for every float32 in [-1, 1] by an exhaustive
// run (all 2^31 values per map, every ISA; ~1 min natively), switched on by
// ROUNDPIPE_TEST_EXHAUSTIVE=1; the normal run checks every float within 48 ulps of each code
// boundary and decade edge, and random values of every magnitude.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "roundpipe/roundpipe.hpp"
#include "support.hpp"

namespace {

using roundpipe::StateFormat;

// --- the dynamic maps from their definition ---------------------------------------------------

// Decade i = 0..6 spans [10^(i-7), 10^(i-6)) with n_i = 2^i (signed) or 2^(i+1) (unsigned)
// values 10^(i-6) * (0.1 + 0.9 * (j + 0.5) / n_i); the signed map holds them, their negatives,
// 0 and 1; the unsigned one them, 0 and 1. Ascending.
std::vector<float> reference_map(bool is_signed) {
  const double top[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<double> values = {0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int n = is_signed ? 1 << i : 2 << i;
    for (int j = 0; j < n; ++j) {
      const double v = top[i] * (0.1 + 0.9 * (j + 0.5) / n);
      values.push_back(v);
      if (is_signed) values.push_back(-v);
    }
  }
  std::sort(values.begin(), values.end());
  std::vector<float> out(values.begin(), values.end());
  return out;
}

// Code k holds (bound[k], bound[k + 1]]: the float32-rounded midpoints of the map's neighbours.
// (Kept as floats: GCC 12.2 at -O3 vectorises `b[k] = float(x)` into a double array without the
// rounding to float.)
std::vector<float> reference_bounds(const std::vector<float>& map) {
  std::vector<float> b(257);
  b[0] = -INFINITY;
  b[256] = INFINITY;
  for (int k = 1; k < 256; ++k) b[k] = float((double(map[k - 1]) + map[k]) / 2);
  return b;
}

int nearest_code(const std::vector<float>& bound, double y) {
  int lo = 0, hi = 255;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (y <= bound[mid + 1]) hi = mid; else lo = mid + 1;
  }
  return lo;
}

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(Compact, DynamicMapsMatchTheirDefinition) {
  for (bool is_signed : {true, false}) {
    const std::vector<float> want = reference_map(is_signed);
    ASSERT_EQ(want.size(), 256u);
    const float* got = roundpipe::dynamic_map(is_signed);
    for (int k = 0; k < 256; ++k) EXPECT_EQ(to_bits(got[k]), to_bits(want[k])) << "code " << k;
  }
  EXPECT_EQ(roundpipe::dynamic_map(true)[127], 0.0f);
  EXPECT_EQ(roundpipe::dynamic_map(true)[255], 1.0f);
  EXPECT_EQ(roundpipe::dynamic_map(false)[0], 0.0f);
}

// Quantises `values` in blocks whose first element is 1 (so absmax is exactly 1 and each value
// is its own y) and checks every code against the nearest one.
void expect_nearest_codes(bool is_signed, const std::vector<float>& values) {
  const std::vector<float> bound = reference_bounds(reference_map(is_signed));
  std::vector<float> x;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (x.size() % roundpipe::kQuantBlock == 0) x.push_back(1.0f);
    x.push_back(values[i]);
  }
  std::vector<std::uint8_t> codes(x.size());
  std::vector<float> absmax(roundpipe::quant_blocks(x.size()));
  roundpipe::quantize_blockwise(x.data(), x.size(), is_signed, codes.data(), absmax.data());
  int reported = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double y = !is_signed && x[i] < 0 ? 0.0 : x[i];
    const int want = nearest_code(bound, y);
    if (codes[i] != want && reported++ < 5)
      ADD_FAILURE() << (is_signed ? "signed" : "unsigned") << " map: " << x[i] << " -> code "
                    << int(codes[i]) << ", nearest " << want;
  }
  for (float a : absmax) EXPECT_EQ(a, 1.0f);
}

// Every float32 within 48 ulps of each code boundary and decade edge, values of every magnitude
// down to the subnormals, exact map values, 0 and -0.
std::vector<float> hard_values(bool is_signed) {
  const std::vector<float> map = reference_map(is_signed);
  std::vector<float> edges;
  for (int k = 1; k < 256; ++k) edges.push_back(float((double(map[k - 1]) + map[k]) / 2));
  for (double e = 1e-7; e < 1.5; e *= 10) edges.push_back(float(e));
  edges.insert(edges.end(), map.begin(), map.end());
  std::vector<float> out = {0.0f, -0.0f, 1.0f, from_bits(1), 1e-38f, 1e-30f};
  for (float e : edges) {
    if (e == 0.0f) continue;
    const std::uint32_t u = to_bits(std::fabs(e));
    for (int d = -48; d <= 48; ++d) {
      const float f = from_bits(u + d);
      if (!(f <= 1.0f)) continue;
      out.push_back(f);
      if (is_signed) out.push_back(-f);
    }
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> expo(-45.0f, 0.0f);
  for (int i = 0; i < 20000; ++i) {
    const float f = std::pow(10.0f, expo(rng));
    out.push_back(i % 2 && is_signed ? -f : f);
  }
  return out;
}

TEST(Compact, QuantisationPicksTheNearestCodeOnEveryIsa) {
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (bool is_signed : {true, false}) expect_nearest_codes(is_signed, hard_values(is_signed));
  });
}

TEST(Compact, QuantisationPicksTheNearestCodeForEveryFloat) {
  const char* e = std::getenv("ROUNDPIPE_TEST_EXHAUSTIVE");
  if (!e || std::string(e) != "1") GTEST_SKIP() << "set ROUNDPIPE_TEST_EXHAUSTIVE=1";
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (bool is_signed : {true, false})
      for (std::uint32_t sign : {0u, 0x80000000u}) {
        std::vector<float> values;
        for (std::uint32_t u = 0; u <= 0x3f800000u; ++u) {
          values.push_back(from_bits(u | sign));
          if (values.size() == (1u << 24) || u == 0x3f800000u) {
            expect_nearest_codes(is_signed, values);
            values.clear();
          }
        }
      }
  });
}

TEST(Compact, RoundTripErrorIsBoundedByTheBlockScale) {
  std::mt19937 rng(11);
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (bool is_signed : {true, false}) {
      const float* map = roundpipe::dynamic_map(is_signed);
      for (float scale : {1.0f, 3e-3f, 7e4f, 1e-30f, 1e-40f, 3e37f}) {
        // a partial last block; magnitudes spread over 8 decades below the block's maximum
        const std::size_t n = rptest::scaled(5 * roundpipe::kQuantBlock + 77, 300);
        std::uniform_real_distribution<float> expo(-8.0f, 0.0f);
        std::vector<float> x(n);
        for (std::size_t i = 0; i < n; ++i) {
          const float m = scale * std::pow(10.0f, expo(rng));
          x[i] = is_signed && i % 3 == 0 ? -m : m;
        }
        std::vector<std::uint8_t> codes(n);
        std::vector<float> absmax(roundpipe::quant_blocks(n)), back(n);
        roundpipe::quantize_blockwise(x.data(), n, is_signed, codes.data(), absmax.data());
        roundpipe::dequantize_blockwise(codes.data(), absmax.data(), n, is_signed, back.data());
        for (std::size_t b = 0; b < absmax.size(); ++b) {
          float want = 0.0f;
          for (std::size_t i = b * 256; i < std::min(n, b * 256 + 256); ++i)
            want = std::max(want, std::fabs(x[i]));
          EXPECT_EQ(absmax[b], want) << "block " << b;
        }
        int reported = 0;
        for (std::size_t i = 0; i < n; ++i) {
          const int c = codes[i];
          const double a = absmax[i / 256];
          EXPECT_EQ(back[i], float(map[c] * a));
          // within half the gap to the neighbouring code on x's side (below the signed map's
          // lowest value, -0.99297, the distance to -1), times the scale, plus the float32
          // roundings of y and of the product (and 1e-45 for a subnormal scale)
          const double y = double(x[i]) / a;
          const int nb = y > map[c] ? std::min(c + 1, 255) : std::max(c - 1, 0);
          const double half_gap = y < map[0] ? map[0] + 1.0 : 0.5 * std::fabs(double(map[nb]) - map[c]);
          const double slack = 4e-7 * std::fabs(double(x[i])) + 2e-45;
          if (!(std::fabs(double(back[i]) - x[i]) <= half_gap * a + slack) && reported++ < 5)
            ADD_FAILURE() << "scale " << scale << " x " << x[i] << " -> " << back[i]
                          << " (code " << c << ", absmax " << a << ")";
          // and within the map's largest gap, 0.9 / 64, times the scale
          EXPECT_LE(std::fabs(double(back[i]) - x[i]), 0.5 * 0.9 / 64 * a + slack);
        }
      }
    }
  });
}

TEST(Compact, SpecialBlocks) {
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (bool is_signed : {true, false}) {
      const std::size_t n = 3 * 256;
      std::vector<float> x(n, 0.0f);                 // block 0: zeros
      for (std::size_t i = 256; i < 512; ++i) x[i] = 0.5f;
      x[300] = NAN;                                   // block 1: a NaN
      for (std::size_t i = 512; i < n; ++i) x[i] = -0.25f;
      x[700] = INFINITY;                              // block 2: an inf (and, unsigned, negatives)
      std::vector<std::uint8_t> codes(n);
      std::vector<float> absmax(3), back(n);
      roundpipe::quantize_blockwise(x.data(), n, is_signed, codes.data(), absmax.data());
      roundpipe::dequantize_blockwise(codes.data(), absmax.data(), n, is_signed, back.data());
      EXPECT_EQ(absmax[0], 0.0f);
      EXPECT_TRUE(std::isnan(absmax[1]));
      EXPECT_TRUE(std::isinf(absmax[2]));
      for (std::size_t i = 0; i < 256; ++i) EXPECT_EQ(back[i], 0.0f) << i;
      for (std::size_t i = 256; i < n; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;
    }
    // the unsigned map has no negative values: they become 0
    std::vector<float> x = {1.0f, -0.5f, 0.25f};
    std::vector<std::uint8_t> codes(3);
    float absmax;
    roundpipe::quantize_blockwise(x.data(), 3, false, codes.data(), &absmax);
    EXPECT_EQ(codes[1], 0);
  });
}

// --- stochastic rounding ----------------------------------------------------------------------

// The two bfloat16 values around x (equal when x is one).
std::pair<float, float> bf16_neighbours(float x) {
  const std::uint32_t u = to_bits(x);
  const float down = from_bits(u & 0xffff0000u);
  const float up = (u & 0xffffu) ? from_bits((u & 0xffff0000u) + 0x10000u) : down;
  return {down, up};
}

TEST(Compact, StochasticRoundingIsUnbiasedAndPicksANeighbour) {
  // 2^22 draws of each value: the mean error must be below 1e-3 of the bfloat16 step (the
  // sampling error of the mean is ~0.25e-3 of a step)
  const std::size_t n = rptest::scaled(1u << 22, 1u << 16);
  const double limit = rptest::quick() ? 1e-2 : 1e-3;
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (float x : {1.0f + 0x1p-9f, 1.0f + 3 * 0x1p-10f + 0x1p-20f, -0.3f, 1e-30f, 3.3e38f,
                    from_bits(0x00400001u), 1234.567f}) {
      const std::vector<float> src(n, x);
      std::vector<std::uint16_t> out(n);
      roundpipe::round_bf16_stochastic(src.data(), n, 42, out.data());
      const auto [down, up] = bf16_neighbours(x);
      double sum = 0.0;
      std::size_t ups = 0;
      for (std::uint16_t h : out) {
        const float r = from_bits(std::uint32_t(h) << 16);
        ASSERT_TRUE(r == down || r == up) << x << " -> " << r;
        sum += double(r) - x;
        ups += r == up && up != down;
      }
      const double step = double(up) - down;
      EXPECT_LT(std::fabs(sum / n) / step, limit) << x << ": mean error " << sum / n;
      EXPECT_GT(ups, 0u) << x;
    }
  });
}

TEST(Compact, StochasticRoundingSpecialValues) {
  rptest::for_each_isa([&](roundpipe::Isa) {
    const std::vector<float> x = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1.5f, -2.0f,
                                  from_bits(0x7f7fffffu), from_bits(0x00010000u)};
    std::vector<std::uint16_t> out(x.size());
    for (std::uint64_t seed = 0; seed < 64; ++seed) {
      roundpipe::round_bf16_stochastic(x.data(), x.size(), seed, out.data());
      EXPECT_EQ(out[0], 0x7f80);
      EXPECT_EQ(out[1], 0xff80);
      EXPECT_EQ(out[2], 0x7fc0);
      EXPECT_EQ(out[3], 0x0000);
      EXPECT_EQ(out[4], 0x8000);
      EXPECT_EQ(out[5], 0x3fc0);                      // exact values stay
      EXPECT_EQ(out[6], 0xc000);
      EXPECT_TRUE(out[7] == 0x7f7f || out[7] == 0x7f80);  // up past the largest: inf
      EXPECT_EQ(out[8], 0x0001);                      // a subnormal bfloat16
    }
  });
}

// Natively enough elements for 3 threads (rptest::kElementsPerThread); emulated, one chunk.
TEST(Compact, StochasticRoundingIsReproducibleAndTheSameOnEveryIsaAndThreadCount) {
  std::mt19937 rng(3);
  const std::vector<float> x =
      rptest::randn(rptest::scaled(3 * rptest::kElementsPerThread + 3, 3001), rng);
  std::vector<std::uint16_t> first(x.size()), other(x.size());
  const roundpipe::Isa before = roundpipe::active_isa();
  const int threads = roundpipe::num_threads();
  roundpipe::round_bf16_stochastic(x.data(), x.size(), 7, first.data());
  rptest::for_each_isa([&](roundpipe::Isa) {
    for (int t : {1, 3}) {
      roundpipe::set_num_threads(t);
      roundpipe::round_bf16_stochastic(x.data(), x.size(), 7, other.data());
      EXPECT_EQ(other, first);
    }
  });
  roundpipe::set_num_threads(threads);
  roundpipe::set_isa(before);
  roundpipe::round_bf16_stochastic(x.data(), x.size(), 8, other.data());
  std::size_t same = 0;
  for (std::size_t i = 0; i < x.size(); ++i) same += other[i] == first[i];
  EXPECT_LT(same, x.size());  // another seed, other bits
}

// --- compact storage inside a step ------------------------------------------------------------

// One tensor whose parameter and state may be compact.
struct CompactHost {
  std::vector<float> param;
  std::vector<std::uint16_t> param16;
  StateFormat format = StateFormat::float32;
  std::vector<float> state[2];
  std::vector<std::uint16_t> state16[2];
  std::vector<std::uint8_t> codes[2];
  std::vector<float> absmax[2];
  float step = 0.0f;

  CompactHost(const std::vector<float>& p, bool bf16_param, StateFormat f) : format(f) {
    if (bf16_param) {
      param16.resize(p.size());
      for (std::size_t i = 0; i < p.size(); ++i) param16[i] = std::uint16_t(to_bits(p[i]) >> 16);
    } else {
      param = p;
    }
    for (int k = 0; k < 2; ++k) {
      state[k].assign(p.size(), 0.0f);
      state16[k].assign(p.size(), 0);
      codes[k].assign(p.size(), 0);
      absmax[k].assign(roundpipe::quant_blocks(p.size()), 0.0f);
    }
  }
  std::size_t size() const { return std::max(param.size(), param16.size()); }

  roundpipe::ParamBuffers view(const std::vector<float>& grad, std::uint64_t seed) {
    roundpipe::ParamBuffers t;
    t.numel = size();
    t.grad = grad.data();
    if (param16.empty()) t.param = param.data(); else t.param_bf16 = param16.data();
    for (int k = 0; k < 2; ++k) {
      t.state_format[k] = format;
      if (format == StateFormat::float32) t.state[k] = state[k].data();
      if (format == StateFormat::bfloat16) t.packed_state[k] = state16[k].data();
      if (format == StateFormat::int8) {
        t.packed_state[k] = codes[k].data();
        t.state_absmax[k] = absmax[k].data();
      }
    }
    t.scalar[0] = &step;
    t.rounding_seed = seed;
    return t;
  }

  // the stored values, as the step reads them (int8: slot 0 signed, slot 1 unsigned)
  double p(std::size_t i) const {
    return param16.empty() ? param[i] : from_bits(std::uint32_t(param16[i]) << 16);
  }
  double s(int k, std::size_t i) const {
    switch (format) {
      case StateFormat::bfloat16: return from_bits(std::uint32_t(state16[k][i]) << 16);
      case StateFormat::int8: {
        static const std::vector<float> maps[2] = {reference_map(false), reference_map(true)};
        return float(maps[k == 0][codes[k][i]] * absmax[k][i / 256]);
      }
      default: return state[k][i];
    }
  }
};

// One Adam step in float64 from the stored values (lr 1e-2, betas 0.75 / 0.9921875, eps 1e-6,
// decoupled weight decay 0.125: coefficients exact in float32).
roundpipe::AdamOptions adam_options() {
  roundpipe::AdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.75;
  o.beta2 = 0.9921875;
  o.eps = 1e-6;
  o.weight_decay = 0.125;
  o.decoupled_weight_decay = true;
  return o;
}

struct Expected {
  std::vector<double> p, m, v;
};
Expected adam_reference(const CompactHost& h, const std::vector<float>& g, double step) {
  const roundpipe::AdamOptions o = adam_options();
  const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
  Expected e;
  for (std::size_t i = 0; i < h.size(); ++i) {
    const double p = h.p(i) * (1 - o.lr * o.weight_decay);
    const double m = o.beta1 * h.s(0, i) + (1 - o.beta1) * g[i];
    const double v = o.beta2 * h.s(1, i) + (1 - o.beta2) * double(g[i]) * g[i];
    e.p.push_back(p - o.lr * (m / bc1) / (std::sqrt(v / bc2) + o.eps));
    e.m.push_back(m);
    e.v.push_back(v);
  }
  return e;
}

// |got - want| within one bfloat16 step of want (and float32 noise).
void expect_within_bf16_step(double got, double want, const char* what, std::size_t i,
                             int& reported) {
  const double step = std::ldexp(1.0, std::ilogb(std::fabs(want) + 1e-38) - 7);
  if (!(std::fabs(got - want) <= step * (1 + 1e-4) + 1e-6 * std::fabs(want) + 1e-37) &&
      reported++ < 5)
    ADD_FAILURE() << what << "[" << i << "] = " << got << ", want " << want;
}

// The int8 codes of `want` (float64) against the stored ones: equal, except where the reference's
// y lies within 1e-5 of a code boundary (float32 and float64 arithmetic may fall either side),
// where they may differ by one; absmax to float32 rounding.
void expect_int8_state(const CompactHost& h, int k, const std::vector<double>& want) {
  static const std::vector<float> bounds[2] = {reference_bounds(reference_map(false)),
                                               reference_bounds(reference_map(true))};
  const std::vector<float>& bound = bounds[k == 0];
  int reported = 0;
  for (std::size_t b = 0; b < h.absmax[k].size(); ++b) {
    double a = 0.0;
    for (std::size_t i = b * 256; i < std::min(h.size(), b * 256 + 256); ++i)
      a = std::max(a, std::fabs(want[i]));
    EXPECT_NEAR(h.absmax[k][b], a, 2e-6 * a) << "slot " << k << " block " << b;
    for (std::size_t i = b * 256; i < std::min(h.size(), b * 256 + 256); ++i) {
      const double y = a > 0 ? want[i] / a : 0.0;
      const int code = nearest_code(bound, y);
      const int got = h.codes[k][i];
      const bool near_bound = std::fabs(y - bound[code]) < 1e-5 * std::fabs(y) + 1e-12 ||
                              std::fabs(y - bound[code + 1]) < 1e-5 * std::fabs(y) + 1e-12;
      if (got != code && !(near_bound && std::abs(got - code) == 1) && reported++ < 5)
        ADD_FAILURE() << "slot " << k << "[" << i << "]: code " << got << ", want " << code
                      << " (y " << y << ")";
    }
  }
}

// Five Adam steps on every ISA, each compared with a float64 step taken from the values stored
// before it: the parameter (float32: to float32 rounding; bfloat16: within a bfloat16 step, as
// stochastic rounding leaves it), bfloat16 state within a step, int8 state the nearest codes.
TEST(CompactAdam, StepsMatchFloat64ReferenceOfTheQuantisedAlgorithm) {
  for (StateFormat format : {StateFormat::float32, StateFormat::bfloat16, StateFormat::int8})
    for (bool bf16_param : {false, true}) {
      if (format == StateFormat::float32 && !bf16_param) continue;  // test_adam.cpp
      SCOPED_TRACE("format " + std::to_string(int(format)) + (bf16_param ? " bf16 param" : ""));
      rptest::for_each_isa([&](roundpipe::Isa) {
        for (std::size_t n : {std::size_t{17}, std::size_t{300}, rptest::scaled(40000, 3000)}) {
          std::mt19937 rng(21 + unsigned(n));
          CompactHost h(rptest::randn(n, rng), bf16_param, format);
          const roundpipe::AdamOptions o = adam_options();
          for (int s = 0; s < 5; ++s) {
            const std::vector<float> g = rptest::randn(n, rng, s % 2 ? 1e-3f : 3.0f);
            const Expected e = adam_reference(h, g, s + 1);
            const roundpipe::ParamBuffers t = h.view(g, 99);
            roundpipe::adam_step(o, &t, 1);
            int reported = 0;
            for (std::size_t i = 0; i < n; ++i) {
              if (bf16_param)
                expect_within_bf16_step(h.p(i), e.p[i], "param", i, reported);
              else if (!(std::fabs(h.p(i) - e.p[i]) <= 1e-5 * std::fabs(e.p[i]) + 1e-6) &&
                       reported++ < 5)
                ADD_FAILURE() << "param[" << i << "] = " << h.p(i) << ", want " << e.p[i];
              if (format == StateFormat::bfloat16) {
                expect_within_bf16_step(h.s(0, i), e.m[i], "exp_avg", i, reported);
                expect_within_bf16_step(h.s(1, i), e.v[i], "exp_avg_sq", i, reported);
              }
            }
            if (format == StateFormat::int8) {
              expect_int8_state(h, 0, e.m);
              expect_int8_state(h, 1, e.v);
            }
            EXPECT_EQ(h.step, float(s + 1));
          }
        }
      });
    }
}

// Work split (one call over many tensors or separate calls, 1 to 3 threads) changes nothing:
// every stored bit is the same, on every ISA. Natively the first tensor alone has the elements
// for 3 threads (rptest::kElementsPerThread); emulated (quick) the call runs on one thread:
// 2 threads' elements took 50 s under qemu, and the work split is the same code on every ISA,
// each of which the native run covers where the CPU has it.
TEST(CompactAdam, ResultsDependOnNothingButTheInputsAndSeeds) {
  const roundpipe::AdamOptions o = adam_options();
  const int threads = roundpipe::num_threads();
  const std::size_t large = rptest::scaled(3 * rptest::kElementsPerThread + 7, 7001);
  auto run = [&](int nthreads, bool together) {
    roundpipe::set_num_threads(nthreads);
    std::mt19937 rng(8);
    std::vector<CompactHost> hosts;
    for (std::size_t n : {large, std::size_t{5}, rptest::scaled(16384 + 300, 1639)})
      hosts.emplace_back(rptest::randn(n, rng), true,
                         hosts.size() == 1 ? StateFormat::bfloat16 : StateFormat::int8);
    for (int s = 0; s < 3; ++s) {
      std::vector<std::vector<float>> grads;
      std::vector<roundpipe::ParamBuffers> ts;
      for (auto& h : hosts) grads.push_back(rptest::randn(h.size(), rng));
      for (std::size_t j = 0; j < hosts.size(); ++j)
        ts.push_back(hosts[j].view(grads[j], roundpipe::rounding_seed(5, j)));
      if (together) {
        roundpipe::adam_step(o, ts.data(), ts.size());
      } else {
        for (auto& t : ts) roundpipe::adam_step(o, &t, 1);
      }
    }
    return hosts;
  };
  rptest::for_each_isa([&](roundpipe::Isa) {
    const std::vector<CompactHost> want = run(1, true);
    for (int nthreads : {1, 2, 3})
      for (bool together : {true, false}) {
        const std::vector<CompactHost> got = run(nthreads, together);
        for (std::size_t j = 0; j < got.size(); ++j) {
          EXPECT_EQ(got[j].param16, want[j].param16) << j;
          for (int k = 0; k < 2; ++k) {
            EXPECT_EQ(got[j].state16[k], want[j].state16[k]) << j;
            EXPECT_EQ(got[j].codes[k], want[j].codes[k]) << j;
            EXPECT_EQ(got[j].absmax[k], want[j].absmax[k]) << j;
          }
        }
      }
  });
  roundpipe::set_num_threads(threads);
}

// Updates 100 times smaller than half a bfloat16 step, which rounding to nearest would lose
// entirely, move stochastically rounded parameters by their expected amount (mean over 8192
// elements; the random walk's spread of the mean is ~0.02 step).
TEST(CompactSGD, TinyUpdatesMoveBf16ParametersByTheirExpectedAmount) {
  rptest::for_each_isa([&](roundpipe::Isa) {
    const std::size_t n = 8192;
    std::vector<std::uint16_t> p(n, 0x3f80);  // 1.0: a bfloat16 step of 2^-7
    const std::vector<float> g(n, 1.0f);
    roundpipe::SGDOptions o;
    o.lr = 0x1p-7 / 200;                        // a 200th of a step
    const int steps = rptest::quick() ? 200 : 1000;
    for (int s = 0; s < steps; ++s) {
      roundpipe::ParamBuffers t;
      t.numel = n;
      t.param_bf16 = p.data();
      t.grad = g.data();
      t.rounding_seed = roundpipe::rounding_seed(1, s);  // SGD has no step: a seed per step
      roundpipe::sgd_step(o, &t, 1);
    }
    double mean = 0.0;
    for (std::uint16_t h : p) mean += from_bits(std::uint32_t(h) << 16);
    mean /= n;
    const double expected = 1.0 - steps * o.lr;
    EXPECT_NEAR(mean, expected, 0.1 * 0x1p-7) << "moved " << 1.0 - mean << ", expected "
                                              << steps * o.lr;
    EXPECT_LT(mean, 1.0 - 0.5 * steps * o.lr);  // round to nearest would leave 1.0
  });
}

// The fused pass with compact storage: bfloat16 gradients in, model copy out; the model copy of
// a bfloat16 parameter is the parameter as stored.
TEST(CompactAdam, MixedPrecisionPassWritesTheStoredParameterToTheModelCopy) {
  rptest::for_each_isa([&](roundpipe::Isa) {
    std::mt19937 rng(4);
    const std::size_t n = rptest::scaled(20000, 2000);
    CompactHost h(rptest::randn(n, rng), true, StateFormat::int8);
    std::vector<std::uint16_t> g16(n), copy(n);
    for (auto& x : g16) x = std::uint16_t(to_bits(rptest::randn(1, rng)[0]) >> 16);
    const std::vector<float> unused;
    roundpipe::ParamBuffers t = h.view(unused, 3);
    t.grad = nullptr;
    t.grad16 = g16.data();
    t.model_copy = copy.data();
    roundpipe::StepIO io;
    io.grad_scale = 4.0;
    roundpipe::adam_step(adam_options(), &t, 1, &io);
    EXPECT_EQ(copy, h.param16);
  });
}

TEST(Compact, BadCompactBuffersAreNamed) {
  std::vector<float> p(4, 1.0f), g(4, 1.0f), ax(4);
  float step = 0.0f, eta = 1.0f, mu = 1.0f;
  std::uint8_t codes[4];
  float absmax[1];
  roundpipe::ParamBuffers t;
  t.numel = 4;
  t.param = p.data();
  t.grad = g.data();
  t.state_format[0] = StateFormat::int8;
  t.packed_state[0] = codes;
  t.state_absmax[0] = absmax;
  t.scalar[0] = &step;
  t.scalar[1] = &eta;
  t.scalar[2] = &mu;
  try {
    roundpipe::asgd_step(roundpipe::ASGDOptions{}, &t, 1);
    ADD_FAILURE() << "int8 ASGD state accepted";
  } catch (const roundpipe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not support"), std::string::npos) << e.what();
  }
  EXPECT_EQ(p, std::vector<float>(4, 1.0f));
  float sq[4] = {};
  t.state[1] = sq;
  t.state_absmax[0] = nullptr;
  try {
    roundpipe::adam_step(roundpipe::AdamOptions{}, &t, 1);
    ADD_FAILURE() << "no error";
  } catch (const roundpipe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensors[0].exp_avg absmax"), std::string::npos) << e.what();
  }
  EXPECT_EQ(p, std::vector<float>(4, 1.0f));
}

}  // namespace
