// roundpipe::nadam_step against a float64 NAdam written here from the algorithm's definition
// (Dozat 2016 with torch.optim.NAdam's momentum schedule and its conventions for weight decay
// and maximize), on every ISA, every flag combination and every tail size.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/nadam.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::NAdamOptions;
using roundpipe::NAdamState;
using roundpipe::ParamBuffers;

// Float64 NAdam:
//   mu_t = beta1 (1 - 0.5 * 0.96^(t psi)),  m_t = beta1 m + (1 - beta1) g,
//   v_t = beta2 v + (1 - beta2) g^2,
//   m_hat = mu_{t+1} m_t / (1 - prod_{i<=t+1} mu_i) + (1 - mu_t) g / (1 - prod_{i<=t} mu_i),
//   p -= lr m_hat / (sqrt(v_t / (1 - beta2^t)) + eps).
// Slots as roundpipe::NAdamState; scalar[1] is the product of the mu_i, starting at 1.
struct RefNAdam {
  std::vector<double> param, state[3];
  double scalar[3] = {0.0, 1.0, 0.0};
  NAdamOptions o;

  RefNAdam(const std::vector<float>& p0, const NAdamOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    state[1].assign(p0.size(), 0.0);
  }

  double mu(double t) const { return o.beta1 * (1 - 0.5 * std::pow(0.96, t * o.momentum_decay)); }

  void update(const std::vector<float>& grad) {
    const double t = ++scalar[0];
    const double mu_t = mu(t), mu_next = mu(t + 1);
    const double prod_t = scalar[1] *= mu_t;
    const double prod_next = prod_t * mu_next;
    const double bc2 = 1 - std::pow(o.beta2, t);
    auto &m = state[0], &v = state[1];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      if (o.decoupled_weight_decay)
        param[i] *= 1 - o.lr * o.weight_decay;
      else
        g += o.weight_decay * param[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      const double m_hat = mu_next * m[i] / (1 - prod_next) + (1 - mu_t) * g / (1 - prod_t);
      param[i] -= o.lr * m_hat / (std::sqrt(v[i] / bc2) + o.eps);
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const NAdamOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f}, {0.0f, 1.0f});  // mu_product starts at 1
}

const rptest::Algorithm<NAdamOptions> kNAdam = {
    &roundpipe::nadam_step, {"exp_avg", "exp_avg_sq"}, {"step", "mu_product"}, &Init};

// Flag bits: 1 maximize, 2 weight decay, 4 decoupled weight decay, 8 fast momentum schedule.
// Coefficients that multiply tensors are exact in float32 (see test_adam.cpp for why).
NAdamOptions options(int flags) {
  NAdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.75;
  o.beta2 = 0.9921875;
  o.eps = 1e-6;
  o.maximize = flags & 1;
  o.weight_decay = (flags & 2) ? 0.125 : 0.0;
  o.decoupled_weight_decay = flags & 4;
  o.momentum_decay = (flags & 8) ? 0.5 : 4e-3;
  return o;
}

TEST(NAdam, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(
      16, {"maximize", "weight_decay=0.125", "decoupled", "momentum_decay=0.5"}, {15, 6},
      [](std::size_t n, int flags) {
        rptest::compare_with_reference<RefNAdam>(kNAdam, options(flags), n, n > 100000 ? 4 : 6,
                                                 {0, 1}, {0, 1});
      });
}

TEST(NAdam, MuProductIsAFloat32RunningProduct) {
  // torch keeps mu_product as a 0-dim float32 tensor and multiplies it in place by mu_t rounded
  // to float32: the stored value is that float32 product, step after step.
  std::vector<float> g(3, 0.5f);
  const NAdamOptions o = options(8);
  auto s = Init(std::vector<float>(3, 1.0f), o);
  float expect = 1.0f;
  for (int t = 1; t <= 40; ++t) {
    const ParamBuffers b = s.view(g);
    roundpipe::nadam_step(o, &b, 1);
    expect *= static_cast<float>(o.beta1 * (1 - 0.5 * std::pow(0.96, t * o.momentum_decay)));
    ASSERT_EQ(s.scalar[NAdamState::mu_product], expect) << "step " << t;
    ASSERT_EQ(s.scalar[NAdamState::step], static_cast<float>(t));
  }
}

TEST(NAdam, OneCallUpdatesTensorsAtDifferentStepsLikeSeparateCalls) {
  // Each tensor's own step and mu_product drive its coefficients.
  rptest::expect_one_call_like_separate_calls(kNAdam, options(2 | 8));
}

TEST(NAdam, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kNAdam, options(15));
}

TEST(NAdam, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kNAdam, options(15));
}

TEST(NAdam, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kNAdam, options(15));
}

TEST(NAdam, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(kNAdam, options(0), [](const rptest::Host& s) {
    EXPECT_TRUE(std::isnan(s.state[0][17]));
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));          // inf / inf, as in torch
    EXPECT_GT(s.state[1][18], 0.0f);              // a subnormal, kept (no flush to zero)
  });
}

TEST(NAdam, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<NAdamOptions> bad(kNAdam);
  bad.expect_bad_values({{&NAdamOptions::lr, -1, "lr"},
                         {&NAdamOptions::beta1, 1.0, "beta1"},
                         {&NAdamOptions::beta2, NAN, "beta2"},
                         {&NAdamOptions::eps, -1e-8, "eps"},
                         {&NAdamOptions::weight_decay, -0.1, "weight_decay"},
                         {&NAdamOptions::momentum_decay, -4e-3, "momentum_decay"}});
  bad.expect_null_buffers_named(NAdamOptions{});
}

}  // namespace
