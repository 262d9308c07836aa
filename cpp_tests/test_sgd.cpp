// roundpipe::sgd_step against a float64 SGD written here from its definition (heavy-ball
// momentum with dampening, Sutskever et al.'s Nesterov form, with torch.optim.SGD's conventions
// for weight decay, maximize and the first momentum step), on every ISA, every valid flag
// combination and every tail size; the momentum-buffer flag; errors of the C++ API.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/sgd.hpp"
#include "support.hpp"

namespace {

using roundpipe::ParamBuffers;
using roundpipe::SGDOptions;

// Float64 SGD. Slots as roundpipe::SGDState: state[0] the momentum buffer, scalar[0] the flag
// saying it holds a value. The buffer starts as NaN: it holds no value before the first step,
// and the library must not read it then.
struct RefSGD {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  SGDOptions o;

  RefSGD(const std::vector<float>& p0, const SGDOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), NAN);
  }

  void update(const std::vector<float>& grad) {
    const bool first = scalar[0] == 0;
    auto& buf = state[0];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      if (o.momentum != 0) {
        buf[i] = first ? g : o.momentum * buf[i] + (1 - o.dampening) * g;
        g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
      }
      param[i] -= o.lr * g;
    }
    if (o.momentum != 0) scalar[0] = 1;
  }
};

const char* const kSlots[] = {"momentum_buffer"};

// Flag bits: 1 momentum, 2 dampening, 4 nesterov, 8 weight decay, 16 maximize. Coefficients
// exact in float32, so the reference sees the kernel's coefficients (see test_adam.cpp).
SGDOptions options(int flags) {
  SGDOptions o;
  o.lr = 1e-2;
  o.momentum = (flags & 1) ? 0.875 : 0.0;
  o.dampening = (flags & 2) ? 0.25 : 0.0;
  o.nesterov = flags & 4;
  o.weight_decay = (flags & 8) ? 0.125 : 0.0;
  o.maximize = flags & 16;
  return o;
}

bool valid(int flags) { return !(flags & 4) || ((flags & 1) && !(flags & 2)); }

std::string describe(int flags) {
  return std::string("momentum=") + ((flags & 1) ? "1" : "0") + " dampening=" +
         ((flags & 2) ? "1" : "0") + " nesterov=" + ((flags & 4) ? "1" : "0") +
         " weight_decay=" + ((flags & 8) ? "1" : "0") + " maximize=" + ((flags & 16) ? "1" : "0");
}

TEST(SGD, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 32; ++flags) {
        if (!valid(flags)) continue;
        if (n > 100000 && flags != 0 && flags != 1 + 4 + 8 + 16 && flags != 1 + 2 + 8) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        const SGDOptions o = options(flags);
        std::vector<int> slots, scalars;
        if (o.momentum != 0) slots = scalars = {0};
        rptest::compare_with_reference<RefSGD>(&roundpipe::sgd_step, o, n, 4, slots, scalars,
                                               kSlots);
      }
  });
}

TEST(SGD, FirstMomentumStepCopiesTheGradientAndSetsTheFlag) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const std::size_t n = 21;
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = 0.25f * float(i) - 2.0f;
    rptest::Host h;
    h.param.assign(n, 1.0f);
    h.state[0].assign(n, NAN);  // no value yet: must be ignored
    SGDOptions o = options(1 | 2 | 8);
    const ParamBuffers t = h.view(g);
    roundpipe::sgd_step(o, &t, 1);
    EXPECT_EQ(h.scalar[0], 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      const float decayed = std::fma(1.0f, 0.125f, g[i]);  // g + wd * p, p = 1
      EXPECT_EQ(h.state[0][i], decayed) << i;                // dampening not applied yet
      EXPECT_EQ(h.param[i], std::fma(decayed, -0.01f, 1.0f)) << i;
    }
  });
}

TEST(SGD, WithoutMomentumNoBufferOrFlagIsNeeded) {
  std::vector<float> g(5, 2.0f), p(5, 1.0f);
  ParamBuffers t;
  t.param = p.data();
  t.grad = g.data();
  t.numel = 5;
  SGDOptions o;
  o.lr = 0.5;
  roundpipe::sgd_step(o, &t, 1);
  EXPECT_EQ(p, std::vector<float>(5, 0.0f));
}

TEST(SGD, ReadyBuffersMayShareOneFlag) {
  // The flag is written only when it turns 0 -> 1, so one flag at 1 may serve every ready
  // buffer (roundpipe.optim.SGD does this); the results equal separate flags.
  std::mt19937 rng(5);
  const SGDOptions o = options(1 | 2);
  std::vector<rptest::Host> shared(3), apart(3);
  std::vector<std::vector<float>> grads;
  for (std::size_t i = 0; i < 3; ++i) {
    shared[i].param = apart[i].param = rptest::randn(40 + i, rng);
    shared[i].state[0] = apart[i].state[0] = rptest::randn(40 + i, rng);
    apart[i].scalar[0] = 1.0f;
    grads.push_back(rptest::randn(40 + i, rng));
  }
  float one = 1.0f;
  std::vector<ParamBuffers> ts;
  for (std::size_t i = 0; i < 3; ++i) {
    ts.push_back(shared[i].view(grads[i]));
    ts.back().scalar[0] = &one;
    const ParamBuffers t = apart[i].view(grads[i]);
    roundpipe::sgd_step(o, &t, 1);
  }
  roundpipe::sgd_step(o, ts.data(), ts.size());
  EXPECT_EQ(one, 1.0f);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(shared[i].param, apart[i].param) << i;
    EXPECT_EQ(shared[i].state[0], apart[i].state[0]) << i;
  }
}

TEST(SGD, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const SGDOptions o = options(1 | 4 | 8);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      rptest::Host h;
      h.param = rptest::randn(n, rng);
      h.state[0].assign(n, 0.0f);
      together.push_back(h);
      apart.push_back(h);
      grads.push_back(rptest::randn(n, rng));
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::sgd_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::sgd_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[0], apart[i].state[0]) << "tensor " << i;
    }
  });
}

TEST(SGD, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  rptest::Host h;
  h.param.assign(4, 1.0f);
  h.state[0].assign(4, 0.0f);
  ParamBuffers t = h.view(g);
  auto expect_error = [&](SGDOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::sgd_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(h.scalar[0], 0.0f);
    EXPECT_EQ(h.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(h.state[0], std::vector<float>(4, 0.0f));
  };
  SGDOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.momentum = NAN;
  expect_error(o, &t, 1, "momentum");
  o = {};
  o.weight_decay = -0.1;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  o.nesterov = true;
  expect_error(o, &t, 1, "nesterov requires momentum > 0 and dampening == 0");
  o.momentum = 0.9;
  o.dampening = 0.1;
  expect_error(o, &t, 1, "nesterov requires momentum > 0 and dampening == 0");
  o = {};
  o.momentum = 0.9;
  ParamBuffers ts[2] = {t, t};
  ts[1].state[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].momentum_buffer");
  ts[1] = t;
  ts[1].scalar[0] = nullptr;
  expect_error(o, ts, 2, "tensors[1].momentum_buffer_ready");
  ts[1] = t;
  ts[1].param = nullptr;
  expect_error(o, ts, 2, "tensors[1].param");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
