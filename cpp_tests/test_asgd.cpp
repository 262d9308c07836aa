// roundpipe::asgd_step against a float64 ASGD written here from torch.optim.ASGD's definition
// (Polyak-Juditsky averaging with Bottou's eta and mu schedules), on every ISA, every option
// combination and every tail size; plus per-tensor schedules, thread counts, non-finite inputs
// and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "roundpipe/asgd.hpp"
#include "roundpipe/optim.hpp"        // the headers' old names, kept for one release
#include "roundpipe/optimizers.hpp"
#include "mixed_precision.hpp"
#include "support.hpp"

// The old names (Asgd, AsgdOptions, AsgdState) still name the same types, deprecated, for one
// release.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<roundpipe::Asgd, roundpipe::ASGD>);
static_assert(std::is_same_v<roundpipe::AsgdOptions, roundpipe::ASGDOptions>);
static_assert(std::is_same_v<roundpipe::AsgdState, roundpipe::ASGDState>);
#pragma GCC diagnostic pop

namespace {

using roundpipe::ASGDOptions;
using roundpipe::ASGDState;
using roundpipe::ParamBuffers;

// Float64 ASGD as torch.optim.ASGD documents it: with the eta and mu of the previous step,
//   p <- p (1 - lambd eta) - eta g;   ax <- ax + mu (p - ax)   (ax <- p while mu == 1)
// then eta <- lr / (1 + lambd lr t)^alpha and mu <- 1 / max(1, t - t0). Slots as ASGDState.
struct RefASGD {
  std::vector<double> param, state[3];
  double scalar[3] = {};
  ASGDOptions o;

  RefASGD(const std::vector<float>& p0, const ASGDOptions& options)
      : param(p0.begin(), p0.end()), o(options) {
    state[0].assign(p0.size(), 0.0);
    scalar[ASGDState::eta] = o.lr;
    scalar[ASGDState::mu] = 1.0;
  }

  void update(const std::vector<float>& grad) {
    const double t = ++scalar[ASGDState::step];
    const double eta = scalar[ASGDState::eta], mu = scalar[ASGDState::mu];
    auto& ax = state[0];
    for (std::size_t i = 0; i < param.size(); ++i) {
      double g = o.maximize ? -double(grad[i]) : double(grad[i]);
      g += o.weight_decay * param[i];
      param[i] = param[i] * (1 - o.lambd * eta) - eta * g;
      ax[i] = mu == 1.0 ? param[i] : ax[i] + mu * (param[i] - ax[i]);
    }
    scalar[ASGDState::eta] = o.lr / std::pow(1 + o.lambd * o.lr * t, o.alpha);
    scalar[ASGDState::mu] = 1 / std::max(1.0, t - o.t0);
  }
};

// ax starts at 0, eta at lr, mu at 1.
rptest::Host Init(const std::vector<float>& p, const ASGDOptions& o) {
  return rptest::make_host(p, {0.0f}, {0.0f, static_cast<float>(o.lr), 1.0f});
}

const rptest::Algorithm<ASGDOptions> kASGD = {
    &roundpipe::asgd_step, {"ax"}, {"step", "eta", "mu"}, &Init};

// Bit 0: t0 = 1 (averaging from step 3 on: mu = 1/2, 1/3, ...) or 1e6 (ax = p throughout);
// bit 1: maximize; bit 2: weight decay. lambd is large so the decay term matters.
ASGDOptions options(int flags) {
  ASGDOptions o;
  o.lr = 0.125;
  o.lambd = 0.5;
  o.alpha = 0.75;
  o.t0 = (flags & 1) ? 1e6 : 1.0;
  o.maximize = flags & 2;
  o.weight_decay = (flags & 4) ? 0.125 : 0.0;
  return o;
}

TEST(ASGD, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_case(8, {"t0=1e6", "maximize", "weight_decay=0.125"}, {0, 6},
                        [](std::size_t n, int flags) {
                          // 6 steps: with t0 = 1, steps 4-6 average with mu = 1/2, 1/3, 1/4.
                          rptest::compare_with_reference<RefASGD>(kASGD, options(flags), n, 6,
                                                                  {0}, {0, 1, 2});
                        });
}

TEST(ASGD, EtaAndMuFollowTheScheduleInFloat32) {
  // The stored values are the double-precision schedule rounded to float32, and the step uses
  // the values stored before it (eta = lr and mu = 1 on the first step).
  const ASGDOptions o = options(0);
  std::vector<float> g(3, 1.0f);
  auto s = Init({0.0f, 0.0f, 0.0f}, o);
  for (int k = 1; k <= 5; ++k) {
    const float eta_used = s.scalar[ASGDState::eta];
    const float mu_used = s.scalar[ASGDState::mu];
    const std::vector<float> p_before = s.param, ax_before = s.state[0];
    const ParamBuffers t = s.view(g);
    roundpipe::asgd_step(o, &t, 1);
    EXPECT_EQ(s.scalar[ASGDState::step], float(k));
    EXPECT_EQ(s.scalar[ASGDState::eta],
              static_cast<float>(o.lr / std::pow(1 + o.lambd * o.lr * k, o.alpha)));
    EXPECT_EQ(s.scalar[ASGDState::mu], static_cast<float>(1.0 / std::max(1.0, k - o.t0)));
    const float decay = static_cast<float>(1 - o.lambd * double(eta_used));
    const float p = std::fma(1.0f, -eta_used, p_before[0] * decay);
    EXPECT_EQ(s.param[0], p) << "step " << k;
    const float ax = mu_used == 1.0f ? p : ax_before[0] + (p - ax_before[0]) * mu_used;
    EXPECT_EQ(s.state[0][0], ax) << "step " << k;
  }
}

TEST(ASGD, OneCallKeepsEachTensorsOwnSchedule) {
  // Tensors joined a model at different times: each has its own step, eta and mu.
  rptest::expect_one_call_like_separate_calls(kASGD, options(4));
}

TEST(ASGD, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kASGD, options(2 | 4));
}

TEST(ASGD, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kASGD, options(2 | 4));
}

TEST(ASGD, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kASGD, options(2 | 4));
}

TEST(ASGD, NonFiniteValuesPropagate) {
  const ASGDOptions o = options(0);
  rptest::expect_non_finite_gradients_propagate(
      kASGD, o, [](rptest::Host& s) { s.scalar[ASGDState::mu] = 0.5f; },  // averaging on
      [&](rptest::Host& s) {
        EXPECT_TRUE(std::isnan(s.state[0][1]));
        EXPECT_TRUE(std::isinf(s.param[3]) && s.param[3] < 0);
        EXPECT_TRUE(std::isinf(s.state[0][3]));
        EXPECT_EQ(s.state[0][0], s.param[0] * 0.5f);
        // With mu == 1, ax is a copy of p (torch's copy_), so a NaN or inf in ax does not
        // survive.
        std::fill(s.state[0].begin(), s.state[0].end(), NAN);
        s.state[0][2] = INFINITY;
        s.scalar[ASGDState::mu] = 1.0f;
        const std::vector<float> g(s.param.size(), 0.5f);
        const ParamBuffers t = s.view(g);
        roundpipe::asgd_step(o, &t, 1);
        EXPECT_EQ(s.state[0][0], s.param[0]);
        EXPECT_EQ(s.state[0][2], s.param[2]);
        EXPECT_EQ(s.state[0][16], s.param[16]);
      },
      1e-30f);
}

TEST(ASGD, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<ASGDOptions> bad(kASGD);
  bad.expect_bad_values({{&ASGDOptions::lr, -1, "lr"},
                         {&ASGDOptions::weight_decay, NAN, "weight_decay"}});
  bad.expect_null_buffers_named(ASGDOptions{});
}

}  // namespace
