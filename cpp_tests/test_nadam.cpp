// roundpipe::nadam_step against a float64 NAdam written here from the algorithm's definition
// (Dozat 2016 with torch.optim.NAdam's momentum schedule and its conventions for weight decay
// and maximize), on every ISA, every flag combination and every tail size.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/nadam.hpp"
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

const char* const kSlots[] = {"exp_avg", "exp_avg_sq", "unused"};

rptest::Host State(const std::vector<float>& p) {
  rptest::Host h;
  h.param = p;
  h.state[0].assign(p.size(), 0.0f);
  h.state[1].assign(p.size(), 0.0f);
  h.scalar[NAdamState::mu_product] = 1.0f;
  return h;
}

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

std::string describe(int flags) {
  return std::string("maximize=") + ((flags & 1) ? "1" : "0") + " weight_decay=" +
         ((flags & 2) ? "0.125" : "0") + " decoupled=" + ((flags & 4) ? "1" : "0") +
         " momentum_decay=" + ((flags & 8) ? "0.5" : "4e-3");
}

TEST(NAdam, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 16; ++flags) {
        const bool big = n > 100000;
        if (big && flags != 15 && flags != 6) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        rptest::compare_with_reference<RefNAdam>(&roundpipe::nadam_step, options(flags), n,
                                                 big ? 4 : 6, {0, 1}, {0, 1}, kSlots);
      }
  });
}

TEST(NAdam, MuProductIsAFloat32RunningProduct) {
  // torch keeps mu_product as a 0-dim float32 tensor and multiplies it in place by mu_t rounded
  // to float32: the stored value is that float32 product, step after step.
  std::vector<float> g(3, 0.5f);
  auto s = State(std::vector<float>(3, 1.0f));
  const NAdamOptions o = options(8);
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
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const NAdamOptions o = options(2 | 8);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    int k = 0;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      auto p = rptest::randn(n, rng);
      together.push_back(State(p));
      together.back().scalar[NAdamState::step] = float(3 * k);
      together.back().scalar[NAdamState::mu_product] = 1.0f - 0.1f * k++;
      apart.push_back(together.back());
      grads.push_back(rptest::randn(n, rng));
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::nadam_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::nadam_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[0], apart[i].state[0]) << "tensor " << i;
      EXPECT_EQ(together[i].state[1], apart[i].state[1]) << "tensor " << i;
      EXPECT_EQ(together[i].scalar[1], apart[i].scalar[1]) << "tensor " << i;
    }
  });
}

TEST(NAdam, ThreadCountDoesNotChangeResults) {
  const int before = roundpipe::num_threads();
  std::mt19937 rng(3);
  const auto p0 = rptest::randn(200003, rng), g = rptest::randn(200003, rng);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    roundpipe::set_num_threads(threads);
    auto s = State(p0);
    for (int k = 0; k < 2; ++k) {
      const ParamBuffers t = s.view(g);
      roundpipe::nadam_step(options(15), &t, 1);
    }
    results.push_back(s.param);
  }
  roundpipe::set_num_threads(before);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(NAdam, NonFiniteValuesPropagate) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const float inf = INFINITY, nan = NAN;
    const std::size_t n = 19;
    std::vector<float> g(n, 0.5f);
    g[1] = nan;
    g[17] = nan;
    g[3] = inf;
    g[18] = 1e-20f;
    auto s = State(std::vector<float>(n, 1.0f));
    const ParamBuffers t = s.view(g);
    roundpipe::nadam_step(options(0), &t, 1);
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_TRUE(std::isnan(s.state[0][17]));
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));          // inf / inf, as in torch
    EXPECT_GT(s.state[1][18], 0.0f);              // a subnormal, kept (no flush to zero)
    EXPECT_EQ(s.param[0], s.param[16]);           // a tail element equals a vector-body element
  });
}

TEST(NAdam, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  auto s = State(std::vector<float>(4, 1.0f));
  ParamBuffers t = s.view(g);
  auto expect_error = [&](NAdamOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::nadam_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.scalar[1], 1.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
  };
  NAdamOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.beta1 = 1.0;
  expect_error(o, &t, 1, "beta1");
  o = {};
  o.beta2 = NAN;
  expect_error(o, &t, 1, "beta2");
  o = {};
  o.eps = -1e-8;
  expect_error(o, &t, 1, "eps");
  o = {};
  o.weight_decay = -0.1;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  o.momentum_decay = -4e-3;
  expect_error(o, &t, 1, "momentum_decay");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].grad = nullptr;
  expect_error(o, ts, 2, "tensors[1].grad");
  ts[1] = t;
  ts[1].state[NAdamState::exp_avg_sq] = nullptr;
  expect_error(o, ts, 2, "tensors[1].exp_avg_sq");
  ts[1] = t;
  ts[1].scalar[NAdamState::mu_product] = nullptr;
  expect_error(o, ts, 2, "tensors[1].mu_product");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
