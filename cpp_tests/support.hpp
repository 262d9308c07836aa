// Shared test helpers: the tail sizes every kernel is run on, the ISA loop, random data and the
// comparison against a float64 reference.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/optim.hpp"

namespace rptest {

inline bool quick() {
  const char* q = std::getenv("ROUNDPIPE_TEST_QUICK");
  return q && *q && std::string(q) != "0";
}

// Sizes that hit every vector-width tail (1, 4, 8, 16 lanes) and chunk boundaries; the
// multi-million size is left out in quick (emulated) runs.
inline std::vector<std::size_t> sizes() {
  std::vector<std::size_t> s = {0, 1, 7, 15, 16, 17, 63, 1023, 4097, 16384 + 33};
  if (!quick()) s.push_back(3'000'017);
  return s;
}

// Runs fn once per ISA this CPU supports, with that ISA forced; restores the previous ISA.
template <class Fn>
void for_each_isa(Fn&& fn) {
  const roundpipe::Isa before = roundpipe::active_isa();
  for (roundpipe::Isa isa : roundpipe::supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + roundpipe::isa_name(isa));
    roundpipe::set_isa(isa);
    fn(isa);
  }
  roundpipe::set_isa(before);
}

inline std::vector<float> randn(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// |got - want| <= atol + rtol * |want| elementwise; reports the first few failures.
inline void expect_close(const std::vector<float>& got, const std::vector<double>& want,
                         const char* what, double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = (std::isnan(g) && std::isnan(w)) || std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok && reported++ < 5) ADD_FAILURE() << what << "[" << i << "] = " << g << ", want " << w;
  }
}

// One tensor's float32 buffers as a caller of the library owns them.
struct Host {
  std::vector<float> param;
  std::vector<float> state[roundpipe::ParamBuffers::kMaxState];
  float scalar[roundpipe::ParamBuffers::kMaxScalar] = {};

  roundpipe::ParamBuffers view(const std::vector<float>& grad) {
    roundpipe::ParamBuffers t;
    t.param = param.data();
    t.grad = grad.data();
    for (int k = 0; k < roundpipe::ParamBuffers::kMaxState; ++k)
      t.state[k] = state[k].empty() ? nullptr : state[k].data();
    for (int k = 0; k < roundpipe::ParamBuffers::kMaxScalar; ++k) t.scalar[k] = &scalar[k];
    t.numel = param.size();
    return t;
  }
};

template <class Options>
using StepFn = void (*)(const Options&, const roundpipe::ParamBuffers*, std::size_t);

inline std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// Runs `steps` steps of `step` on a random tensor of n elements and the same steps of the
// float64 reference `Ref`, then compares the parameter, the state slots `slots` and the scalar
// slots `scalar_slots`. Ref is written separately in each test from the algorithm's definition:
//   Ref(const std::vector<float>& p0, const Options&)   initial state as the algorithm defines
//   void update(const std::vector<float>& grad)         one step in double
//   std::vector<double> param, state[k]; double scalar[k];
// The library's buffers start from the reference's initial state, rounded to float32.
// Gradients alternate between a scale of 3 and 1e-3 so large and tiny values both occur.
template <class Ref, class Options>
void compare_with_reference(StepFn<Options> step, const Options& o, std::size_t n, int steps,
                            std::vector<int> slots, std::vector<int> scalar_slots,
                            const char* const* slot_names, double rtol = 1e-5,
                            double atol = 1e-6) {
  std::mt19937 rng(1234 + static_cast<unsigned>(n));
  const std::vector<float> p0 = randn(n, rng);
  Ref ref(p0, o);
  Host host;
  host.param = p0;
  for (int k = 0; k < roundpipe::ParamBuffers::kMaxState; ++k) host.state[k] = to_float(ref.state[k]);
  for (int k = 0; k < roundpipe::ParamBuffers::kMaxScalar; ++k)
    host.scalar[k] = static_cast<float>(ref.scalar[k]);
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> g = randn(n, rng, s % 2 ? 1e-3f : 3.0f);
    const roundpipe::ParamBuffers t = host.view(g);
    step(o, &t, 1);
    ref.update(g);
  }
  expect_close(host.param, ref.param, "param", rtol, atol);
  for (int k : slots) expect_close(host.state[k], ref.state[k], slot_names[k], rtol, atol);
  for (int k : scalar_slots)
    EXPECT_NEAR(host.scalar[k], ref.scalar[k], atol + rtol * std::fabs(ref.scalar[k]))
        << "scalar slot " << k;
}

}  // namespace rptest
