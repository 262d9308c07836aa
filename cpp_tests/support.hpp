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

}  // namespace rptest
