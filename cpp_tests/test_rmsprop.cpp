// roundpipe::rmsprop_step against a float64 RMSprop written here from its definition (Hinton's
// RMSprop, Graves' centered variant, with torch.optim.RMSprop's conventions for eps, momentum,
// weight decay and maximize), on every ISA, every flag combination and every tail size; the
// negative centered variance; several tensors per call, thread counts, non-finite inputs and
// argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/rmsprop.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::ParamBuffers;
using roundpipe::RMSpropOptions;

// Float64 RMSprop. Slots as roundpipe::RMSpropState (all start as zeros).
struct RefRMSprop {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  RMSpropOptions o;

  RefRMSprop(const std::vector<float>& p0, const RMSpropOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    for (auto& s : state) s.assign(p0.size(), 0.0);
  }

  void update(const std::vector<float>& grad) {
    ++scalar[0];
    auto &sq = state[0], &buf = state[1], &gavg = state[2];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      sq[i] = o.alpha * sq[i] + (1 - o.alpha) * g * g;
      double var = sq[i];
      if (o.centered) {
        gavg[i] = o.alpha * gavg[i] + (1 - o.alpha) * g;
        var -= gavg[i] * gavg[i];
      }
      const double avg = std::sqrt(var) + o.eps;
      if (o.momentum > 0) {
        buf[i] = o.momentum * buf[i] + g / avg;
        param[i] -= o.lr * buf[i];
      } else {
        param[i] -= o.lr * g / avg;
      }
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const RMSpropOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f, 0.0f});
}

const rptest::Algorithm<RMSpropOptions> kRMSprop = {
    &roundpipe::rmsprop_step, {"square_avg", "momentum_buffer", "grad_avg"}, {"step"}, &Init};

// Flag bits: 1 centered, 2 momentum, 4 weight decay, 8 maximize, 16 alpha >= 0.5 (lerp from
// the end: 1 - alpha = 0.125) instead of alpha = 0.25 (1 - alpha = 0.75 > 0.5: lerp from the
// start). Coefficients exact in float32.
RMSpropOptions options(int flags) {
  RMSpropOptions o;
  o.lr = 1e-2;
  o.alpha = (flags & 16) ? 0.875 : 0.25;
  o.eps = 1e-6;
  o.centered = flags & 1;
  o.momentum = (flags & 2) ? 0.75 : 0.0;
  o.weight_decay = (flags & 4) ? 0.125 : 0.0;
  o.maximize = flags & 8;
  return o;
}

TEST(RMSprop, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(
      32, {"centered", "momentum=0.75", "weight_decay=0.125", "maximize", "alpha=0.875"},
      {16, 31, 1 + 2 + 16}, [](std::size_t n, int flags) {
        const RMSpropOptions o = options(flags);
        std::vector<int> slots = {0};
        if (o.momentum > 0) slots.push_back(1);
        if (o.centered) slots.push_back(2);
        rptest::compare_with_reference<RefRMSprop>(kRMSprop, o, n, 4, slots, {0});
      });
}

TEST(RMSprop, NegativeCenteredVarianceGivesNaNAsTorch) {
  // square_avg - grad_avg^2 < 0 (here from a state loaded as is; in training from rounding):
  // torch takes its square root unclamped, so the parameter becomes NaN; so does ours.
  rptest::for_each_isa([](roundpipe::Isa) {
    RMSpropOptions o = options(1 | 16);
    const std::size_t n = 19;
    auto h = rptest::make_host(std::vector<float>(n, 1.0f), {0.0f, 0.0f, 1.0f});
    std::vector<float> g(n, 0.0f);
    g[3] = 2.0f;  // variance 0.125 * 4 - (0.875 + 0.25)^2 < 0 as well
    const ParamBuffers t = h.view(g);
    roundpipe::rmsprop_step(o, &t, 1);
    for (std::size_t i = 0; i < n; ++i) EXPECT_TRUE(std::isnan(h.param[i])) << i;
    EXPECT_EQ(h.state[2][0], 0.875f);
  });
}

TEST(RMSprop, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::expect_one_call_like_separate_calls(kRMSprop, options(1 | 2 | 4 | 16));
}

TEST(RMSprop, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kRMSprop, options(31));
}

TEST(RMSprop, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kRMSprop, options(31));
}

TEST(RMSprop, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kRMSprop, options(31));
}

TEST(RMSprop, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(
      kRMSprop, options(1 | 2 | 16), [](const rptest::Host& s) {
        EXPECT_TRUE(std::isnan(s.state[0][1]));
        EXPECT_TRUE(std::isnan(s.state[1][17]));
        EXPECT_TRUE(std::isnan(s.state[2][17]));
        EXPECT_TRUE(std::isinf(s.state[0][3]));
        EXPECT_TRUE(std::isnan(s.param[3]));   // inf - inf under the square root, as in torch
        EXPECT_GT(s.state[0][18], 0.0f);       // 1.25e-41: a subnormal, kept (no flush to zero)
      });
}

TEST(RMSprop, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<RMSpropOptions> bad(kRMSprop);
  bad.expect_bad_values({{&RMSpropOptions::lr, -1, "lr"},
                         {&RMSpropOptions::alpha, -0.1, "alpha"},
                         {&RMSpropOptions::eps, NAN, "eps"},
                         {&RMSpropOptions::weight_decay, -1, "weight_decay"},
                         {&RMSpropOptions::momentum, -0.5, "momentum"}});
  RMSpropOptions o;
  o.momentum = 0.5;   // momentum_buffer required
  o.centered = true;  // grad_avg required
  bad.expect_null_buffers_named(o);
}

}  // namespace
