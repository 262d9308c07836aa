// roundpipe::adamax_step against a float64 Adamax written here from the paper's formulas (with
// torch.optim.Adamax's conventions: eps inside the maximum, L2 weight decay, maximize), on every
// ISA, every option combination and every tail size; plus non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/adamax.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdamaxOptions;
using roundpipe::AdamaxState;
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

const char* const kSlots[] = {"exp_avg", "exp_inf", ""};

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

std::string describe(int flags) {
  const AdamaxOptions o = options(flags);
  return "beta1=" + std::to_string(o.beta1) + " maximize=" + std::to_string(o.maximize) +
         " weight_decay=" + std::to_string(o.weight_decay);
}

TEST(Adamax, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 8; ++flags) {
        if (n > 100000 && flags != 0 && flags != 7) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        rptest::compare_with_reference<RefAdamax>(&roundpipe::adamax_step, options(flags), n, 4,
                                                  {0, 1}, {0}, kSlots);
      }
  });
}

TEST(Adamax, EpsIsInsideTheMaximum) {
  // Zero gradients from zero state: exp_inf = max(beta2 * exp_inf, |0| + eps) stays eps at every
  // step (eps added after the maximum would give eps, then beta2 * eps + eps, ...), and the
  // parameter does not move (exp_avg stays 0).
  rptest::for_each_isa([](roundpipe::Isa) {
    std::vector<float> g(21, 0.0f);
    rptest::Host s;
    s.param.assign(21, 1.0f);
    s.state[0].assign(21, 0.0f);
    s.state[1].assign(21, 0.0f);
    AdamaxOptions o;
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

TEST(Adamax, NonFiniteValuesPropagate) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const std::size_t n = 19;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> g(n, 0.5f);
    g[1] = nan;
    g[17] = nan;
    g[3] = inf;
    g[18] = 1e-20f;
    rptest::Host s;
    s.param.assign(n, 1.0f);
    s.state[0].assign(n, 0.0f);
    s.state[1].assign(n, 0.0f);
    s.state[1][5] = nan;                  // a NaN already in exp_inf survives the maximum
    const ParamBuffers t = s.view(g);
    roundpipe::adamax_step(options(0), &t, 1);
    EXPECT_EQ(s.scalar[0], 1.0f);
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_TRUE(std::isnan(s.state[1][1]));  // torch.maximum keeps the NaN of |g| + eps
    EXPECT_TRUE(std::isnan(s.state[1][5]));
    EXPECT_TRUE(std::isnan(s.param[5]));
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));     // inf / inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);         // 2.5e-21, kept
    EXPECT_EQ(s.param[0], s.param[16]);      // a tail element equals a vector-body element
    EXPECT_EQ(s.state[1][0], s.state[1][16]);
  });
}

TEST(Adamax, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  rptest::Host s;
  s.param.assign(4, 1.0f);
  s.state[0].assign(4, 0.0f);
  s.state[1].assign(4, 0.0f);
  ParamBuffers t = s.view(g);
  auto expect_error = [&](AdamaxOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::adamax_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(s.state[1], std::vector<float>(4, 0.0f));
  };
  AdamaxOptions o;
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
  ParamBuffers ts[2] = {t, t};
  ts[1].param = nullptr;
  expect_error(o, ts, 2, "tensors[1].param");
  ts[1] = t;
  ts[1].state[AdamaxState::exp_inf] = nullptr;
  expect_error(o, ts, 2, "tensors[1].exp_inf");
  ts[1] = t;
  ts[1].scalar[AdamaxState::step] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
