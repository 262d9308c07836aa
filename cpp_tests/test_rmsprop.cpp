// roundpipe::rmsprop_step against a float64 RMSprop written here from its definition (Hinton's
// RMSprop, Graves' centered variant, with torch.optim.RMSprop's conventions for eps, momentum,
// weight decay and maximize), on every ISA, every flag combination and every tail size; the
// negative centered variance; errors of the C++ API.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/rmsprop.hpp"
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

const char* const kSlots[] = {"square_avg", "momentum_buffer", "grad_avg"};

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

std::string describe(int flags) {
  return std::string("centered=") + ((flags & 1) ? "1" : "0") + " momentum=" +
         ((flags & 2) ? "1" : "0") + " weight_decay=" + ((flags & 4) ? "1" : "0") +
         " maximize=" + ((flags & 8) ? "1" : "0") + " alpha=" + ((flags & 16) ? "0.875" : "0.25");
}

TEST(RMSprop, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 32; ++flags) {
        if (n > 100000 && flags != 16 && flags != 31 && flags != 1 + 2 + 16) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        const RMSpropOptions o = options(flags);
        std::vector<int> slots = {0};
        if (o.momentum > 0) slots.push_back(1);
        if (o.centered) slots.push_back(2);
        rptest::compare_with_reference<RefRMSprop>(&roundpipe::rmsprop_step, o, n, 4, slots, {0},
                                                   kSlots);
      }
  });
}

TEST(RMSprop, NegativeCenteredVarianceGivesNaNAsTorch) {
  // square_avg - grad_avg^2 < 0 (here from a state loaded as is; in training from rounding):
  // torch takes its square root unclamped, so the parameter becomes NaN; so does ours.
  rptest::for_each_isa([](roundpipe::Isa) {
    RMSpropOptions o = options(1 | 16);
    const std::size_t n = 19;
    rptest::Host h;
    h.param.assign(n, 1.0f);
    h.state[0].assign(n, 0.0f);
    h.state[2].assign(n, 1.0f);
    std::vector<float> g(n, 0.0f);
    g[3] = 2.0f;  // variance 0.125 * 4 - (0.875 + 0.25)^2 < 0 as well
    const ParamBuffers t = h.view(g);
    roundpipe::rmsprop_step(o, &t, 1);
    for (std::size_t i = 0; i < n; ++i) EXPECT_TRUE(std::isnan(h.param[i])) << i;
    EXPECT_EQ(h.state[2][0], 0.875f);
  });
}

TEST(RMSprop, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const RMSpropOptions o = options(1 | 2 | 4 | 16);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      rptest::Host h;
      h.param = rptest::randn(n, rng);
      for (auto& s : h.state) s.assign(n, 0.0f);
      together.push_back(h);
      apart.push_back(h);
      grads.push_back(rptest::randn(n, rng));
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::rmsprop_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::rmsprop_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      for (int k = 0; k < 3; ++k) EXPECT_EQ(together[i].state[k], apart[i].state[k]) << i;
    }
  });
}

TEST(RMSprop, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  rptest::Host h;
  h.param.assign(4, 1.0f);
  for (auto& s : h.state) s.assign(4, 0.0f);
  ParamBuffers t = h.view(g);
  auto expect_error = [&](RMSpropOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::rmsprop_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(h.scalar[0], 0.0f);
    EXPECT_EQ(h.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(h.state[0], std::vector<float>(4, 0.0f));
  };
  RMSpropOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.alpha = -0.1;
  expect_error(o, &t, 1, "alpha");
  o = {};
  o.eps = NAN;
  expect_error(o, &t, 1, "eps");
  o = {};
  o.weight_decay = -1;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  o.momentum = -0.5;
  expect_error(o, &t, 1, "momentum");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].state[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].square_avg");
  ts[1] = t;
  ts[1].state[1] = nullptr;
  o.momentum = 0.5;
  expect_error(o, ts, 2, "tensors[1].momentum_buffer");
  o = {};
  ts[1] = t;
  ts[1].state[2] = nullptr;
  o.centered = true;
  expect_error(o, ts, 2, "tensors[1].grad_avg");
  o = {};
  ts[1] = t;
  ts[1].scalar[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
