// The owning optimizer objects (roundpipe/optimizer.hpp): same results as the stateless step,
// exact checkpoint/resume, option changes between steps, and argument errors.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "roundpipe/optim.hpp"
#include "support.hpp"

namespace {

TEST(Optimizer, MatchesTheStatelessStepAndResumesExactly) {
  std::mt19937 rng(11);
  const auto p0 = rptest::randn(1000, rng), q0 = rptest::randn(17, rng);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 6; ++s) grads.push_back(rptest::randn(1017, rng));
  roundpipe::AdamOptions o;
  o.amsgrad = true;
  o.lr = 0.01;

  // Reference: the stateless step over buffers the test owns.
  rptest::Host a, b;
  a.param = p0;
  b.param = q0;
  for (auto* h : {&a, &b})
    for (auto& s : h->state) s.assign(h->param.size(), 0.0f);
  // Under test: an optimizer, checkpointed after 3 steps into a fresh one.
  std::vector<float> p = p0, q = q0, gp(1000), gq(17);
  auto opt = std::make_unique<roundpipe::Adam>(o);
  EXPECT_EQ(opt->add_param(p.data(), gp.data(), p.size()), 0u);
  EXPECT_EQ(opt->add_param(q.data(), gq.data(), q.size()), 1u);
  for (int s = 0; s < 6; ++s) {
    std::vector<float> ga(grads[s].begin(), grads[s].begin() + 1000), gb(grads[s].begin() + 1000, grads[s].end());
    roundpipe::ParamBuffers t[2] = {a.view(ga), b.view(gb)};
    roundpipe::adam_step(o, t, 2);
    gp = ga;
    gq = gb;
    opt->step();
    if (s == 2) {
      const roundpipe::ParamState s0 = opt->state(0), s1 = opt->state(1);
      opt = std::make_unique<roundpipe::Adam>(o);
      opt->add_param(p.data(), gp.data(), p.size());
      opt->add_param(q.data(), gq.data(), q.size());
      opt->load_state(0, s0);
      opt->load_state(1, s1);
    }
  }
  EXPECT_EQ(p, a.param);
  EXPECT_EQ(q, b.param);
  EXPECT_EQ(opt->state(0).state[roundpipe::AdamState::max_exp_avg_sq], a.state[2]);
  EXPECT_EQ(opt->state(1).scalar[roundpipe::AdamState::step], 6.0f);
}

TEST(Optimizer, OptionsChangeBetweenSteps) {
  std::vector<float> p(5, 1.0f), g(5, 1.0f);
  roundpipe::Adam opt;
  opt.add_param(p.data(), g.data(), p.size());
  opt.step();
  EXPECT_TRUE(opt.state(0).state[roundpipe::AdamState::max_exp_avg_sq].empty());
  opt.options().amsgrad = true;  // state for the new slot appears, as in torch
  opt.options().lr = 0.0;
  const std::vector<float> before = p;
  opt.step();
  EXPECT_EQ(p, before);
  EXPECT_EQ(opt.state(0).state[roundpipe::AdamState::max_exp_avg_sq].size(), 5u);
}

TEST(Optimizer, BadArgumentsThrow) {
  std::vector<float> p(4, 1.0f), g(4, 1.0f);
  roundpipe::Adam opt;
  EXPECT_THROW(opt.add_param(nullptr, g.data(), 4), roundpipe::Error);
  EXPECT_THROW(opt.add_param(p.data(), nullptr, 4), roundpipe::Error);
  EXPECT_NO_THROW(opt.add_param(nullptr, nullptr, 0));
  opt.add_param(p.data(), g.data(), 4);
  EXPECT_THROW(opt.state(2), roundpipe::Error);
  roundpipe::ParamState wrong;
  wrong.state[0].assign(3, 0.0f);
  EXPECT_THROW(opt.load_state(1, wrong), roundpipe::Error);
  opt.options().beta1 = 1.5;
  EXPECT_THROW(opt.step(), roundpipe::Error);
  EXPECT_EQ(p, std::vector<float>(4, 1.0f));
}

}  // namespace
