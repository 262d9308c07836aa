// roundpipe::adam_step against a float64 Adam written here from the paper's formulas (with
// torch.optim.Adam's conventions for weight decay, maximize and AMSGrad), on every ISA, every
// flag combination and every tail size.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/adam.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdamOptions;
using roundpipe::ParamBuffers;

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

const char* const kSlots[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

rptest::Host State(const std::vector<float>& p) {
  rptest::Host h;
  h.param = p;
  for (auto& s : h.state) s.assign(p.size(), 0.0f);
  return h;
}

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

std::string describe(int flags) {
  return std::string("amsgrad=") + ((flags & 1) ? "1" : "0") + " maximize=" +
         ((flags & 2) ? "1" : "0") + " weight_decay=" + ((flags & 4) ? "0.125" : "0") +
         " decoupled=" + ((flags & 8) ? "1" : "0");
}

TEST(Adam, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 16; ++flags) {
        if (n > 100000 && flags != 0 && flags != 15 && flags != 5) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        const AdamOptions o = options(flags);
        std::vector<int> slots = {0, 1};
        if (o.amsgrad) slots.push_back(2);
        rptest::compare_with_reference<RefAdam>(&roundpipe::adam_step, o, n, 4, slots, {0}, kSlots);
      }
  });
}

TEST(Adam, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const AdamOptions o = options(1 | 4);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      auto p = rptest::randn(n, rng);
      together.push_back(State(p));
      apart.push_back(State(p));
      grads.push_back(rptest::randn(n, rng));
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::adam_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::adam_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[1], apart[i].state[1]) << "tensor " << i;
    }
  });
}

TEST(Adam, ThreadCountDoesNotChangeResults) {
  const int before = roundpipe::num_threads();
  std::mt19937 rng(3);
  const auto p0 = rptest::randn(200003, rng), g = rptest::randn(200003, rng);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    roundpipe::set_num_threads(threads);
    auto s = State(p0);
    for (int k = 0; k < 2; ++k) {
      const ParamBuffers t = s.view(g);
      roundpipe::adam_step(options(15), &t, 1);
    }
    results.push_back(s.param);
  }
  roundpipe::set_num_threads(before);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(Adam, NonFiniteValuesPropagate) {
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
    roundpipe::adam_step(options(1), &t, 1);
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_TRUE(std::isnan(s.state[2][1]));    // AMSGrad's max keeps the NaN, as torch.maximum
    EXPECT_TRUE(std::isnan(s.state[2][17]));
    EXPECT_TRUE(std::isinf(s.state[1][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));       // inf / inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);
    EXPECT_GT(s.state[1][18], 0.0f);              // 7.8e-43: a subnormal, kept (no flush to zero)
    EXPECT_EQ(s.param[0], s.param[16]);            // a tail element equals a vector-body element
  });
}

TEST(Adam, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  auto s = State(std::vector<float>(4, 1.0f));
  ParamBuffers t = s.view(g);
  auto expect_error = [&](AdamOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::adam_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
  };
  AdamOptions o;
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
  ts[1].grad = nullptr;
  expect_error(o, ts, 2, "tensors[1].grad");
  ts[1] = t;
  ts[1].state[2] = nullptr;
  o.amsgrad = true;
  expect_error(o, ts, 2, "tensors[1].max_exp_avg_sq");
  o = {};
  ts[1] = t;
  ts[1].scalar[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
