// Shared test helpers: the tail sizes every kernel is run on, the ISA loop, random data, the
// comparison against a float64 reference, and the tests every algorithm runs the same way (one
// call over many tensors, thread counts, non-finite gradients, argument errors), each given the
// algorithm as an rptest::Algorithm.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "roundpipe/roundpipe.hpp"

namespace rptest {

inline bool quick() {
  const char* q = std::getenv("ROUNDPIPE_TEST_QUICK");
  return q && *q && std::string(q) != "0";
}

// Sizes that hit every vector-width tail (1, 4, 8, 16 lanes) and chunk boundaries. Quick
// (emulated) runs keep the sizes that exercise the ISA code (vector body and every tail) and
// drop the large ones, whose extra coverage (chunking, threads) is ISA-independent and proven
// by the native run.
inline std::vector<std::size_t> sizes() {
  if (quick()) return {0, 1, 7, 15, 16, 17, 63, 1023};
  return {0, 1, 7, 15, 16, 17, 63, 1023, 4097, 16384 + 33, 3'000'017};
}

// A size of `full` elements natively, `small` in quick (emulated) runs.
inline std::size_t scaled(std::size_t full, std::size_t small) { return quick() ? small : full; }

// Elements a step needs per thread it runs on: a step call over n elements (all its tensors
// together) runs on at most max(1, n / kElementsPerThread) threads. Mirrors
// roundpipe::detail::kElementsPerThread (cpp/optim/parallel.hpp, not a public header);
// Threads.AStepRunsOnOneThreadPerKElementsPerThread fails if the two differ. A test of results
// on several threads needs t * kElementsPerThread elements in one call to run on t of them.
constexpr std::size_t kElementsPerThread = 196608;

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
using StepFn = void (*)(const Options&, const roundpipe::ParamBuffers*, std::size_t,
                        roundpipe::StepIO*);

// What the generic tests below need to know of one algorithm.
template <class Options>
struct Algorithm {
  StepFn<Options> step;
  std::vector<const char*> state_names;   // the per-element state slots, in slot order
  std::vector<const char*> scalar_names;  // the 0-dim state slots; "step" first where it counts
  // A tensor holding p in the state the algorithm starts from (as torch.optim creates it).
  Host (*init)(const std::vector<float>& p, const Options& o);

  // Every algorithm but SGD keeps its step count in scalar slot 0 (roundpipe/buffers.hpp).
  bool counts_steps() const {
    return !scalar_names.empty() && std::string(scalar_names[0]) == "step";
  }
};

// A Host holding p, with state slot k filled with fills[k] (slots past the list absent) and
// scalar slot k set to scalars[k] (the others 0).
inline Host make_host(const std::vector<float>& p, std::initializer_list<float> fills,
                      std::initializer_list<float> scalars = {}) {
  Host h;
  h.param = p;
  int k = 0;
  for (float f : fills) h.state[k++].assign(p.size(), f);
  k = 0;
  for (float s : scalars) h.scalar[k++] = s;
  return h;
}

// "flags=5 {amsgrad, weight_decay}": the names of the set bits, bit 0 first.
inline std::string describe_flags(int flags, std::initializer_list<const char*> bit_names) {
  std::string s = "flags=" + std::to_string(flags) + " {";
  int bit = 0;
  bool first = true;
  for (const char* name : bit_names) {
    if (flags >> bit++ & 1) {
      s += (first ? "" : ", ") + std::string(name);
      first = false;
    }
  }
  return s + "}";
}

// Runs body(n, flags) on every ISA, every size of sizes() and every flags in [0, num_flags),
// the multi-million size only for the flags listed in `big`; traces n and the set bits' names.
template <class Body>
void for_each_case(int num_flags, std::initializer_list<const char*> bit_names,
                   std::initializer_list<int> big, Body&& body) {
  for_each_isa([&](roundpipe::Isa) {
    for (std::size_t n : sizes())
      for (int flags = 0; flags < num_flags; ++flags) {
        if (n > 100000 && std::find(big.begin(), big.end(), flags) == big.end()) continue;
        SCOPED_TRACE("n=" + std::to_string(n) + " " + describe_flags(flags, bit_names));
        body(n, flags);
      }
  });
}

inline std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// Runs `steps` steps of the algorithm on a random tensor of n elements and the same steps of the
// float64 reference `Ref`, then compares the parameter, the state slots `slots` and the scalar
// slots `scalar_slots`. Ref is written separately in each test from the algorithm's definition:
//   Ref(const std::vector<float>& p0, const Options&)   initial state as the algorithm defines
//   void update(const std::vector<float>& grad)         one step in double
//   std::vector<double> param, state[k]; double scalar[k];
// The library's buffers start from the reference's initial state, rounded to float32.
// Gradients alternate between a scale of 3 and 1e-3 so large and tiny values both occur.
template <class Ref, class Options>
void compare_with_reference(const Algorithm<Options>& a, const Options& o, std::size_t n,
                            int steps, std::vector<int> slots, std::vector<int> scalar_slots,
                            double rtol = 1e-5, double atol = 1e-6) {
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
    a.step(o, &t, 1, nullptr);
    ref.update(g);
  }
  expect_close(host.param, ref.param, "param", rtol, atol);
  for (int k : slots) expect_close(host.state[k], ref.state[k], a.state_names.at(k), rtol, atol);
  for (int k : scalar_slots)
    EXPECT_NEAR(host.scalar[k], ref.scalar[k], atol + rtol * std::fabs(ref.scalar[k]))
        << a.scalar_names.at(k);
}

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// got and want hold the same float32 bit patterns (NaN payloads and the sign of zero included):
// what must hold for results that should not depend on how the work was split up.
inline void expect_identical(const std::vector<float>& got, const std::vector<float>& want,
                             const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same_bits(got[i], want[i]) && reported++ < 5)
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i];
}

// Every buffer of got (parameter, all state and scalar slots) is identical to want's.
inline void expect_identical(const Host& got, const Host& want, const std::string& what) {
  expect_identical(got.param, want.param, what + " param");
  for (int k = 0; k < roundpipe::ParamBuffers::kMaxState; ++k)
    expect_identical(got.state[k], want.state[k], what + " state[" + std::to_string(k) + "]");
  for (int k = 0; k < roundpipe::ParamBuffers::kMaxScalar; ++k)
    EXPECT_TRUE(same_bits(got.scalar[k], want.scalar[k]))
        << what << " scalar[" << k << "] = " << got.scalar[k] << ", want " << want.scalar[k];
}

// One step call over several tensors gives what separate calls give, on every ISA: tensors of
// sizes around the vector widths and chunk sizes (and an empty one), each at its own point of the
// schedule (tensor i has taken i steps before, so step-dependent coefficients differ per tensor),
// through `steps` calls with new random gradients each. Compares every buffer; where the
// algorithm counts steps, also that each tensor's count went up by `steps`.
template <class Options>
void expect_one_call_like_separate_calls(const Algorithm<Options>& a, const Options& o,
                                         int steps = 4) {
  for_each_isa([&](roundpipe::Isa) {
    std::mt19937 rng(7);
    std::vector<Host> together, apart;
    std::vector<float> steps_before;
    int i = 0;
    for (std::size_t n : {std::size_t{5}, std::size_t{0}, scaled(40000, 2000), std::size_t{17},
                          scaled(16384, 64), std::size_t{3}}) {
      Host h = a.init(randn(n, rng), o);
      for (int k = 0; k < i; ++k) {
        const std::vector<float> g = randn(n, rng);
        const roundpipe::ParamBuffers t = h.view(g);
        a.step(o, &t, 1, nullptr);
      }
      together.push_back(h);
      apart.push_back(h);
      steps_before.push_back(h.scalar[0]);
      ++i;
    }
    for (int s = 0; s < steps; ++s) {
      std::vector<std::vector<float>> grads;
      for (const Host& h : together) grads.push_back(randn(h.param.size(), rng));
      std::vector<roundpipe::ParamBuffers> ts;
      for (std::size_t j = 0; j < together.size(); ++j) ts.push_back(together[j].view(grads[j]));
      a.step(o, ts.data(), ts.size(), nullptr);
      for (std::size_t j = 0; j < apart.size(); ++j) {
        const roundpipe::ParamBuffers t = apart[j].view(grads[j]);
        a.step(o, &t, 1, nullptr);
      }
    }
    for (std::size_t j = 0; j < together.size(); ++j) {
      expect_identical(together[j], apart[j], "tensor " + std::to_string(j));
      if (a.counts_steps()) {
        EXPECT_EQ(together[j].scalar[0], steps_before[j] + float(steps)) << "tensor " << j;
      }
    }
  });
}

// The thread count changes how the work is split, never the result: `steps` steps on one large
// tensor (the elements for 3 threads), on every ISA, with 1, 2 and 3 threads; every buffer is
// compared. Emulated (quick), 2 steps with 1 and 2 threads (the elements for 2): 3 threads'
// elements and 7 steps took 12 s per algorithm under qemu, 40 times the native run.
template <class Options>
void expect_thread_count_does_not_change_results(const Algorithm<Options>& a, const Options& o,
                                                 int steps = 7) {
  const int before = roundpipe::num_threads();
  const int most = quick() ? 2 : 3;
  if (quick()) steps = std::min(steps, 2);
  std::mt19937 rng(3);
  const std::vector<float> p0 = randn(most * kElementsPerThread + 3, rng);
  std::vector<std::vector<float>> grads;
  for (int k = 0; k < steps; ++k) grads.push_back(randn(p0.size(), rng));
  for_each_isa([&](roundpipe::Isa) {
    std::vector<Host> results;
    for (int threads = 1; threads <= most; ++threads) {
      roundpipe::set_num_threads(threads);
      Host h = a.init(p0, o);
      for (const auto& g : grads) {
        const roundpipe::ParamBuffers t = h.view(g);
        a.step(o, &t, 1, nullptr);
      }
      results.push_back(h);
    }
    for (int threads = 2; threads <= most; ++threads)
      expect_identical(results[threads - 1], results[0],
                       std::to_string(threads) + " threads vs 1:");
  });
  roundpipe::set_num_threads(before);
}

// The software prefetch distance (roundpipe/tuning.hpp) changes when data arrives, never the
// result: `steps` steps on tensors of 40017 elements (chunks, vectors and a tail) and 19, in one
// call, on every ISA, with every candidate distance fixed; every buffer is compared with the
// run without software prefetch. Restores calibration afterwards.
template <class Options>
void expect_prefetch_distance_does_not_change_results(const Algorithm<Options>& a,
                                                      const Options& o, int steps = 3) {
  std::mt19937 rng(5);
  const std::vector<float> p0 = randn(40017, rng), p1 = randn(19, rng);
  std::vector<std::vector<float>> grads0, grads1;
  for (int k = 0; k < steps; ++k) {
    grads0.push_back(randn(p0.size(), rng));
    grads1.push_back(randn(p1.size(), rng));
  }
  for_each_isa([&](roundpipe::Isa) {
    std::vector<Host> results;
    for (std::size_t bytes : roundpipe::kPrefetchCandidates) {
      roundpipe::set_prefetch_distance(bytes);
      std::vector<Host> h{a.init(p0, o), a.init(p1, o)};
      for (int k = 0; k < steps; ++k) {
        const roundpipe::ParamBuffers t[2] = {h[0].view(grads0[k]), h[1].view(grads1[k])};
        a.step(o, t, 2, nullptr);
      }
      results.insert(results.end(), h.begin(), h.end());
    }
    for (std::size_t c = 1; c < std::size(roundpipe::kPrefetchCandidates); ++c)
      for (std::size_t j = 0; j < 2; ++j)
        expect_identical(results[2 * c + j], results[j],
                         std::to_string(roundpipe::kPrefetchCandidates[c]) + " B ahead vs none," +
                             " tensor " + std::to_string(j) + ":");
  });
  roundpipe::calibrate_prefetch();
}

// One step, on every ISA, on 19 elements (a 16-lane vector body and a tail) of parameter 1 in
// the initial state (then changed by prepare(h)) with the gradient 0.5 except NaN at 1 and 17,
// inf at 3 and `tiny` at 18. Checks what holds for every algorithm that passes NaN on: NaN
// reaches the parameter at 1 and 17 (body and tail), and element 16 (the tail) equals element 0
// in the parameter and in every state slot. check(h) then checks the algorithm's own results.
template <class Options, class Prepare, class Check>
void expect_non_finite_gradients_propagate(const Algorithm<Options>& a, const Options& o,
                                           Prepare&& prepare, Check&& check,
                                           float tiny = 1e-20f) {
  for_each_isa([&](roundpipe::Isa) {
    const std::size_t n = 19;
    std::vector<float> g(n, 0.5f);
    g[1] = g[17] = std::numeric_limits<float>::quiet_NaN();
    g[3] = std::numeric_limits<float>::infinity();
    g[18] = tiny;
    Host h = a.init(std::vector<float>(n, 1.0f), o);
    prepare(h);
    const roundpipe::ParamBuffers t = h.view(g);
    a.step(o, &t, 1, nullptr);
    EXPECT_TRUE(std::isnan(h.param[1]));
    EXPECT_TRUE(std::isnan(h.param[17]));
    EXPECT_TRUE(same_bits(h.param[16], h.param[0])) << h.param[16] << " vs " << h.param[0];
    for (int k = 0; k < roundpipe::ParamBuffers::kMaxState; ++k)
      if (!h.state[k].empty()) {
        EXPECT_TRUE(same_bits(h.state[k][16], h.state[k][0]))
            << "state[" << k << "]: " << h.state[k][16] << " vs " << h.state[k][0];
      }
    check(h);
  });
}

template <class Options, class Check>
void expect_non_finite_gradients_propagate(const Algorithm<Options>& a, const Options& o,
                                           Check&& check) {
  expect_non_finite_gradients_propagate(a, o, [](Host&) {}, check);
}

// Argument errors: a step call that must throw roundpipe::Error whose message names `needle`,
// and leave every buffer of the tensor it was given (4 elements in the initial state) unchanged.
template <class Options>
class BadArguments {
 public:
  explicit BadArguments(const Algorithm<Options>& a, const Options& o = {})
      : a_(a), grad_(4, 1.0f), host_(a.init(std::vector<float>(4, 1.0f), o)), before_(host_) {
    tensor_ = host_.view(grad_);
  }
  BadArguments(const BadArguments&) = delete;  // tensor_ points into host_
  BadArguments& operator=(const BadArguments&) = delete;

  // The options alone are bad: one valid tensor.
  void expect_error(const Options& o, const std::string& needle) {
    expect_error(o, &tensor_, 1, needle);
  }

  void expect_error(const Options& o, const roundpipe::ParamBuffers* ts, std::size_t count,
                    const std::string& needle) {
    try {
      a_.step(o, ts, count, nullptr);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    expect_identical(host_, before_, "after the error for " + needle + ":");
  }

  // For each {field, value, name}: the default options with that one field set to value are an
  // error naming it.
  struct BadValue {
    double Options::*field;
    double value;
    const char* name;
  };
  void expect_bad_values(std::initializer_list<BadValue> values) {
    for (const BadValue& v : values) {
      Options o;
      o.*(v.field) = v.value;
      expect_error(o, v.name);
    }
  }

  // With options o, under which the algorithm needs every state and scalar slot it names: each
  // pointer of the second of two tensors (param, grad, every state slot, every scalar slot) set
  // to null is an error naming it ("tensors[1].exp_avg"); so is a null tensor array.
  void expect_null_buffers_named(const Options& o) {
    roundpipe::ParamBuffers ts[2] = {tensor_, tensor_};
    ts[1].param = nullptr;
    expect_error(o, ts, 2, "tensors[1].param");
    ts[1] = tensor_;
    ts[1].grad = nullptr;
    expect_error(o, ts, 2, "tensors[1].grad");
    for (std::size_t k = 0; k < a_.state_names.size(); ++k) {
      ts[1] = tensor_;
      ts[1].state[k] = nullptr;
      expect_error(o, ts, 2, std::string("tensors[1].") + a_.state_names[k]);
    }
    for (std::size_t k = 0; k < a_.scalar_names.size(); ++k) {
      ts[1] = tensor_;
      ts[1].scalar[k] = nullptr;
      expect_error(o, ts, 2, std::string("tensors[1].") + a_.scalar_names[k]);
    }
    expect_error(o, nullptr, 1, "tensors");
  }

 private:
  const Algorithm<Options>& a_;
  std::vector<float> grad_;
  Host host_;
  const Host before_;
  roundpipe::ParamBuffers tensor_;
};

}  // namespace rptest
