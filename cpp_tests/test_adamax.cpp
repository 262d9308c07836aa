// roundpipe::adamax_step against a float64 Adamax written here from the paper's formulas (with
// torch.optim.Adamax's conventions: eps inside the maximum, L2 weight decay, maximize), on every
// ISA, every option combination and every tail size; plus several tensors per call, thread counts,
// non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "roundpipe/adamax.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdamaxOptions;
using roundpipe::ParamBuffers;

// Float64 Adamax (Kingma & Ba 2015, Algorithm 2), with eps added to |g| inside the maximum as
// torch.optim.Adamax does. Slots as roundpipe::AdamaxState.
struct RefAdamax {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  AdamaxOptions o;

  RefAdamax(const std::vector<float>& p0, const AdamaxOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    state[1].assign(p0.size(), 0.0);
  }

  void update(const std::vector<float>& grad) {
    const double step = ++scalar[0];
    const double clr = o.lr / (1 - std::pow(o.beta1, step));
    auto &m = state[0], &u = state[1];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      u[i] = std::max(o.beta2 * u[i], std::fabs(g) + o.eps);
      param[i] -= clr * m[i] / u[i];
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const AdamaxOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f});
}

const rptest::Algorithm<AdamaxOptions> kAdamax = {
    &roundpipe::adamax_step, {"exp_avg", "exp_inf"}, {"step"}, &Init};

// Bit 0: beta1 0.75 (torch's lerp from the start) or 0.25 (lerp from the end); bit 1:
// maximize; bit 2: weight decay. Coefficients are exact in float32 (see test_adam.cpp).
AdamaxOptions options(int flags) {
  AdamaxOptions o;
  o.lr = 1e-2;
  o.beta1 = (flags & 1) ? 0.25 : 0.75;
  o.beta2 = 0.9921875;
  o.eps = std::ldexp(1.0, -20);
  o.maximize = flags & 2;
  o.weight_decay = (flags & 4) ? 0.125 : 0.0;
  return o;
}

TEST(Adamax, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_case(8, {"beta1=0.25", "maximize", "weight_decay=0.125"}, {0, 7},
                        [](std::size_t n, int flags) {
                          rptest::compare_with_reference<RefAdamax>(kAdamax, options(flags), n, 4,
                                                                    {0, 1}, {0});
                        });
}

TEST(Adamax, EpsIsInsideTheMaximum) {
  // Zero gradients from zero state: exp_inf = max(beta2 * exp_inf, |0| + eps) stays eps at every
  // step (eps added after the maximum would give eps, then beta2 * eps + eps, ...), and the
  // parameter does not move (exp_avg stays 0).
  rptest::for_each_isa([](roundpipe::Isa) {
    std::vector<float> g(21, 0.0f);
    AdamaxOptions o;
    auto s = Init(std::vector<float>(21, 1.0f), o);
    o.beta2 = 0.5;
    o.eps = 0.25;
    for (int k = 0; k < 3; ++k) {
      const ParamBuffers t = s.view(g);
      roundpipe::adamax_step(o, &t, 1);
      EXPECT_EQ(s.state[1], std::vector<float>(21, 0.25f)) << "step " << k + 1;
      EXPECT_EQ(s.param, std::vector<float>(21, 1.0f));
    }
  });
}

TEST(Adamax, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::expect_one_call_like_separate_calls(kAdamax, options(4));
}

TEST(Adamax, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kAdamax, options(7));
}

TEST(Adamax, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kAdamax, options(7));
}

TEST(Adamax, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kAdamax, options(7));
}

TEST(Adamax, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(
      kAdamax, options(0),
      [](rptest::Host& s) { s.state[1][5] = NAN; },  // a NaN already in exp_inf survives the max
      [](const rptest::Host& s) {
        EXPECT_EQ(s.scalar[0], 1.0f);
        EXPECT_TRUE(std::isnan(s.state[1][1]));  // torch.maximum keeps the NaN of |g| + eps
        EXPECT_TRUE(std::isnan(s.state[1][5]));
        EXPECT_TRUE(std::isnan(s.param[5]));
        EXPECT_TRUE(std::isinf(s.state[1][3]));
        EXPECT_TRUE(std::isnan(s.param[3]));     // inf / inf, as in torch
        EXPECT_GT(s.state[0][18], 0.0f);         // 2.5e-21, kept
      });
}

TEST(Adamax, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<AdamaxOptions> bad(kAdamax);
  bad.expect_bad_values({{&AdamaxOptions::lr, -1, "lr"},
                         {&AdamaxOptions::beta1, 1.0, "beta1"},
                         {&AdamaxOptions::beta2, NAN, "beta2"},
                         {&AdamaxOptions::eps, -1e-8, "eps"},
                         {&AdamaxOptions::weight_decay, -0.1, "weight_decay"}});
  bad.expect_null_buffers_named(AdamaxOptions{});
}

}  // namespace
