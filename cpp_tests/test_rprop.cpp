// roundpipe::rprop_step against a float64 Rprop written here from the algorithm's definition
// (Riedmiller & Braun 1993, in torch.optim.Rprop's variant), on every ISA, every option
// combination and every tail size; plus torch's handling of zero, NaN and infinite values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/rprop.hpp"
#include "support.hpp"

namespace {

using roundpipe::ParamBuffers;
using roundpipe::RpropOptions;
using roundpipe::RpropState;

// Float64 Rprop, per element, with d = g * prev:
//   d > 0: step_size *= etaplus;   d < 0: step_size *= etaminus and g := 0;   d == 0: kept;
//   step_size is clamped to [step_size_min, step_size_max] (max wins if max < min);
//   p -= sign(g) * step_size;  prev := g.
// step_size starts at lr, prev at 0.
struct RefRprop {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  RpropOptions o;
  int shrinks = 0, grows = 0, clamps = 0;

  RefRprop(const std::vector<float>& p0, const RpropOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    state[1].assign(p0.size(), o.lr);
  }

  static double sign(double x) { return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0; }

  void update(const std::vector<float>& grad) {
    ++scalar[0];
    auto &prev = state[0], &step_size = state[1];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      const double d = g * prev[i];
      double s = step_size[i];
      if (d > 0) {
        s *= o.etaplus;
        ++grows;
      } else if (d < 0) {
        s *= o.etaminus;
        g = 0;
        ++shrinks;
      }
      const double clamped = std::min(std::max(s, o.step_size_min), o.step_size_max);
      clamps += clamped != s;
      step_size[i] = clamped;
      param[i] -= sign(g) * clamped;
      prev[i] = g;
    }
  }
};

const char* const kSlots[] = {"prev", "step_size", "unused"};

rptest::Host State(const std::vector<float>& p, float lr = 1e-2f) {
  rptest::Host h;
  h.param = p;
  h.state[RpropState::prev].assign(p.size(), 0.0f);
  h.state[RpropState::step_size].assign(p.size(), lr);
  return h;
}

// Flag bits: 1 maximize, 2 other etas, 4 tight step sizes (both clamps hit within a few
// steps), 8 step_size_max below step_size_min.
RpropOptions options(int flags) {
  RpropOptions o;
  o.lr = 1e-2;
  o.maximize = flags & 1;
  if (flags & 2) {
    o.etaminus = 0.25;
    o.etaplus = 2.0;
  }
  if (flags & 4) {
    o.step_size_min = 2e-3;
    o.step_size_max = 1.5e-2;
  }
  if (flags & 8) {
    o.step_size_min = 0.02;
    o.step_size_max = 0.01;
  }
  return o;
}

std::string describe(int flags) {
  return std::string("maximize=") + ((flags & 1) ? "1" : "0") + " etas=" +
         ((flags & 2) ? "(0.25, 2)" : "(0.5, 1.2)") + " step_sizes=" +
         ((flags & 8) ? "(0.02, 0.01)" : (flags & 4) ? "(2e-3, 1.5e-2)" : "(1e-6, 50)");
}

TEST(Rprop, ReferenceGrowsShrinksAndClamps) {
  std::mt19937 rng(1);
  const auto p = rptest::randn(1000, rng);
  RefRprop ref(p, options(4));
  for (int s = 0; s < 8; ++s) ref.update(rptest::randn(1000, rng));
  EXPECT_GT(ref.grows, 1000);
  EXPECT_GT(ref.shrinks, 1000);
  EXPECT_GT(ref.clamps, 100);
}

TEST(Rprop, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (std::size_t n : rptest::sizes())
      for (int flags = 0; flags < 12; ++flags) {
        const bool big = n > 100000;
        if (big && flags != 7) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe(flags));
        rptest::compare_with_reference<RefRprop>(&roundpipe::rprop_step, options(flags), n,
                                                 big ? 5 : 8,
                                                 {0, 1}, {0}, kSlots);
      }
  });
}

TEST(Rprop, InitStateFillsStepSizeWithLr) {
  std::vector<float> p(37, 1.0f), prev(37, 5.0f), step_size(37, 5.0f);
  float step = 9.0f;
  ParamBuffers t;
  t.param = p.data();
  t.state[RpropState::prev] = prev.data();
  t.state[RpropState::step_size] = step_size.data();
  t.scalar[RpropState::step] = &step;
  t.numel = p.size();
  RpropOptions o;
  o.lr = 0.1;  // rounded to float32, as torch.full_like(grad, lr)
  roundpipe::rprop_init_state(o, t);
  EXPECT_EQ(step, 0.0f);
  EXPECT_EQ(prev, std::vector<float>(37, 0.0f));
  EXPECT_EQ(step_size, std::vector<float>(37, 0.1f));
  o.lr = -1;
  EXPECT_THROW(roundpipe::rprop_init_state(o, t), roundpipe::Error);
  o = {};
  t.state[RpropState::step_size] = nullptr;
  try {
    roundpipe::rprop_init_state(o, t);
    ADD_FAILURE() << "no error";
  } catch (const roundpipe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("step_size"), std::string::npos) << e.what();
  }
}

TEST(Rprop, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::for_each_isa([](roundpipe::Isa) {
    std::mt19937 rng(7);
    const RpropOptions o = options(4);
    std::vector<rptest::Host> together, apart;
    for (std::size_t n : {5, 0, 40000, 17, 16384, 3}) {
      together.push_back(State(rptest::randn(n, rng)));
      apart.push_back(together.back());
    }
    for (int step = 0; step < 4; ++step) {
      std::vector<std::vector<float>> grads;
      for (auto& h : together) grads.push_back(rptest::randn(h.param.size(), rng));
      std::vector<ParamBuffers> ts;
      for (std::size_t i = 0; i < together.size(); ++i) ts.push_back(together[i].view(grads[i]));
      roundpipe::rprop_step(o, ts.data(), ts.size());
      for (std::size_t i = 0; i < apart.size(); ++i) {
        const ParamBuffers t = apart[i].view(grads[i]);
        roundpipe::rprop_step(o, &t, 1);
      }
    }
    for (std::size_t i = 0; i < together.size(); ++i) {
      EXPECT_EQ(together[i].param, apart[i].param) << "tensor " << i;
      EXPECT_EQ(together[i].state[1], apart[i].state[1]) << "tensor " << i;
      EXPECT_EQ(together[i].scalar[0], 4.0f) << "tensor " << i;
    }
  });
}

TEST(Rprop, ThreadCountDoesNotChangeResults) {
  const int before = roundpipe::num_threads();
  std::mt19937 rng(3);
  const auto p0 = rptest::randn(200003, rng);
  std::vector<std::vector<float>> grads;
  for (int k = 0; k < 3; ++k) grads.push_back(rptest::randn(200003, rng));
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    roundpipe::set_num_threads(threads);
    auto s = State(p0);
    for (const auto& g : grads) {
      const ParamBuffers t = s.view(g);
      roundpipe::rprop_step(options(4), &t, 1);
    }
    results.push_back(s.param);
  }
  roundpipe::set_num_threads(before);
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

// torch.optim.Rprop's element-wise rules at the edges, on every ISA, in the vector body and in
// the tail: elements 0..k-1 hold the cases and are repeated at 16 + i (the tail of 16-lane and
// narrower vectors, n = 16 + k < 32).
TEST(Rprop, ZeroNanAndInfinityFollowTorch) {
  const float inf = INFINITY, nan = NAN;
  struct Case {
    float prev, grad;       // prev before the step, the new gradient
    float step_size;        // before the step
    float want_step_size, want_delta, want_prev;  // delta = p_after - p_before (NaN: NaN)
  };
  const float lr = 0.25f;  // etas (0.5, 2): exact products
  const Case cases[] = {
      {1.0f, 2.0f, lr, 0.5f, -0.5f, 2.0f},        // same sign: grow, move
      {1.0f, -2.0f, lr, 0.125f, 0.0f, 0.0f},      // sign change: shrink, no move, prev := 0
      {0.0f, -2.0f, lr, lr, lr, -2.0f},           // prev 0: keep, move
      {1.0f, 0.0f, lr, lr, 0.0f, 0.0f},           // zero gradient: keep, no move
      {1.0f, nan, lr, lr, 0.0f, nan},             // sign(NaN) = 0: keep, no move, prev := NaN
      {nan, 3.0f, lr, lr, -lr, 3.0f},             // NaN product: keep, move
      {0.0f, inf, lr, lr, -lr, inf},              // inf * 0 = NaN: keep, move by sign(inf)
      {inf, -1.0f, lr, 0.125f, 0.0f, 0.0f},       // -inf product: shrink, no move
      {1e-30f, 1e-30f, lr, lr, -lr, 1e-30f},      // product underflows to 0 in float32: keep
      {1e30f, 1e30f, lr, 0.5f, -0.5f, 1e30f},     // product overflows to inf: grow
      {nan, 1.0f, nan, nan, nan, 1.0f},           // NaN step size stays NaN through the clamp
      {1.0f, -1.0f, inf, 64.0f, 0.0f, 0.0f},      // clamped to step_size_max
  };
  constexpr std::size_t k = sizeof(cases) / sizeof(cases[0]);
  static_assert(k <= 16, "cases must fit below the tail");
  RpropOptions o;
  o.etaminus = 0.5;
  o.etaplus = 2.0;
  o.step_size_min = 1e-3;
  o.step_size_max = 64.0;
  rptest::for_each_isa([&](roundpipe::Isa) {
    const std::size_t n = 16 + k;
    auto h = State(std::vector<float>(n, 1.0f), lr);
    std::vector<float> g(n, 0.0f);
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t at : {i, 16 + i}) {
        h.state[RpropState::prev][at] = cases[i].prev;
        h.state[RpropState::step_size][at] = cases[i].step_size;
        g[at] = cases[i].grad;
      }
    const ParamBuffers t = h.view(g);
    roundpipe::rprop_step(o, &t, 1);
    auto same = [](float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; };
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t at : {i, 16 + i}) {
        SCOPED_TRACE("case " + std::to_string(i) + " at " + std::to_string(at));
        EXPECT_TRUE(same(h.state[RpropState::step_size][at], cases[i].want_step_size))
            << h.state[RpropState::step_size][at];
        EXPECT_TRUE(same(h.param[at] - 1.0f, cases[i].want_delta)) << h.param[at];
        EXPECT_TRUE(same(h.state[RpropState::prev][at], cases[i].want_prev))
            << h.state[RpropState::prev][at];
      }
  });
}

TEST(Rprop, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> g(4, 1.0f);
  auto s = State(std::vector<float>(4, 1.0f));
  ParamBuffers t = s.view(g);
  auto expect_error = [&](RpropOptions o, const ParamBuffers* ts, std::size_t count,
                          const std::string& needle) {
    try {
      roundpipe::rprop_step(o, ts, count);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(s.scalar[0], 0.0f);
    EXPECT_EQ(s.param, std::vector<float>(4, 1.0f));
    EXPECT_EQ(s.state[RpropState::step_size], std::vector<float>(4, 1e-2f));
  };
  RpropOptions o;
  for (double bad : {0.0, 1.0, -0.5, double(NAN)}) {
    o = {};
    o.etaminus = bad;
    expect_error(o, &t, 1, "etaminus");
  }
  for (double bad : {1.0, 0.5, double(NAN)}) {
    o = {};
    o.etaplus = bad;
    expect_error(o, &t, 1, "etaplus");
  }
  o = {};
  ParamBuffers ts[2] = {t, t};
  ts[1].grad = nullptr;
  expect_error(o, ts, 2, "tensors[1].grad");
  ts[1] = t;
  ts[1].state[RpropState::prev] = nullptr;
  expect_error(o, ts, 2, "tensors[1].prev");
  ts[1] = t;
  ts[1].state[RpropState::step_size] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step_size");
  ts[1] = t;
  ts[1].scalar[RpropState::step] = nullptr;
  expect_error(o, ts, 2, "tensors[1].step");
  expect_error(o, nullptr, 1, "tensors");
}

}  // namespace
