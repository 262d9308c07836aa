// stream_step, the benchmark floor: it must touch exactly the arrays it claims to move.
#include <gtest/gtest.h>

#include <vector>

#include "roundpipe/stream.hpp"
#include "support.hpp"

namespace {

TEST(Stream, ReadsEveryInputAndWritesEveryOutput) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (int states = 0; states <= 3; ++states) {
      const std::size_t n = 16384 + 37;
      std::vector<float> p(n, 1.0f), g(n, 2.0f);
      std::vector<std::vector<float>> s(states, std::vector<float>(n, 4.0f));
      roundpipe::ParamBuffers t;
      t.param = p.data();
      t.grad = g.data();
      for (int k = 0; k < states; ++k) t.state[k] = s[k].data();
      t.numel = n;
      roundpipe::stream_step({states}, &t, 1);
      const float sum = 3.0f + 4.0f * states;
      EXPECT_EQ(p, std::vector<float>(n, sum)) << states;
      for (int k = 0; k < states; ++k) EXPECT_EQ(s[k], std::vector<float>(n, sum)) << states;
      EXPECT_EQ(g, std::vector<float>(n, 2.0f));
    }
  });
}

TEST(Stream, BadArgumentsThrow) {
  std::vector<float> p(4), g(4);
  roundpipe::ParamBuffers t;
  t.param = p.data();
  t.grad = g.data();
  t.numel = 4;
  EXPECT_THROW(roundpipe::stream_step({4}, &t, 1), roundpipe::Error);
  EXPECT_THROW(roundpipe::stream_step({-1}, &t, 1), roundpipe::Error);
  EXPECT_THROW(roundpipe::stream_step({1}, &t, 1), roundpipe::Error);  // state[0] is null
}

}  // namespace
