// roundpipe::adam_step against a float64 Adam written here from the paper's formulas (with
// torch.optim.Adam's conventions for weight decay, maximize and AMSGrad), on every ISA, every
// flag combination and every tail size.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/adam.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdamOptions;

// Float64 Adam from the paper's formulas (torch's conventions for weight decay, maximize and
// AMSGrad). Slots as roundpipe::AdamState.
struct RefAdam {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  AdamOptions o;

  RefAdam(const std::vector<float>& p0, const AdamOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    for (auto& s : state) s.assign(p0.size(), 0.0);
  }

  void update(const std::vector<float>& grad) {
    const double step = ++scalar[0];
    const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
    auto &m = state[0], &v = state[1], &vmax = state[2];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      if (o.decoupled_weight_decay)
        param[i] *= 1 - o.lr * o.weight_decay;
      else
        g += o.weight_decay * param[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      const double vhat = (o.amsgrad ? vmax[i] : v[i]) / bc2;
      param[i] -= o.lr * (m[i] / bc1) / (std::sqrt(vhat) + o.eps);
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const AdamOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f, 0.0f});
}

const rptest::Algorithm<AdamOptions> kAdam = {
    &roundpipe::adam_step, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, {"step"}, &Init};

// Flag bits: 1 amsgrad, 2 maximize, 4 weight decay, 8 decoupled weight decay.
// The coefficients that multiply tensors are exact in float32 (powers of two and their
// complements), so the float64 reference sees the same coefficients the float32 kernel uses:
// with 0.1 instead of 0.125, rounding the coefficient alone moves g + wd * p by 1e-9, which is
// visible wherever that sum cancels to ~1e-7 (an ill-conditioned input, not a kernel error).
AdamOptions options(int flags) {
  AdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.75;
  o.beta2 = 0.9921875;
  o.eps = 1e-6;
  o.amsgrad = flags & 1;
  o.maximize = flags & 2;
  o.weight_decay = (flags & 4) ? 0.125 : 0.0;
  o.decoupled_weight_decay = flags & 8;
  return o;
}

TEST(Adam, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(16, {"amsgrad", "maximize", "weight_decay=0.125", "decoupled"},
                        {0, 15, 5}, [](std::size_t n, int flags) {
                          const AdamOptions o = options(flags);
                          std::vector<int> slots = {0, 1};
                          if (o.amsgrad) slots.push_back(2);
                          rptest::compare_with_reference<RefAdam>(kAdam, o, n, 4, slots, {0});
                        });
}

TEST(Adam, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::expect_one_call_like_separate_calls(kAdam, options(1 | 4));
}

TEST(Adam, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kAdam, options(15));
}

TEST(Adam, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kAdam, options(15));
}

TEST(Adam, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kAdam, options(15));
}

TEST(Adam, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(kAdam, options(1), [](const rptest::Host& s) {
    EXPECT_TRUE(std::isnan(s.state[2][1]));    // AMSGrad's max keeps the NaN, as torch.maximum
    EXPECT_TRUE(std::isnan(s.state[2][17]));
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));       // inf / inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);
    EXPECT_GT(s.state[1][18], 0.0f);           // 7.8e-43: a subnormal, kept (no flush to zero)
  });
}

TEST(Adam, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<AdamOptions> bad(kAdam);
  bad.expect_bad_values({{&AdamOptions::lr, -1, "lr"},
                         {&AdamOptions::beta1, 1.0, "beta1"},
                         {&AdamOptions::beta2, NAN, "beta2"},
                         {&AdamOptions::eps, -1e-8, "eps"},
                         {&AdamOptions::weight_decay, -0.1, "weight_decay"}});
  AdamOptions o;
  o.amsgrad = true;  // max_exp_avg_sq required
  bad.expect_null_buffers_named(o);
}

}  // namespace
