// roundpipe::sgd_step against a float64 SGD written here from its definition (heavy-ball
// momentum with dampening, Sutskever et al.'s Nesterov form, with torch.optim.SGD's conventions
// for weight decay, maximize and the first momentum step), on every ISA, every valid flag
// combination and every tail size; the momentum-buffer flag; several tensors per call, thread
// counts, non-finite inputs and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "roundpipe/sgd.hpp"
#include "mixed_precision.hpp"
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

// The momentum buffer holds no value yet (NaN: the step must not read it), its flag says so.
rptest::Host Init(const std::vector<float>& p, const SGDOptions&) {
  return rptest::make_host(p, {NAN}, {0.0f});
}

const rptest::Algorithm<SGDOptions> kSGD = {
    &roundpipe::sgd_step, {"momentum_buffer"}, {"momentum_buffer_ready"}, &Init};

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

TEST(SGD, MatchesFloat64ReferenceOnEveryIsaSizeAndFlagCombination) {
  rptest::for_each_case(
      32, {"momentum=0.875", "dampening=0.25", "nesterov", "weight_decay=0.125", "maximize"},
      {0, 1 + 4 + 8 + 16, 1 + 2 + 8}, [](std::size_t n, int flags) {
        if (!valid(flags)) return;
        const SGDOptions o = options(flags);
        std::vector<int> slots, scalars;
        if (o.momentum != 0) slots = scalars = {0};
        rptest::compare_with_reference<RefSGD>(kSGD, o, n, 4, slots, scalars);
      });
}

TEST(SGD, FirstMomentumStepCopiesTheGradientAndSetsTheFlag) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const std::size_t n = 21;
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = 0.25f * float(i) - 2.0f;
    SGDOptions o = options(1 | 2 | 8);
    auto h = Init(std::vector<float>(n, 1.0f), o);  // the buffer's NaNs must be ignored
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
  // Tensor 0 starts without a momentum value, the others with one: both in one call.
  rptest::expect_one_call_like_separate_calls(kSGD, options(1 | 4 | 8));
}

TEST(SGD, ThreadCountDoesNotChangeResults) {
  rptest::expect_thread_count_does_not_change_results(kSGD, options(1 | 2 | 8 | 16));
}

TEST(SGD, PrefetchDistanceDoesNotChangeResults) {
  rptest::expect_prefetch_distance_does_not_change_results(kSGD, options(1 | 2 | 8 | 16));
}

TEST(SGD, MixedPrecisionPassEqualsItsComposition) {
  rptest::expect_mixed_precision_like_composition(kSGD, options(1 | 2 | 8 | 16));
}

TEST(SGD, NonFiniteValuesPropagate) {
  rptest::expect_non_finite_gradients_propagate(kSGD, options(1), [](const rptest::Host& s) {
    EXPECT_TRUE(std::isnan(s.state[0][1]));
    EXPECT_EQ(s.param[3], -INFINITY);      // p - lr * inf
    EXPECT_EQ(s.state[0][18], 1e-20f);     // the first step copies the gradient
  });
}

TEST(SGD, BadArgumentsThrowBeforeAnythingChanges) {
  rptest::BadArguments<SGDOptions> bad(kSGD);
  bad.expect_bad_values({{&SGDOptions::lr, -1, "lr"},
                         {&SGDOptions::momentum, NAN, "momentum"},
                         {&SGDOptions::weight_decay, -0.1, "weight_decay"}});
  SGDOptions o;
  o.nesterov = true;
  bad.expect_error(o, "nesterov requires momentum > 0 and dampening == 0");
  o.momentum = 0.9;
  o.dampening = 0.1;
  bad.expect_error(o, "nesterov requires momentum > 0 and dampening == 0");
  o = {};
  o.momentum = 0.9;  // the buffer and its flag required
  bad.expect_null_buffers_named(o);
}

}  // namespace
