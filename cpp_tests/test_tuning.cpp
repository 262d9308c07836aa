// The prefetch distance (roundpipe/tuning.hpp): the setter's checks, the environment variable,
// and the calibration the first large steps run. That no distance changes a result is checked
// per algorithm (support.hpp: expect_prefetch_distance_does_not_change_results).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/roundpipe.hpp"
#include "support.hpp"

namespace {

bool is_candidate(std::size_t bytes) {
  for (std::size_t c : roundpipe::kPrefetchCandidates)
    if (c == bytes) return true;
  return false;
}

TEST(Tuning, SetterChecksAndReports) {
  for (std::size_t bad : {std::size_t{1}, std::size_t{100}, std::size_t{16384 + 64}}) {
    try {
      roundpipe::set_prefetch_distance(bad);
      ADD_FAILURE() << "set_prefetch_distance accepted " << bad;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of 64"), std::string::npos) << e.what();
    }
  }
  roundpipe::set_prefetch_distance(0);
  EXPECT_EQ(roundpipe::prefetch_choice().bytes, 0u);
  roundpipe::set_prefetch_distance(16384);
  const roundpipe::PrefetchChoice c = roundpipe::prefetch_choice();
  EXPECT_EQ(c.bytes, 16384u);
  EXPECT_EQ(c.source, "set_prefetch_distance");
  roundpipe::calibrate_prefetch();
  EXPECT_EQ(roundpipe::prefetch_choice().bytes, roundpipe::kDefaultPrefetchBytes);
  EXPECT_EQ(roundpipe::prefetch_choice().source, "default (calibrating)");
}

// Steps of Adam over one tensor of kPrefetchCalibrationElements + 3 elements (a round per
// ~1M elements: 2 per step) until the calibration has chosen, at most 24 steps (rounds that page
// faults disturb are not counted); then the result is the same as with the chosen distance
// fixed from the start, and the choice is one of the candidates, with its measurements.
TEST(Tuning, LargeStepsCalibrateWithoutChangingResults) {
  if (std::getenv("ROUNDPIPE_PREFETCH")) GTEST_SKIP() << "ROUNDPIPE_PREFETCH is set";
  std::mt19937 rng(11);
  const std::size_t n = roundpipe::kPrefetchCalibrationElements + 3;
  const std::vector<float> p0 = rptest::randn(n, rng);
  std::vector<std::vector<float>> grads;
  roundpipe::AdamOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  auto run = [&](int steps) {
    rptest::Host h = rptest::make_host(p0, {0.0f, 0.0f}, {0.0f});
    for (int k = 0; k < steps; ++k) {
      if (static_cast<std::size_t>(k) == grads.size()) grads.push_back(rptest::randn(n, rng));
      const roundpipe::ParamBuffers t = h.view(grads[k]);
      roundpipe::adam_step(o, &t, 1, nullptr);
    }
    return h;
  };
  roundpipe::calibrate_prefetch();
  int steps = 0;
  rptest::Host calibrated;
  while (roundpipe::prefetch_choice().source != "calibrated" && steps < 24) {
    ++steps;
    grads.clear();
    calibrated = run(steps);  // each run starts from p0 again
  }
  const roundpipe::PrefetchChoice c = roundpipe::prefetch_choice();
  ASSERT_EQ(c.source, "calibrated") << "after " << steps << " steps, " << c.rounds << " rounds";
  EXPECT_TRUE(is_candidate(c.bytes)) << c.bytes;
  ASSERT_EQ(c.relative_time.size(), std::size(roundpipe::kPrefetchCandidates));
  ASSERT_EQ(c.ns_per_element.size(), c.relative_time.size());
  for (double x : c.ns_per_element) EXPECT_GT(x, 0.0);
  EXPECT_GE(c.rounds, roundpipe::kPrefetchCalibrationRounds);
  roundpipe::set_prefetch_distance(c.bytes);
  rptest::expect_identical(run(steps), calibrated, "fixed vs calibrating:");
  roundpipe::calibrate_prefetch();
}

// ROUNDPIPE_PREFETCH, read on first use: ctest runs this with ROUNDPIPE_PREFETCH set and
// ROUNDPIPE_EXPECT_PREFETCH the distance it must give, or "error": then the first step throws,
// naming the variable, before it changes anything.
TEST(Tuning, EnvironmentChoice) {
  const char* expect = std::getenv("ROUNDPIPE_EXPECT_PREFETCH");
  if (!expect) GTEST_SKIP() << "run by ctest with ROUNDPIPE_EXPECT_PREFETCH set";
  std::vector<float> g(100, 1.0f);
  rptest::Host h = rptest::make_host(std::vector<float>(100, 0.5f), {0.0f, 0.0f}, {0.0f});
  const roundpipe::ParamBuffers t = h.view(g);
  roundpipe::AdamOptions o;
  if (std::string(expect) == "error") {
    try {
      roundpipe::adam_step(o, &t, 1, nullptr);
      ADD_FAILURE() << "a step ran with ROUNDPIPE_PREFETCH=" << std::getenv("ROUNDPIPE_PREFETCH");
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("ROUNDPIPE_PREFETCH"), std::string::npos) << e.what();
    }
    EXPECT_EQ(h.scalar[0], 0.0f);  // the step count: nothing changed
    EXPECT_EQ(h.param[0], 0.5f);
    EXPECT_THROW(roundpipe::prefetch_choice(), roundpipe::Error);
    return;
  }
  roundpipe::adam_step(o, &t, 1, nullptr);
  const roundpipe::PrefetchChoice c = roundpipe::prefetch_choice();
  EXPECT_EQ(c.bytes, std::stoul(expect));
  EXPECT_EQ(c.source, "ROUNDPIPE_PREFETCH");
}

}  // namespace
