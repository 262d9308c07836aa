// The owning optimizer objects (roundpipe/optimizer.hpp): same results as the stateless step,
// exact checkpoint/resume, option changes between steps, and argument errors.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "roundpipe/roundpipe.hpp"
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

// Compact storage in the owning optimizer: int8 state for a parameter of at least kInt8MinNumel
// elements (float32 below), a bfloat16 parameter, the same bits as the stateless step given the
// same buffers and rounding seed; a checkpoint resumes exactly; state_values reads any format;
// set_state_format converts existing state.
TEST(Optimizer, CompactStateAndBf16ParametersMatchTheStatelessStep) {
  std::mt19937 rng(12);
  const std::size_t n = roundpipe::kInt8MinNumel + 100;
  const auto p0 = rptest::randn(n, rng), q0 = rptest::randn(17, rng);
  roundpipe::AdamOptions o;
  o.lr = 0.01;
  // bfloat16 parameter p, float32 q
  std::vector<std::uint16_t> p(n), ref_p(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, &p0[i], 4);
    p[i] = ref_p[i] = static_cast<std::uint16_t>(u >> 16);
  }
  std::vector<float> q = q0, ref_q = q0, gp(n), gq(17);
  std::vector<std::uint8_t> codes[2] = {std::vector<std::uint8_t>(n, 127), std::vector<std::uint8_t>(n, 0)};
  std::vector<float> absmax[2] = {std::vector<float>(roundpipe::quant_blocks(n)),
                                  std::vector<float>(roundpipe::quant_blocks(n))};
  std::vector<float> qstate[2] = {std::vector<float>(17), std::vector<float>(17)};
  float steps[2] = {0.0f, 0.0f};
  auto opt = std::make_unique<roundpipe::Adam>(o);
  opt->set_state_format(roundpipe::StateFormat::int8);
  opt->set_seed(77);
  opt->add_param({nullptr, p.data(), gp.data(), nullptr, n});
  opt->add_param(q.data(), gq.data(), 17);
  for (int s = 0; s < 6; ++s) {
    const auto a = rptest::randn(n, rng), b = rptest::randn(17, rng);
    std::copy(a.begin(), a.end(), gp.begin());  // the optimizer holds these arrays' pointers
    std::copy(b.begin(), b.end(), gq.begin());
    roundpipe::ParamBuffers t[2];
    t[0].numel = n;
    t[0].param_bf16 = ref_p.data();
    t[0].grad = gp.data();
    t[0].rounding_seed = roundpipe::rounding_seed(77, 0);
    for (int k = 0; k < 2; ++k) {
      t[0].state_format[k] = roundpipe::StateFormat::int8;
      t[0].packed_state[k] = codes[k].data();
      t[0].state_absmax[k] = absmax[k].data();
      t[1].state[k] = qstate[k].data();
    }
    t[0].scalar[0] = &steps[0];
    t[1].numel = 17;
    t[1].param = ref_q.data();
    t[1].grad = gq.data();
    t[1].scalar[0] = &steps[1];
    t[1].rounding_seed = roundpipe::rounding_seed(77, 1);
    roundpipe::adam_step(o, t, 2);
    opt->step();
    if (s == 2) {  // checkpoint and resume in a fresh optimizer
      const roundpipe::ParamState s0 = opt->state(0), s1 = opt->state(1);
      EXPECT_EQ(s0.format[0], roundpipe::StateFormat::int8);
      EXPECT_EQ(s1.format[0], roundpipe::StateFormat::float32);  // below kInt8MinNumel
      opt = std::make_unique<roundpipe::Adam>(o);
      opt->set_state_format(roundpipe::StateFormat::int8);
      opt->set_seed(77);
      opt->add_param({nullptr, p.data(), gp.data(), nullptr, n});
      opt->add_param(q.data(), gq.data(), 17);
      opt->load_state(0, s0);
      opt->load_state(1, s1);
    }
  }
  EXPECT_EQ(p, ref_p);
  EXPECT_EQ(q, ref_q);
  EXPECT_EQ(opt->state(0).codes[0], codes[0]);
  EXPECT_EQ(opt->state(0).absmax[1], absmax[1]);
  // every format reads back as float32; converting to float32 keeps those values
  std::vector<float> m(n);
  roundpipe::dequantize_blockwise(codes[0].data(), absmax[0].data(), n, true, m.data());
  EXPECT_EQ(opt->state_values(0, 0), m);
  opt->set_state_format(roundpipe::StateFormat::float32);
  EXPECT_EQ(opt->state(0).format[0], roundpipe::StateFormat::float32);
  EXPECT_EQ(opt->state(0).state[0], m);
  opt->set_state_format(roundpipe::StateFormat::bfloat16);
  EXPECT_EQ(opt->state(1).bf16[1].size(), 17u);
  const std::vector<float> bf = opt->state_values(1, 1);
  for (std::size_t i = 0; i < 17; ++i) EXPECT_NEAR(bf[i], qstate[1][i], 0.01 * qstate[1][i]);
}

TEST(Optimizer, CompactStateErrors) {
  roundpipe::ASGD asgd;
  EXPECT_THROW(asgd.set_state_format(roundpipe::StateFormat::int8), roundpipe::Error);
  asgd.set_state_format(roundpipe::StateFormat::bfloat16);  // any algorithm
  std::vector<float> p(4, 1.0f), g(4, 1.0f);
  std::vector<std::uint16_t> g16(4);
  roundpipe::Adam adam;
  EXPECT_THROW(adam.add_param({p.data(), nullptr, g.data(), g16.data(), 4}), roundpipe::Error);
  adam.add_param(p.data(), g.data(), 4);
  roundpipe::ParamState s;
  s.format[0] = s.format[1] = roundpipe::StateFormat::int8;
  s.codes[0].assign(4, 0);
  s.codes[1].assign(4, 0);
  s.absmax[0].assign(2, 0.0f);  // one block expected
  s.absmax[1].assign(1, 0.0f);
  EXPECT_THROW(adam.load_state(0, s), roundpipe::Error);
}

// SGD keeps no step count: with a bfloat16 parameter each step still gets new rounding bits.
TEST(Optimizer, SgdWithBf16ParametersDrawsNewBitsEveryStep) {
  const std::size_t n = 4096;
  std::vector<std::uint16_t> p(n, 0x3f80);
  const std::vector<float> g(n, 1.0f);
  roundpipe::SGDOptions o;
  o.lr = 0x1p-7 / 16;
  roundpipe::SGD opt(o);
  opt.add_param({nullptr, p.data(), g.data(), nullptr, n});
  for (int s = 0; s < 64; ++s) opt.step();
  double mean = 0.0;
  for (std::uint16_t h : p) {
    const std::uint32_t u = std::uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    mean += f;
  }
  EXPECT_NEAR(mean / n, 1.0 - 64 * o.lr, 0.05 * 64 * o.lr);
  EXPECT_EQ(opt.state(0).rounding_steps, 64u);
}

namespace {

// A refused step (an option out of range) modifies nothing: no state is created and the rounding
// counter does not advance, so the following steps equal those of an optimizer never refused.
TEST(Optimizer, ARefusedStepChangesNothing) {
  const std::size_t n = 4096;
  std::mt19937 rng(5);
  const std::vector<float> g = rptest::randn(n, rng);
  std::vector<std::uint16_t> p(n, 0x3f80), q(n, 0x3f80);
  roundpipe::SGDOptions o;
  o.lr = 1e-3;
  o.momentum = 0.9;
  roundpipe::SGD refused(o), plain(o);
  refused.set_state_format(roundpipe::StateFormat::bfloat16);
  plain.set_state_format(roundpipe::StateFormat::bfloat16);
  refused.add_param({nullptr, p.data(), g.data(), nullptr, n});
  plain.add_param({nullptr, q.data(), g.data(), nullptr, n});
  refused.options().lr = -1;
  EXPECT_THROW(refused.step(), roundpipe::Error);
  EXPECT_EQ(refused.state(0).rounding_steps, 0u);
  EXPECT_EQ(refused.state(0).size(roundpipe::SGDState::momentum_buffer), 0u);
  EXPECT_EQ(p, q);
  refused.options().lr = 1e-3;
  for (int s = 0; s < 3; ++s) {
    refused.step();
    plain.step();
  }
  EXPECT_EQ(p, q);
  EXPECT_EQ(refused.state_values(0, roundpipe::SGDState::momentum_buffer),
            plain.state_values(0, roundpipe::SGDState::momentum_buffer));
  EXPECT_EQ(refused.state(0).rounding_steps, 3u);
}

// Two threads stepping one optimizer from its first step (state created by the step): the
// steps run one after the other, as two steps on one thread (was a crash: state created twice
// concurrently). Large parameters (their state takes a while to create) and a common start
// make the overlap near-certain without the lock.
TEST(Optimizer, TwoThreadsSteppingOneOptimizerRunOneAfterTheOther) {
  std::mt19937 rng(6);
  const std::size_t n = std::size_t{1} << 20;
  const std::vector<float> p0 = rptest::randn(n, rng), g = rptest::randn(n, rng);
  roundpipe::AdamOptions o;
  o.lr = 1e-2;
  std::vector<float> ref = p0;
  roundpipe::Adam sequential(o);
  sequential.add_param(ref.data(), g.data(), n);
  sequential.step();
  sequential.step();
  for (int round = 0; round < 12; ++round) {
    std::vector<std::vector<float>> ps(3, p0);
    roundpipe::Adam opt(o);
    opt.set_state_format(round % 2 ? roundpipe::StateFormat::bfloat16
                                   : roundpipe::StateFormat::float32);
    for (auto& p : ps) opt.add_param(p.data(), g.data(), n);
    std::atomic<int> ready{0};
    auto run = [&] {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      opt.step();
    };
    std::thread a(run), b(run);
    a.join();
    b.join();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      EXPECT_EQ(opt.state(i).scalar[roundpipe::AdamState::step], 2.0f);
      if (round % 2 == 0) {
        ASSERT_EQ(ps[i], ref) << "round " << round << ", param " << i;
      }
    }
  }
}

}  // namespace
