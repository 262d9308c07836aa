// roundpipe::rprop_step against a float64 Rprop written here from the algorithm's definition
// (Riedmiller & Braun 1993, in torch.optim.Rprop's variant), on every ISA, every option
// combination and every tail size; plus torch's handling of zero, NaN and infinite values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "roundpipe/rprop.hpp"
#include "mixed_precision.hpp"
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

// prev starts at 0, step_size at lr (rounded to float32, as torch.full_like(grad, lr)).
rptest::Host Init(const std::vector<float>& p, const RpropOptions& o) {
  return rptest::make_host(p, {0.0f, static_cast<float>(o.lr)});
}

const rptest::Algorithm<RpropOptions> kRprop = {
    &roundpipe::rprop_step, {"prev", "step_size"}, {"step"}, &Init};

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
  rptest::for_each_case(
      12, {"maximize", "etas=(0.25, 2)", "step_sizes=(2e-3, 1.5e-2)", "step_sizes=(0.02, 0.01)"},
      {7}, [](std::size_t n, int flags) {
        rptest::compare_with_reference<RefRprop>(kRprop, options(flags), n, n > 100000 ? 5 : 8,
                                                 {0, 1}, {0});
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
  rptest::expect_one_call_like_separate_calls(kRprop, options(4));
}

TEST(Rprop, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kRprop, options(4));
}

TEST(Rprop, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kRprop, options(4));
}

TEST(Rprop, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kRprop, options(4));
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
    RpropOptions start;
    start.lr = lr;
    auto h = Init(std::vector<float>(n, 1.0f), start);
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
  rptest::BadArguments<RpropOptions> bad(kRprop);
  bad.expect_bad_values({{&RpropOptions::etaminus, 0.0, "etaminus"},
                         {&RpropOptions::etaminus, 1.0, "etaminus"},
                         {&RpropOptions::etaminus, -0.5, "etaminus"},
                         {&RpropOptions::etaminus, NAN, "etaminus"},
                         {&RpropOptions::etaplus, 1.0, "etaplus"},
                         {&RpropOptions::etaplus, 0.5, "etaplus"},
                         {&RpropOptions::etaplus, NAN, "etaplus"}});
  bad.expect_null_buffers_named(RpropOptions{});
}

}  // namespace
