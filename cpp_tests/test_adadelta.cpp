// roundpipe::adadelta_step against a float64 Adadelta written here from Zeiler's formulas (with
// torch.optim.Adadelta's conventions for lr, weight decay and maximize), on every ISA, every
// option combination and every tail size; plus non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/adadelta.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdadeltaOptions;
using roundpipe::AdadeltaState;
using roundpipe::ParamBuffers;

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

const char* const kSlots[] = {"square_avg", "acc_delta", ""};

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

std::string describe(int flags) {
  const AdadeltaOptions o = options(flags);
  return "rho=" + std::to_string(o.rho) + " maximize=" + std::to_string(o.maximize) +
         " weight_decay=" + std::to_string(o.weight_decay);
}

TEST(Adadelta, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 16; ++flags) {
        if ((flags & 3) == 3) continue;
        if (n > 100000 && flags != 0 && flags != 12) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        rptest::compare_with_reference<RefAdadelta>(&roundpipe::adadelta_step, options(flags), n,
                                                    4, {0, 1}, {0}, kSlots);
      }
  });
}

TEST(Adadelta, NonFiniteValuesPropagate) {
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
    const ParamBuffers t = s.view(g);
    roundpipe::adadelta_step(options(0), &t, 1);
    EXPECT_EQ(s.scalar[0], 1.0f);
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_TRUE(std::isnan(s.state[1][1]));
    EXPECT_TRUE(std::isinf(s.state[0][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));   // sqrt(eps) / inf * inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);       // 1.25e-41: a subnormal, kept (no flush to zero)
    EXPECT_GT(s.state[1][18], 0.0f);       // likewise (delta is ~1e-20)
    EXPECT_EQ(s.param[0], s.param[16]);    // a tail element equals a vector-body element
    EXPECT_EQ(s.state[1][0], s.state[1][16]);
  });
}

TEST(Adadelta, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  rptest::Host s;
  s.param.assign(4, 1.0f);
  s.state[0].assign(4, 0.0f);
  s.state[1].assign(4, 0.0f);
  ParamBuffers t = s.view(g);
  auto expect_error = [&](AdadeltaOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::adadelta_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(s.state[0], std::vector<float>(4, 0.0f));
  };
  AdadeltaOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.rho = 1.5;
  expect_error(o, &t, 1, "rho");
  o = {};
  o.rho = NAN;
  expect_error(o, &t, 1, "rho");
  o = {};
  o.eps = -1e-8;
  expect_error(o, &t, 1, "eps");
  o = {};
  o.weight_decay = -0.1;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].grad = nullptr;
  expect_error(o, ts, 2, "tensors[1].grad");
  ts[1] = t;
  ts[1].state[AdadeltaState::acc_delta] = nullptr;
  expect_error(o, ts, 2, "tensors[1].acc_delta");
  ts[1] = t;
  ts[1].scalar[AdadeltaState::step] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
