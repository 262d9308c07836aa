// roundpipe::radam_step against a float64 RAdam written here from the paper's formulas (Liu et
// al. 2020, with torch.optim.RAdam's conventions for eps, weight decay and maximize), on every
// ISA, every flag combination and every tail size, through both branches of the rectification.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/radam.hpp"
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

const char* const kSlots[] = {"exp_avg", "exp_avg_sq", "unused"};

rptest::Host State(const std::vector<float>& p) {
  rptest::Host h;
  h.param = p;
  h.state[0].assign(p.size(), 0.0f);
  h.state[1].assign(p.size(), 0.0f);
  return h;
}

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

std::string describe(int flags, double beta2) {
  return std::string("maximize=") + ((flags & 1) ? "1" : "0") + " weight_decay=" +
         ((flags & 2) ? "0.125" : "0") + " decoupled=" + ((flags & 4) ? "1" : "0") +
         " beta2=" + std::to_string(beta2);
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
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (double beta2 : kBeta2)
        for (int flags = 0; flags < 8; ++flags) {
          // The multi-million size: one combination, through step 7 (rectified from step 6).
          const bool big = n > 100000;
          if (big && (beta2 != kBeta2[0] || flags != 7)) continue;
          SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags, beta2));
          rptest::compare_with_reference<RefRAdam>(&roundpipe::radam_step, options(flags, beta2),
                                                   n, big ? 7 : 12, {0, 1}, {0}, kSlots);
        }
  });
}

TEST(RAdam, OneCallUpdatesTensorsAtDifferentStepsLikeSeparateCalls) {
  // Tensors on both sides of the rectification threshold in one call.
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const RAdamOptions o = options(2, kBeta2[0]);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    int k = 0;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      together.push_back(State(rptest::randn(n, rng)));
      together.back().scalar[RAdamState::step] = float(2 * k++);
      apart.push_back(together.back());
      grads.push_back(rptest::randn(n, rng));
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::radam_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::radam_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[1], apart[i].state[1]) << "tensor " << i;
    }
  });
}

TEST(RAdam, ThreadCountDoesNotChangeResults) {
  const int before = roundpipe::num_threads();
  std::mt19937 rng(3);
  const auto p0 = rptest::randn(200003, rng), g = rptest::randn(200003, rng);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    roundpipe::set_num_threads(threads);
    auto s = State(p0);
    for (int k = 0; k < 7; ++k) {
      const ParamBuffers t = s.view(g);
      roundpipe::radam_step(options(7, kBeta2[0]), &t, 1);
    }
    results.push_back(s.param);
  }
  roundpipe::set_num_threads(before);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(RAdam, NonFiniteValuesPropagate) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const float inf = INFINITY, nan = NAN;
    const std::size_t n = 19;
    std::vector<float> g(n, 0.5f);
    g[1] = nan;
    g[17] = nan;
    g[3] = inf;
    g[18] = 1e-20f;
    auto s = State(std::vector<float>(n, 1.0f));
    ParamBuffers t = s.view(g);
    roundpipe::radam_step(options(0, kBeta2[0]), &t, 1);  // step 1: not rectified
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_EQ(s.param[3], -inf);                 // p - lr * m_hat, m_hat = inf
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_GT(s.state[1][18], 0.0f);             // a subnormal, kept (no flush to zero)
    EXPECT_EQ(s.param[0], s.param[16]);          // a tail element equals a vector-body element
    g.assign(n, 0.5f);
    g[3] = inf;
    auto r = State(std::vector<float>(n, 1.0f));
    r.scalar[RAdamState::step] = 10.0f;           // step 11: rectified
    t = r.view(g);
    roundpipe::radam_step(options(0, kBeta2[0]), &t, 1);
    EXPECT_TRUE(std::isnan(r.param[3]));          // inf * (1 / inf) = inf * 0, as in torch
    EXPECT_TRUE(std::isfinite(r.param[0]));
    EXPECT_EQ(r.param[0], r.param[16]);
  });
}

TEST(RAdam, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  auto s = State(std::vector<float>(4, 1.0f));
  ParamBuffers t = s.view(g);
  auto expect_error = [&](RAdamOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::radam_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
  };
  RAdamOptions o;
  o.lr = NAN;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.beta1 = -0.1;
  expect_error(o, &t, 1, "beta1");
  o = {};
  o.beta2 = 1.0;
  expect_error(o, &t, 1, "beta2");
  o = {};
  o.eps = -1e-8;
  expect_error(o, &t, 1, "eps");
  o = {};
  o.weight_decay = -0.1;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].param = nullptr;
  expect_error(o, ts, 2, "tensors[1].param");
  ts[1] = t;
  ts[1].state[RAdamState::exp_avg] = nullptr;
  expect_error(o, ts, 2, "tensors[1].exp_avg");
  ts[1] = t;
  ts[1].scalar[RAdamState::step] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
