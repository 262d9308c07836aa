// roundpipe::asgd_step against a float64 ASGD written here from torch.optim.ASGD's definition
// (Polyak-Juditsky averaging with Bottou's eta and mu schedules), on every ISA, every option
// combination and every tail size; plus per-tensor schedules, non-finite inputs and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/asgd.hpp"
#include "support.hpp"

namespace {

using roundpipe::AsgdOptions;
using roundpipe::AsgdState;
using roundpipe::ParamBuffers;

// Float64 ASGD as torch.optim.ASGD documents it: with the eta and mu of the previous step,
//   p <- p (1 - lambd eta) - eta g;   ax <- ax + mu (p - ax)   (ax <- p while mu == 1)
// then eta <- lr / (1 + lambd lr t)^alpha and mu <- 1 / max(1, t - t0). Slots as AsgdState.
struct RefAsgd {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  AsgdOptions o;

  RefAsgd(const std::vector<float>& p0, const AsgdOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    scalar[AsgdState::eta] = o.lr;
    scalar[AsgdState::mu] = 1.0;
  }

  void update(const std::vector<float>& grad) {
    const double t = ++scalar[AsgdState::step];
    const double eta = scalar[AsgdState::eta], mu = scalar[AsgdState::mu];
    auto& ax = state[0];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      param[i] = param[i] * (1 - o.lambd * eta) - eta * g;
      ax[i] = mu == 1.0 ? param[i] : ax[i] + mu * (param[i] - ax[i]);
    }
    scalar[AsgdState::eta] = o.lr / std::pow(1 + o.lambd * o.lr * t, o.alpha);
    scalar[AsgdState::mu] = 1 / std::max(1.0, t - o.t0);
  }
};

const char* const kSlots[] = {"ax", "", ""};

// Bit 0: t0 = 1 (averaging from step 3 on: mu = 1/2, 1/3, ...) or 1e6 (ax = p throughout);
// bit 1: maximize; bit 2: weight decay. lambd is large so the decay term matters.
AsgdOptions options(int flags) {
  AsgdOptions o;
  o.lr = 0.125;
  o.lambd = 0.5;
  o.alpha = 0.75;
  o.t0 = (flags & 1) ? 1e6 : 1.0;
  o.maximize = flags & 2;
  o.weight_decay = (flags & 4) ? 0.125 : 0.0;
  return o;
}

std::string describe(int flags) {
  const AsgdOptions o = options(flags);
  return "t0=" + std::to_string(o.t0) + " maximize=" + std::to_string(o.maximize) +
         " weight_decay=" + std::to_string(o.weight_decay);
}

rptest::Host State(const std::vector<float>& p, const AsgdOptions& o) {
  rptest::Host h;
  h.param = p;
  h.state[AsgdState::ax].assign(p.size(), 0.0f);
  h.scalar[AsgdState::eta] = static_cast<float>(o.lr);
  h.scalar[AsgdState::mu] = 1.0f;
  return h;
}

TEST(Asgd, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 8; ++flags) {
        if (n > 100000 && flags != 0 && flags != 6) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        // 6 steps: with t0 = 1, steps 4-6 average with mu = 1/2, 1/3, 1/4.
        rptest::compare_with_reference<RefAsgd>(&roundpipe::asgd_step, options(flags), n, 6,
                                                {0}, {0, 1, 2}, kSlots);
      }
  });
}

TEST(Asgd, EtaAndMuFollowTheScheduleInFloat32) {
  // The stored values are the double-precision schedule rounded to float32, and the step uses
  // the values stored before it (eta = lr and mu = 1 on the first step).
  const AsgdOptions o = options(0);
  std::vector<float> g(3, 1.0f);
  auto s = State({0.0f, 0.0f, 0.0f}, o);
  for (int k = 1; k <= 5; ++k) {
    const float eta_used = s.scalar[AsgdState::eta];
    const float mu_used = s.scalar[AsgdState::mu];
    const std::vector<float> p_before = s.param, ax_before = s.state[0];
    const ParamBuffers t = s.view(g);
    roundpipe::asgd_step(o, &t, 1);
    EXPECT_EQ(s.scalar[AsgdState::step], float(k));
    EXPECT_EQ(s.scalar[AsgdState::eta],
              static_cast<float>(o.lr / std::pow(1 + o.lambd * o.lr * k, o.alpha)));
    EXPECT_EQ(s.scalar[AsgdState::mu], static_cast<float>(1.0 / std::max(1.0, k - o.t0)));
    const float decay = static_cast<float>(1 - o.lambd * double(eta_used));
    const float p = std::fma(1.0f, -eta_used, p_before[0] * decay);
    EXPECT_EQ(s.param[0], p) << "step " << k;
    const float ax = mu_used == 1.0f ? p : ax_before[0] + (p - ax_before[0]) * mu_used;
    EXPECT_EQ(s.state[0][0], ax) << "step " << k;
  }
}

TEST(Asgd, OneCallKeepsEachTensorsOwnSchedule) {
  // Tensors joined a model at different times: each has its own step, eta and mu.
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(11);
    const AsgdOptions o = options(4);
    std::vector<rptest::Host> together, apart;
    std::vector<std::vector<float>> grads;
    int i = 0;
    for (std::size_t n : {5, 0, 40000, 17}) {
      auto p = rptest::randn(n, rng);
      together.push_back(State(p, o));
      grads.push_back(rptest::randn(n, rng));
      for (int k = 0; k < i; ++k) {  // tensor i has taken i steps already
        const ParamBuffers t = together.back().view(grads.back());
        roundpipe::asgd_step(o, &t, 1);
      }
      apart.push_back(together.back());
      ++i;
    }
    for (int k = 0; k < 3; ++k) {
      std::vector<ParamBuffers> ts;
      for (std::size_t j = 0; j < together.size(); ++j) ts.push_back(together[j].view(grads[j]));
      roundpipe::asgd_step(o, ts.data(), ts.size());
      for (std::size_t j = 0; j < apart.size(); ++j) {
        const ParamBuffers t = apart[j].view(grads[j]);
        roundpipe::asgd_step(o, &t, 1);
      }
    }
    for (std::size_t j = 0; j < together.size(); ++j) {
      EXPECT_EQ(together[j].param, apart[j].param) << "tensor " << j;
      EXPECT_EQ(together[j].state[0], apart[j].state[0]) << "tensor " << j;
      for (int k = 0; k < 3; ++k)
        EXPECT_EQ(together[j].scalar[k], apart[j].scalar[k]) << "tensor " << j << " scalar " << k;
      EXPECT_EQ(together[j].scalar[0], float(j + 3));
    }
  });
}

TEST(Asgd, NonFiniteValuesPropagate) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const std::size_t n = 19;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> g(n, 0.5f);
    g[1] = nan;
    g[17] = nan;
    g[3] = inf;
    g[18] = 1e-30f;
    AsgdOptions o = options(0);
    auto s = State(std::vector<float>(n, 1.0f), o);
    s.scalar[AsgdState::mu] = 0.5f;       // averaging on
    const ParamBuffers t = s.view(g);
    roundpipe::asgd_step(o, &t, 1);
    EXPECT_TRUE(std::isnan(s.param[1]));
    EXPECT_TRUE(std::isnan(s.state[0][1]));
    EXPECT_TRUE(std::isnan(s.param[17]));
    EXPECT_TRUE(std::isinf(s.param[3]) && s.param[3] < 0);
    EXPECT_TRUE(std::isinf(s.state[0][3]));
    EXPECT_EQ(s.param[0], s.param[16]);   // a tail element equals a vector-body element
    EXPECT_EQ(s.state[0][0], s.state[0][16]);
    EXPECT_EQ(s.state[0][0], s.param[0] * 0.5f);
    // With mu == 1, ax is a copy of p (torch's copy_), so a NaN or inf in ax does not survive.
    std::fill(s.state[0].begin(), s.state[0].end(), nan);
    s.state[0][2] = inf;
    s.scalar[AsgdState::mu] = 1.0f;
    std::fill(g.begin(), g.end(), 0.5f);
    const ParamBuffers t2 = s.view(g);
    roundpipe::asgd_step(o, &t2, 1);
    EXPECT_EQ(s.state[0][0], s.param[0]);
    EXPECT_EQ(s.state[0][2], s.param[2]);
    EXPECT_EQ(s.state[0][16], s.param[16]);
  });
}

TEST(Asgd, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  const AsgdOptions defaults;
  auto s = State(std::vector<float>(4, 1.0f), defaults);
  ParamBuffers t = s.view(g);
  auto expect_error = [&](AsgdOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::asgd_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[AsgdState::step], 0.0f);
    EXPECT_EQ(s.scalar[AsgdState::eta], static_cast<float>(defaults.lr));
    EXPECT_EQ(s.scalar[AsgdState::mu], 1.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(s.state[0], std::vector<float>(4, 0.0f));
  };
  AsgdOptions o;
  o.lr = -1;
  expect_error(o, &t, 1, "lr");
  o = {};
  o.weight_decay = NAN;
  expect_error(o, &t, 1, "weight_decay");
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].grad = nullptr;
  expect_error(o, ts, 2, "tensors[1].grad");
  ts[1] = t;
  ts[1].state[AsgdState::ax] = nullptr;
  expect_error(o, ts, 2, "tensors[1].ax");
  for (auto [slot, name] : {std::pair<int, const char*>{0, "step"}, {1, "eta"}, {2, "mu"}}) {
    ts[1] = t;
    ts[1].scalar[slot] = nullptr;
    expect_error(o, ts, 2, std::string("tensors[1].") + name);
  }
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
