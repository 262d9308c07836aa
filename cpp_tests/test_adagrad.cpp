// roundpipe::adagrad_step against a float64 Adagrad written here from its definition (Duchi et
// al., with torch.optim.Adagrad's learning-rate decay, weight decay and maximize), on every ISA,
// every flag combination and every tail size; plus several tensors per call, thread counts,
// non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "roundpipe/adagrad.hpp"
#include "mixed_precision.hpp"
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

// The sum starts at the initial accumulator value options() chose.
rptest::Host Init(const std::vector<float>& p, const AdagradOptions&) {
  return rptest::make_host(p, {static_cast<float>(RefAdagrad::initial_accumulator_value)});
}

const rptest::Algorithm<AdagradOptions> kAdagrad = {
    &roundpipe::adagrad_step, {"sum"}, {"step"}, &Init};

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

TEST(Adagrad, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(
      16, {"maximize", "weight_decay=0.125", "lr_decay=0.5", "initial_accumulator_value=0.5"},
      {0, 15}, [](std::size_t n, int flags) {
        rptest::compare_with_reference<RefAdagrad>(kAdagrad, options(flags), n, 4, {0}, {0});
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
    auto h = rptest::make_host(std::vector<float>(3, 0.0f), {0.0f},
                               {9.0f});  // resumed after 9 steps: this one is step 10
    const std::vector<float> g(3, 1.0f);
    const ParamBuffers t = h.view(g);
    roundpipe::adagrad_step(o, &t, 1);
    EXPECT_EQ(h.scalar[0], 10.0f);
    EXPECT_EQ(h.state[0], std::vector<float>(3, 1.0f));
    EXPECT_EQ(h.param, std::vector<float>(3, -0.05f));  // -(0.5 / 10) * 1 / 1
  });
}

TEST(Adagrad, OneCallUpdatesManyTensorsLikeSeparateCalls) {
  rptest::expect_one_call_like_separate_calls(kAdagrad, options(2 | 4 | 8));
}

TEST(Adagrad, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kAdagrad, options(15));
}

TEST(Adagrad, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kAdagrad, options(15));
}

TEST(Adagrad, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kAdagrad, options(15));
}

TEST(Adagrad, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(kAdagrad, options(0), [](const rptest::Host& s) {
    EXPECT_TRUE(std::isnan(s.state[0][1]));
    EXPECT_TRUE(std::isinf(s.state[0][3]));
    EXPECT_TRUE(std::isnan(s.param[3]));   // inf / inf, as in torch
    EXPECT_GT(s.state[0][18], 0.0f);       // 1e-40: a subnormal, kept (no flush to zero)
  });
}

TEST(Adagrad, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<AdagradOptions> bad(kAdagrad, options(0));
  bad.expect_bad_values({{&AdagradOptions::lr, -1, "lr"},
                         {&AdagradOptions::lr_decay, -0.5, "lr_decay"},
                         {&AdagradOptions::weight_decay, NAN, "weight_decay"},
                         {&AdagradOptions::eps, -1e-10, "eps"}});
  bad.expect_null_buffers_named(AdagradOptions{});
}

}  // namespace
