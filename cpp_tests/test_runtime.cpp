// ISA selection and thread-count API (roundpipe/isa.hpp, roundpipe/threads.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>
#include <string>

#include "roundpipe/roundpipe.hpp"
#include "support.hpp"

namespace {

TEST(Runtime, ScalarIsAlwaysSupportedAndTheDefaultIsTheWidest) {
  const auto isas = roundpipe::supported_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), roundpipe::Isa::scalar);
  if (!std::getenv("ROUNDPIPE_ISA")) {
    EXPECT_EQ(roundpipe::active_isa(), isas.back());
  }
#if defined(__aarch64__)
  EXPECT_EQ(isas.back(), roundpipe::Isa::neon);
#endif
}

TEST(Runtime, NamesRoundTrip) {
  for (auto isa : {roundpipe::Isa::scalar, roundpipe::Isa::avx2, roundpipe::Isa::avx512,
                   roundpipe::Isa::neon})
    EXPECT_EQ(roundpipe::parse_isa(roundpipe::isa_name(isa)), isa);
  EXPECT_THROW(roundpipe::parse_isa("sse9"), roundpipe::Error);
}

TEST(Runtime, ForcingAnUnsupportedIsaThrowsAndListsTheSupportedOnes) {
  const auto isas = roundpipe::supported_isas();
  const roundpipe::Isa before = roundpipe::active_isa();
  for (auto isa : {roundpipe::Isa::avx2, roundpipe::Isa::avx512, roundpipe::Isa::neon}) {
    if (std::find(isas.begin(), isas.end(), isa) != isas.end()) continue;
    try {
      roundpipe::set_isa(isa);
      ADD_FAILURE() << "set_isa accepted " << roundpipe::isa_name(isa);
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("supported: scalar"), std::string::npos) << e.what();
    }
    EXPECT_EQ(roundpipe::active_isa(), before);
  }
}

TEST(Runtime, ThreadCount) {
  const int before = roundpipe::num_threads();
  EXPECT_GE(before, 1);
  EXPECT_THROW(roundpipe::set_num_threads(0), roundpipe::Error);
  roundpipe::set_num_threads(3);
  EXPECT_EQ(roundpipe::num_threads(), 3);
  roundpipe::set_num_threads(before);
}

// A per-call thread count (ThreadCountScope, Optimizer::set_num_threads) changes how the work is
// split, never the result; scopes nest and restore; bad counts throw. Enough elements for the
// 4 threads of the outer scope.
TEST(Runtime, ThreadCountScopeAndPerOptimizerThreads) {
  const int before = roundpipe::num_threads();
  roundpipe::set_num_threads(1);
  std::vector<float> grad(4 * rptest::kElementsPerThread + 3);
  for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = std::sin(float(i));
  std::vector<float> results[3];
  for (int threads : {0, 3, 2}) {
    std::vector<float> p(grad.size(), 1.0f);
    roundpipe::Adam opt;
    opt.add_param(p.data(), grad.data(), p.size());
    opt.set_num_threads(threads);
    EXPECT_EQ(opt.num_threads(), threads);
    {
      const roundpipe::ThreadCountScope outer(4);  // the optimizer's count wins unless 0
      opt.step();
    }
    opt.step();
    results[threads == 0 ? 0 : threads - 1] = p;
  }
  EXPECT_EQ(results[1], results[0]);
  EXPECT_EQ(results[2], results[0]);
  EXPECT_THROW(roundpipe::ThreadCountScope(-1), roundpipe::Error);
  EXPECT_THROW(roundpipe::ThreadCountScope(1025), roundpipe::Error);
  roundpipe::Adam opt;
  EXPECT_THROW(opt.set_num_threads(-2), roundpipe::Error);
  EXPECT_EQ(opt.num_threads(), 0);
  roundpipe::set_num_threads(before);
}

// Run by ctest with ROUNDPIPE_ISA set and ROUNDPIPE_EXPECT_ISA naming the ISA it must give, or
// "error" when the first use must fail (and keep failing, not fall back silently).
TEST(Runtime, EnvironmentChoice) {
  const char* expect = std::getenv("ROUNDPIPE_EXPECT_ISA");
  if (!expect) GTEST_SKIP() << "ROUNDPIPE_EXPECT_ISA not set";
  if (std::string(expect) == "error") {
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        roundpipe::active_isa();
        ADD_FAILURE() << "ROUNDPIPE_ISA=" << std::getenv("ROUNDPIPE_ISA") << " was accepted";
      } catch (const roundpipe::Error& e) {
        EXPECT_NE(std::string(e.what()).find("ROUNDPIPE_ISA"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("supported: scalar"), std::string::npos) << e.what();
      }
    }
  } else {
    EXPECT_STREQ(roundpipe::isa_name(roundpipe::active_isa()), expect);
  }
}

}  // namespace
