// Optimizer objects for C++ trainers: own the state of a set of caller-owned parameter buffers.
//
//   roundpipe::Adam opt({/*lr=*/1e-3});            // any <Name>Options, torch.optim's names
//   opt.add_param(weights.data(), grads.data(), weights.size());
//   for (...) { compute grads; opt.step(); }
//
// Each step is one call of the algorithm's stateless step function (e.g. roundpipe::adam_step)
// over all parameters: one parallel region, the active ISA. State is allocated and initialised
// as the matching torch.optim class does (zeros, or the algorithm's own start values), and can be
// exported and imported for checkpoints (`state(i)`, `load_state(i, ...)`): a resumed optimizer
// continues exactly where the saved one stopped.
#pragma once
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/buffers.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/threads.hpp"

namespace roundpipe {

/// Specialised for each algorithm in roundpipe/optimizers.hpp:
///   static constexpr const char* name;                     e.g. "Adam"
///   static void step(const Options&, const ParamBuffers*, std::size_t, StepIO*);
///   static bool uses_state(const Options&, int slot);      which state slots the options need
///   static void init(const Options&, ParamBuffers& t);     fills a new tensor's state (arrays
///                                                          of t.numel elements, already zeroed)
template <class Options>
struct AlgorithmTraits;

/// The state of one parameter: the algorithm's per-element arrays (empty where a slot is unused)
/// and its 0-dim values (scalar[0] is the step count where the algorithm has one). Slot meanings
/// are the algorithm's <Name>State enum, e.g. AdamState::exp_avg.
struct ParamState {
  std::vector<float> state[ParamBuffers::kMaxState];
  float scalar[ParamBuffers::kMaxScalar] = {};
};

template <class Options>
class Optimizer {
  using Traits = AlgorithmTraits<Options>;

 public:
  /// Options are checked by every step(), as the stateless step function checks them.
  explicit Optimizer(const Options& options = Options{}) : options_(options) {}

  /// Registers a parameter: `param` (updated in place by step()) and `grad` (read by step()),
  /// both float32 arrays of `numel` elements owned by the caller and alive while the optimizer
  /// is used. State is created on the first step() as torch does. Returns the parameter's index.
  /// Throws roundpipe::Error for a null pointer with numel > 0.
  std::size_t add_param(float* param, const float* grad, std::size_t numel) {
    if (numel != 0 && (!param || !grad))
      throw Error(std::string(Traits::name) + "::add_param: " + (param ? "grad" : "param") +
                  " is null (numel " + std::to_string(numel) + ")");
    Param p;
    p.param = param;
    p.grad = grad;
    p.numel = numel;
    params_.push_back(std::move(p));
    return params_.size() - 1;
  }

  /// One optimization step over all parameters (their grads as they are now). Throws
  /// roundpipe::Error for an out-of-range option; nothing is modified then.
  void step() {
    std::vector<ParamBuffers> buffers(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (!p.initialised) init(p);
      ParamBuffers& t = buffers[i];
      t.param = p.param;
      t.grad = p.grad;
      t.numel = p.numel;
      for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
        if (Traits::uses_state(options_, k) && p.state.state[k].size() != p.numel)
          p.state.state[k].assign(p.numel, 0.0f);  // e.g. amsgrad switched on later
        t.state[k] = p.state.state[k].empty() ? nullptr : p.state.state[k].data();
      }
      for (int k = 0; k < ParamBuffers::kMaxScalar; ++k) t.scalar[k] = &p.state.scalar[k];
    }
    ThreadCountScope threads(num_threads_);
    Traits::step(options_, buffers.data(), buffers.size());
  }

  /// Threads this optimizer's steps use (0, the default: roundpipe::num_threads()). Throws
  /// roundpipe::Error unless n is in [0, 1024].
  void set_num_threads(int n) {
    ThreadCountScope check(n);
    num_threads_ = n;
  }
  int num_threads() const { return num_threads_; }

  /// The hyperparameters; changes apply from the next step (e.g. a learning-rate schedule).
  Options& options() { return options_; }
  const Options& options() const { return options_; }

  std::size_t num_params() const { return params_.size(); }

  /// Parameter i's state (empty arrays before its first step). Throws roundpipe::Error if i is
  /// out of range.
  const ParamState& state(std::size_t i) const { return at(i).state; }

  /// Replaces parameter i's state, e.g. from a checkpoint. Every array the options use must
  /// hold numel elements. Throws roundpipe::Error otherwise, before changing anything.
  void load_state(std::size_t i, const ParamState& s) {
    Param& p = at(i);
    for (int k = 0; k < ParamBuffers::kMaxState; ++k)
      if (Traits::uses_state(options_, k) && s.state[k].size() != p.numel)
        throw Error(std::string(Traits::name) + "::load_state: state slot " + std::to_string(k) +
                    " of param " + std::to_string(i) + " has " +
                    std::to_string(s.state[k].size()) + " elements, expected " +
                    std::to_string(p.numel));
    p.state = s;
    p.initialised = true;
  }

 private:
  struct Param {
    float* param = nullptr;
    const float* grad = nullptr;
    std::size_t numel = 0;
    ParamState state;
    bool initialised = false;
  };

  Param& at(std::size_t i) {
    if (i >= params_.size())
      throw Error(std::string(Traits::name) + ": param index " + std::to_string(i) +
                  " out of range (" + std::to_string(params_.size()) + " params)");
    return params_[i];
  }
  const Param& at(std::size_t i) const { return const_cast<Optimizer*>(this)->at(i); }

  void init(Param& p) {
    ParamBuffers t;
    t.numel = p.numel;
    for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
      if (Traits::uses_state(options_, k)) p.state.state[k].assign(p.numel, 0.0f);
      t.state[k] = p.state.state[k].empty() ? nullptr : p.state.state[k].data();
    }
    for (int k = 0; k < ParamBuffers::kMaxScalar; ++k) t.scalar[k] = &p.state.scalar[k];
    Traits::init(options_, t);
    p.initialised = true;
  }

  Options options_;
  int num_threads_ = 0;  // 0: roundpipe::num_threads()
  std::vector<Param> params_;
};

}  // namespace roundpipe
