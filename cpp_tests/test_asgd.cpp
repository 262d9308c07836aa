// roundpipe::asgd_step against a float64 ASGD written here from torch.optim.ASGD's definition
// (Polyak-Juditsky averaging with Bottou's eta and mu schedules), on every ISA, every option
// combination and every tail size; plus per-tensor schedules, thread counts, non-finite inputs
// and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "roundpipe/asgd.hpp"
#include "mixed_precision.hpp"
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

// ax starts at 0, eta at lr, mu at 1.
rptest::Host Init(const std::vector<float>& p, const AsgdOptions& o) {
  return rptest::make_host(p, {0.0f}, {0.0f, static_cast<float>(o.lr), 1.0f});
}

const rptest::Algorithm<AsgdOptions> kAsgd = {
    &roundpipe::asgd_step, {"ax"}, {"step", "eta", "mu"}, &Init};

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

TEST(Asgd, MatchesFloat64ReferenceOnEveryIsaSizeAndOptionCombination) {
  rptest::for_each_case(8, {"t0=1e6", "maximize", "weight_decay=0.125"}, {0, 6},
                        [](std::size_t n, int flags) {
                          // 6 steps: with t0 = 1, steps 4-6 average with mu = 1/2, 1/3, 1/4.
                          rptest::compare_with_reference<RefAsgd>(kAsgd, options(flags), n, 6,
                                                                  {0}, {0, 1, 2});
                        });
}

TEST(Asgd, EtaAndMuFollowTheScheduleInFloat32) {
  // The stored values are the double-precision schedule rounded to float32, and the step uses
  // the values stored before it (eta = lr and mu = 1 on the first step).
  const AsgdOptions o = options(0);
  std::vector<float> g(3, 1.0f);
  auto s = Init({0.0f, 0.0f, 0.0f}, o);
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
  rptest::expect_one_call_like_separate_calls(kAsgd, options(4));
}

TEST(Asgd, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kAsgd, options(2 | 4));
}

TEST(Asgd, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kAsgd, options(2 | 4));
}

TEST(Asgd, NonFiniteValuesPropagate) {
  const AsgdOptions o = options(0);
  rptest::expect_non_finite_gradients_propagate(
      kAsgd, o, [](rptest::Host& s) { s.scalar[AsgdState::mu] = 0.5f; },  // averaging on
      [&](rptest::Host& s) {
        EXPECT_TRUE(std::isnan(s.state[0][1]));
        EXPECT_TRUE(std::isinf(s.param[3]) && s.param[3] < 0);
        EXPECT_TRUE(std::isinf(s.state[0][3]));
        EXPECT_EQ(s.state[0][0], s.param[0] * 0.5f);
        // With mu == 1, ax is a copy of p (torch's copy_), so a NaN or inf in ax does not
        // survive.
        std::fill(s.state[0].begin(), s.state[0].end(), NAN);
        s.state[0][2] = INFINITY;
        s.scalar[AsgdState::mu] = 1.0f;
        const std::vector<float> g(s.param.size(), 0.5f);
        const ParamBuffers t = s.view(g);
        roundpipe::asgd_step(o, &t, 1);
        EXPECT_EQ(s.state[0][0], s.param[0]);
        EXPECT_EQ(s.state[0][2], s.param[2]);
        EXPECT_EQ(s.state[0][16], s.param[16]);
      },
      1e-30f);
}

TEST(Asgd, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<AsgdOptions> bad(kAsgd);
  bad.expect_bad_values({{&AsgdOptions::lr, -1, "lr"},
                         {&AsgdOptions::weight_decay, NAN, "weight_decay"}});
  bad.expect_null_buffers_named(AsgdOptions{});
}

}  // namespace
