// roundpipe::adadelta_step against a float64 Adadelta written here from Zeiler's formulas (with
// torch.optim.Adadelta's conventions for lr, weight decay and maximize), on every ISA, every
// option combination and every tail size; plus several tensors per call, thread counts,
// non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/adadelta.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdadeltaOptions;

// Float64 Adadelta (Zeiler 2012, Algorithm 1; torch scales the delta by lr and adds the L2
// term to the gradient). Slots as roundpipe::AdadeltaState.
struct RefAdadelta {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  AdadeltaOptions o;

  RefAdadelta(const std::vector<float>& p0, const AdadeltaOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    state[1].assign(p0.size(), 0.0);
  }

  void update(const std::vector<float>& grad) {
    scalar[0] += 1;
    auto &sq = state[0], &acc = state[1];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      sq[i] = o.rho * sq[i] + (1 - o.rho) * g * g;
      const double delta = std::sqrt(acc[i] + o.eps) / std::sqrt(sq[i] + o.eps) * g;
      acc[i] = o.rho * acc[i] + (1 - o.rho) * delta * delta;
      param[i] -= o.lr * delta;
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const AdadeltaOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f});
}

const rptest::Algorithm<AdadeltaOptions> kAdadelta = {
    &roundpipe::adadelta_step, {"square_avg", "acc_delta"}, {"step"}, &Init};

// Bits 0-1: rho 0.875 / 0 / 1; bit 2: maximize; bit 3: weight decay. Coefficients are exact in
// float32 (see test_adam.cpp for why that matters to a float64 comparison).
AdadeltaOptions options(int flags) {
  AdadeltaOptions o;
  o.lr = 0.5;
  o.rho = (flags & 3) == 0 ? 0.875 : (flags & 3) == 1 ? 0.0 : 1.0;
  o.eps = std::ldexp(1.0, -20);
  o.maximize = flags & 4;
  o.weight_decay = (flags & 8) ? 0.125 : 0.0;
  return o;
}

TEST(Adadelta, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_case(16, {"rho=0", "rho=1", "maximize", "weight_decay=0.125"}, {0, 12},
                        [](std::size_t n, int flags) {
                          if ((flags & 3) == 3) return;
                          rptest::compare_with_reference<RefAdadelta>(kAdadelta, options(flags),
                                                                      n, 4, {0, 1}, {0});
                        });
}

TEST(Adadelta, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::expect_one_call_like_separate_calls(kAdadelta, options(8));
}

TEST(Adadelta, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kAdadelta, options(4 | 8));
}

TEST(Adadelta, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kAdadelta, options(4 | 8));
}

TEST(Adadelta, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kAdadelta, options(4 | 8));
}

TEST(Adadelta, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(kAdadelta, options(0), [](const rptest::Host& s) {
    EXPECT_EQ(s.scalar[0], 1.0f);
    EXPECT_TRUE(std::isnan(s.state[1][1]));
    EXPECT_TRUE(std::isinf(s.state[0][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));   // sqrt(eps) / inf * inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);       // 1.25e-41: a subnormal, kept (no flush to zero)
    EXPECT_GT(s.state[1][18], 0.0f);       // likewise (delta is ~1e-20)
  });
}

TEST(Adadelta, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<AdadeltaOptions> bad(kAdadelta);
  bad.expect_bad_values({{&AdadeltaOptions::lr, -1, "lr"},
                         {&AdadeltaOptions::rho, 1.5, "rho"},
                         {&AdadeltaOptions::rho, NAN, "rho"},
                         {&AdadeltaOptions::eps, -1e-8, "eps"},
                         {&AdadeltaOptions::weight_decay, -0.1, "weight_decay"}});
  bad.expect_null_buffers_named(AdadeltaOptions{});
}

}  // namespace
