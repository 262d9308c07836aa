// roundpipe::adagrad_step against a float64 Adagrad written here from its definition (Duchi et
// al., with torch.optim.Adagrad's learning-rate decay, weight decay and maximize), on every ISA,
// every flag combination and every tail size; errors of the C++ API.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/adagrad.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdagradOptions;
using roundpipe::ParamBuffers;

// Float64 Adagrad. Slots as roundpipe::AdagradState; `sum` starts at the initial accumulator
// value, which is the caller's business (not an option of the step).
struct RefAdagrad {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  AdagradOptions o;
  static inline double initial_accumulator_value = 0.0;

  RefAdagrad(const std::vector<float>& p0, const AdagradOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), initial_accumulator_value);
  }

  void update(const std::vector<float>& grad) {
    const double step = ++scalar[0];
    const double clr = o.lr / (1 + (step - 1) * o.lr_decay);
    auto& sum = state[0];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      sum[i] += g * g;
      param[i] -= clr * g / (std::sqrt(sum[i]) + o.eps);
    }
  }
};

const char* const kSlots[] = {"sum"};

// Flag bits: 1 maximize, 2 weight decay, 4 lr_decay, 8 initial accumulator value 0.5.
AdagradOptions options(int flags) {
  AdagradOptions o;
  o.lr = 1e-2;
  o.maximize = flags & 1;
  o.weight_decay = (flags & 2) ? 0.125 : 0.0;
  o.lr_decay = (flags & 4) ? 0.5 : 0.0;
  RefAdagrad::initial_accumulator_value = (flags & 8) ? 0.5 : 0.0;
  return o;
}

std::string describe(int flags) {
  return std::string("maximize=") + ((flags & 1) ? "1" : "0") + " weight_decay=" +
         ((flags & 2) ? "1" : "0") + " lr_decay=" + ((flags & 4) ? "1" : "0") +
         " initial_accumulator_value=" + ((flags & 8) ? "0.5" : "0");
}

TEST(Adagrad, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 16; ++flags) {
        if (n > 100000 && flags != 0 && flags != 15) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        const AdagradOptions o = options(flags);
        rptest::compare_with_reference<RefAdagrad>(&roundpipe::adagrad_step, o, n, 4, {0}, {0},
                                                   kSlots);
      }
  });
}

TEST(Adagrad, LearningRateDecaysWithTheStepCount) {
  // After k steps, clr = lr / (1 + (k - 1) * lr_decay): with zero gradients and weight decay 1
  // the sum stays exact, so each step's size can be read off.
  rptest::for_each_isa([](roundpipe::Isa) {
    AdagradOptions o;
    o.lr = 0.5;
    o.lr_decay = 1.0;
    o.eps = 0.0;
    o.weight_decay = 0.0;
    rptest::Host h;
    h.param.assign(3, 0.0f);
    h.state[0].assign(3, 0.0f);
    h.scalar[0] = 9.0f;  // resumed after 9 steps: this one is step 10
    const std::vector<float> g(3, 1.0f);
    const ParamBuffers t = h.view(g);
    roundpipe::adagrad_step(o, &t, 1);
    EXPECT_EQ(h.scalar[0], 10.0f);
    EXPECT_EQ(h.state[0], std::vector<float>(3, 1.0f));
    EXPECT_EQ(h.param, std::vector<float>(3, -0.05f));  // -(0.5 / 10) * 1 / 1
  });
}

TEST(Adagrad, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const AdagradOptions o = options(2 | 4);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      rptest::Host h;
      h.param = rptest::randn(n, rng);
      h.state[0].assign(n, 0.25f);
      together.push_back(h);
      apart.push_back(h);
      grads.push_back(rptest::randn(n, rng));
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::adagrad_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::adagrad_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[0], apart[i].state[0]) << "tensor " << i;
    }
  });
}

TEST(Adagrad, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  rptest::Host h;
  h.param.assign(4, 1.0f);
  h.state[0].assign(4, 0.0f);
  ParamBuffers t = h.view(g);
  auto expect_error = [&](AdagradOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::adagrad_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(h.scalar[0], 0.0f);
    EXPECT_EQ(h.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(h.state[0], std::vector<float>(4, 0.0f));
  };
  AdagradOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.lr_decay = -0.5;
  expect_error(o, &t, 1, "lr_decay");
  o = {};
  o.weight_decay = NAN;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  o.eps = -1e-10;
  expect_error(o, &t, 1, "eps");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].state[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].sum");
  ts[1] = t;
  ts[1].scalar[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
