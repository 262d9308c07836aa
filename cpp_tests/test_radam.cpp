// roundpipe::radam_step against a float64 RAdam written here from the paper's formulas (Liu et
// al. 2020, with torch.optim.RAdam's conventions for eps, weight decay and maximize), on every
// ISA, every flag combination and every tail size, through both branches of the rectification.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/radam.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

namespace {

using roundpipe::ParamBuffers;
using roundpipe::RAdamOptions;
using roundpipe::RAdamState;

// Float64 RAdam:
//   m_t = beta1 m + (1 - beta1) g,  v_t = beta2 v + (1 - beta2) g^2,  m_hat = m_t / (1 - beta1^t)
//   rho_inf = 2 / (1 - beta2) - 1,  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
//   rho_t > 5:  l_t = sqrt(1 - beta2^t) / (sqrt(v_t) + eps),
//               r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t)),
//               p -= lr m_hat l_t r_t
//   otherwise:  p -= lr m_hat
struct RefRAdam {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  RAdamOptions o;
  int rectified_steps = 0;

  RefRAdam(const std::vector<float>& p0, const RAdamOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    state[1].assign(p0.size(), 0.0);
  }

  void update(const std::vector<float>& grad) {
    const double t = ++scalar[0];
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    const double rho_inf = 2 / (1 - o.beta2) - 1;
    const double rho_t = rho_inf - 2 * t * std::pow(o.beta2, t) / bc2;
    const bool rectified = rho_t > 5;
    rectified_steps += rectified;
    const double r_t = rectified ? std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf /
                                             ((rho_inf - 4) * (rho_inf - 2) * rho_t))
                                 : 0.0;
    auto &m = state[0], &v = state[1];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      if (o.decoupled_weight_decay)
        param[i] *= 1 - o.lr * o.weight_decay;
      else
        g += o.weight_decay * param[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * g;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * g * g;
      const double m_hat = m[i] / bc1;
      if (rectified)
        param[i] -= o.lr * m_hat * std::sqrt(bc2) / (std::sqrt(v[i]) + o.eps) * r_t;
      else
        param[i] -= o.lr * m_hat;
    }
  }
};

rptest::Host Init(const std::vector<float>& p, const RAdamOptions&) {
  return rptest::make_host(p, {0.0f, 0.0f});
}

const rptest::Algorithm<RAdamOptions> kRAdam = {
    &roundpipe::radam_step, {"exp_avg", "exp_avg_sq"}, {"step"}, &Init};

// beta2 values and where the rectified branch starts: step 6, step 10 (rho_inf = 5.67, a small
// r_t), never (rho_inf = 3).
constexpr double kBeta2[] = {0.9921875, 0.7, 0.5};

// Flag bits: 1 maximize, 2 weight decay, 4 decoupled weight decay. Coefficients that multiply
// tensors are exact in float32 where possible (see test_adam.cpp for why).
RAdamOptions options(int flags, double beta2) {
  RAdamOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.75;
  o.beta2 = beta2;
  o.eps = 1e-6;
  o.maximize = flags & 1;
  o.weight_decay = (flags & 2) ? 0.125 : 0.0;
  o.decoupled_weight_decay = flags & 4;
  return o;
}

TEST(RAdam, ReferenceTakesBothBranches) {
  std::vector<float> p(1, 1.0f), g(1, 1.0f);
  int expect[] = {7, 3, 0};  // rectified steps among the 12 steps of the sweep below
  for (int k = 0; k < 3; ++k) {
    RefRAdam ref(p, options(0, kBeta2[k]));
    for (int s = 0; s < 12; ++s) ref.update(g);
    EXPECT_EQ(ref.rectified_steps, expect[k]) << "beta2=" << kBeta2[k];
  }
}

TEST(RAdam, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(8, {"maximize", "weight_decay=0.125", "decoupled"}, {7},
                        [](std::size_t n, int flags) {
                          for (double beta2 : kBeta2) {
                            // The multi-million size: one combination, through step 7
                            // (rectified from step 6).
                            const bool big = n > 100000;
                            if (big && beta2 != kBeta2[0]) continue;
                            SCOPED_TRACE("beta2=" + std::to_string(beta2));
                            rptest::compare_with_reference<RefRAdam>(
                                kRAdam, options(flags, beta2), n, big ? 7 : 12, {0, 1}, {0});
                          }
                        });
}

TEST(RAdam, OneCallUpdatesTensorsAtDifferentStepsLikeSeparateCalls) {
  // Tensors on both sides of the rectification threshold (step 6) in one call: tensor i takes
  // steps i + 1 to i + 4.
  rptest::expect_one_call_like_separate_calls(kRAdam, options(2, kBeta2[0]));
}

TEST(RAdam, ThreadCountDoesNotChangeResults) {
  // 7 steps: rectified from step 6.
  rptest::expect_thread_count_does_not_change_results(kRAdam, options(7, kBeta2[0]), 7);
}

TEST(RAdam, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kRAdam, options(7, kBeta2[0]), 7);
}

TEST(RAdam, MixedPrecisionPassEqualsItsComposition) {
  // 7 steps: through the rectified branch from step 6.
  rptest::expect_mixed_precision_like_composition(kRAdam, options(7, kBeta2[0]), 7);
}

TEST(RAdam, NonFiniteValuesPropagate) {
  // Step 1: not rectified.
  rptest::expect_non_finite_gradients_propagate(
      kRAdam, options(0, kBeta2[0]), [](const rptest::Host& s) {
        EXPECT_EQ(s.param[3], -INFINITY);            // p - lr * m_hat, m_hat = inf
        EXPECT_TRUE(std::isinf(s.state[1][3]));
        EXPECT_GT(s.state[1][18], 0.0f);             // a subnormal, kept (no flush to zero)
      });
  rptest::for_each_isa([](roundpipe::Isa) {
    std::vector<float> g(19, 0.5f);
    g[3] = INFINITY;
    auto r = Init(std::vector<float>(19, 1.0f), {});
    r.scalar[RAdamState::step] = 10.0f;           // step 11: rectified
    const ParamBuffers t = r.view(g);
    roundpipe::radam_step(options(0, kBeta2[0]), &t, 1);
    EXPECT_TRUE(std::isnan(r.param[3]));          // inf * (1 / inf) = inf * 0, as in torch
    EXPECT_TRUE(std::isfinite(r.param[0]));
    EXPECT_EQ(r.param[0], r.param[16]);
  });
}

TEST(RAdam, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<RAdamOptions> bad(kRAdam);
  bad.expect_bad_values({{&RAdamOptions::lr, NAN, "lr"},
                         {&RAdamOptions::beta1, -0.1, "beta1"},
                         {&RAdamOptions::beta2, 1.0, "beta2"},
                         {&RAdamOptions::eps, -1e-8, "eps"},
                         {&RAdamOptions::weight_decay, -0.1, "weight_decay"}});
  bad.expect_null_buffers_named(RAdamOptions{});
}

}  // namespace
