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
//
// Compact storage (roundpipe/compact.hpp): parameters may be bfloat16 arrays (add_param with a
// std::uint16_t* parameter: stepped in float32, stored with stochastic rounding), and the state
// may be kept as bfloat16 or, where the algorithm allows it, int8 (set_state_format). The
// rounding bits come from set_seed's seed, the parameter's index and its step count.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/buffers.hpp"
#include "roundpipe/compact.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/state_traits.hpp"
#include "roundpipe/threads.hpp"

namespace roundpipe {

/// Specialised for each algorithm in roundpipe/optimizer_classes.hpp:
///   static constexpr const char* name;                     e.g. "Adam"
///   using State = ...;                                     its slot names, e.g. AdamState
///   static void step(const Options&, const ParamBuffers*, std::size_t, StepIO*);
///   static bool uses_state(const Options&, int slot);      which state slots the options need
///   static void init(const Options&, ParamBuffers& t);     fills a new tensor's state (arrays
///                                                          of t.numel elements, already zeroed)
/// and optionally
///   static std::size_t state_numel(int slot, std::size_t numel, std::size_t rows,
///                                  std::size_t cols);      elements of a slot (default numel;
///                                                          Adafactor's factors are smaller)
/// What is known from State alone (whether scalar slot 0 counts steps, which slots may be int8)
/// is read from it (roundpipe/state_traits.hpp), not repeated here.
template <class Options>
struct AlgorithmTraits;

/// The state of one parameter: the algorithm's per-element arrays (empty where a slot is unused)
/// and its 0-dim values (scalar[0] is the step count where the algorithm has one). Slot meanings
/// are the algorithm's <Name>State enum, e.g. AdamState::exp_avg. A slot stored compactly
/// (format[k], roundpipe/compact.hpp) keeps its values in bf16[k] (bfloat16 bit patterns) or in
/// codes[k] and absmax[k] (int8) instead of state[k].
struct ParamState {
  std::vector<float> state[ParamBuffers::kMaxState];
  float scalar[ParamBuffers::kMaxScalar] = {};
  StateFormat format[ParamBuffers::kMaxState] = {};
  std::vector<std::uint16_t> bf16[ParamBuffers::kMaxState];
  std::vector<std::uint8_t> codes[ParamBuffers::kMaxState];
  std::vector<float> absmax[ParamBuffers::kMaxState];
  /// Steps taken, for the rounding bits of an algorithm without a step count (SGD).
  std::uint64_t rounding_steps = 0;

  /// Elements held by slot k in whichever format it has.
  std::size_t size(int k) const {
    return format[k] == StateFormat::float32 ? state[k].size()
           : format[k] == StateFormat::bfloat16 ? bf16[k].size()
                                                : codes[k].size();
  }
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
    std::lock_guard<std::mutex> lock(mutex_.m);
    return add(param, nullptr, grad, nullptr, numel);
  }

  /// The arrays of one parameter for add_param(const ParamArrays&): the parameter as float32
  /// (`param`) or bfloat16 (`param_bf16`, bit patterns: step() reads it, updates it in float32
  /// and stores it back with stochastic rounding; no float32 copy exists), the gradient as
  /// float32 (`grad`) or bfloat16 (`grad_bf16`), one of each.
  struct ParamArrays {
    float* param = nullptr;
    std::uint16_t* param_bf16 = nullptr;
    const float* grad = nullptr;
    const std::uint16_t* grad_bf16 = nullptr;
    std::size_t numel = 0;
    std::size_t rows = 0, cols = 0;  ///< a tensor of >= 2 dimensions: its last two sizes (Adafactor)
  };

  /// As add_param(param, grad, numel), with a bfloat16 parameter or gradient allowed. Throws
  /// roundpipe::Error unless exactly one parameter and one gradient array are given (numel > 0),
  /// or when rows and cols are given (either nonzero) with numel > 0 and one of them is 0 or
  /// rows * cols does not divide numel.
  std::size_t add_param(const ParamArrays& a) {
    if (a.numel != 0 && ((a.param && a.param_bf16) || (a.grad && a.grad_bf16)))
      throw Error(std::string(Traits::name) + "::add_param: give one parameter array and one "
                  "gradient array");
    if ((a.rows || a.cols) && a.numel != 0 && (a.rows == 0 || a.cols == 0))
      throw Error(std::string(Traits::name) + "::add_param: rows (" + std::to_string(a.rows) +
                  ") and cols (" + std::to_string(a.cols) + ") must both be nonzero for a "
                  "parameter of " + std::to_string(a.numel) + " elements (or both 0: a vector)");
    if ((a.rows || a.cols) && a.rows * a.cols != 0 && a.numel % (a.rows * a.cols) != 0)
      throw Error(std::string(Traits::name) + "::add_param: rows * cols does not divide numel");
    std::lock_guard<std::mutex> lock(mutex_.m);
    const std::size_t i = add(a.param, a.param_bf16, a.grad, a.grad_bf16, a.numel);
    params_[i].rows = a.rows;
    params_[i].cols = a.cols;
    return i;
  }

  /// How state is stored: float32 (the default), bfloat16 (rounded stochastically) or int8
  /// (blockwise; only algorithms whose State lists `int8_signed`, and only parameters of at
  /// least kInt8MinNumel elements: smaller ones keep float32). Existing state is converted.
  /// Throws roundpipe::Error for int8 where the algorithm does not allow it.
  void set_state_format(StateFormat format) {
    if (format == StateFormat::int8 && !int8_allowed())
      throw Error(std::string(Traits::name) + "::set_state_format: int8 state is not supported "
                  "by this algorithm (float32 or bfloat16)");
    if (format != StateFormat::float32 && format != StateFormat::bfloat16 &&
        format != StateFormat::int8)
      throw Error(std::string(Traits::name) + "::set_state_format: not a StateFormat");
    std::lock_guard<std::mutex> lock(mutex_.m);
    format_ = format;
    for (std::size_t i = 0; i < params_.size(); ++i)
      for (int k = 0; k < ParamBuffers::kMaxState; ++k)
        if (params_[i].state.size(k) != 0) convert(i, k, format_for(params_[i].numel));
  }
  StateFormat state_format() const { return format_; }

  /// Seed of the stochastic rounding (bfloat16 parameters and state); default 0.
  void set_seed(std::uint64_t seed) { seed_ = seed; }
  std::uint64_t seed() const { return seed_; }

  /// One optimization step over all parameters (their grads as they are now). Throws
  /// roundpipe::Error for an out-of-range option; nothing is modified then (no state is
  /// created, no rounding counter advances). Steps called from several threads on one
  /// optimizer run one after the other (so do add_param, set_state_format and load_state).
  void step() {
    std::lock_guard<std::mutex> lock(mutex_.m);
    // The options first, with no tensors: the step function checks them before anything else,
    // so a refused step leaves the state as it was.
    Traits::step(options_, nullptr, 0);
    std::vector<ParamBuffers> buffers(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (!p.initialised) init(p);
      ParamBuffers& t = buffers[i];
      t.param = p.param;
      t.param_bf16 = p.param_bf16;
      t.grad = p.grad;
      t.grad16 = p.grad16;
      t.numel = p.numel;
      t.rows = p.rows;
      t.cols = p.cols;
      for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
        if (Traits::uses_state(options_, k) && p.state.size(k) != slot_numel(k, p))
          allocate(p, k);  // e.g. amsgrad switched on later
        view_slot(p.state, k, t);
      }
      for (int k = 0; k < ParamBuffers::kMaxScalar; ++k) t.scalar[k] = &p.state.scalar[k];
      t.rounding_seed = rounding_seed(seed_, i);
      if (!detail::counts_steps<typename Traits::State>() &&
          (t.param_bf16 || compact_state(p.state)))
        t.rounding_seed = rounding_seed(t.rounding_seed, ++p.state.rounding_steps);
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
    std::lock_guard<std::mutex> lock(mutex_.m);
    Param& p = at(i);
    for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
      const bool bad_format = s.format[k] == StateFormat::int8
                                  ? !int8_allowed() || s.absmax[k].size() != quant_blocks(p.numel)
                                  : s.format[k] != StateFormat::float32 &&
                                        s.format[k] != StateFormat::bfloat16;
      if ((Traits::uses_state(options_, k) && s.size(k) != slot_numel(k, p)) || bad_format)
        throw Error(std::string(Traits::name) + "::load_state: state slot " + std::to_string(k) +
                    " of param " + std::to_string(i) + " has " + std::to_string(s.size(k)) +
                    " elements" + (bad_format ? " in a format this algorithm cannot read" : "") +
                    ", expected " + std::to_string(slot_numel(k, p)));
    }
    p.state = s;
    p.initialised = true;
    for (int k = 0; k < ParamBuffers::kMaxState; ++k)  // into this optimizer's format
      if (p.state.size(k) != 0) convert(i, k, format_for(p.numel));
  }

  /// Slot k of parameter i as float32 values, whatever its format (e.g. to save a checkpoint
  /// that torch.optim reads). Throws roundpipe::Error if i is out of range.
  std::vector<float> state_values(std::size_t i, int k) const {
    const ParamState& s = at(i).state;
    std::vector<float> out(s.size(k));
    if (out.empty()) return out;
    if (s.format[k] == StateFormat::float32) return s.state[k];
    if (s.format[k] == StateFormat::bfloat16) {
      for (std::size_t j = 0; j < out.size(); ++j) {
        const std::uint32_t u = static_cast<std::uint32_t>(s.bf16[k][j]) << 16;
        std::memcpy(&out[j], &u, sizeof u);
      }
    } else {
      dequantize_blockwise(s.codes[k].data(), s.absmax[k].data(), out.size(), is_signed(k),
                           out.data());
    }
    return out;
  }

 private:
  struct Param {
    float* param = nullptr;
    std::uint16_t* param_bf16 = nullptr;
    const float* grad = nullptr;
    const std::uint16_t* grad16 = nullptr;
    std::size_t numel = 0, rows = 0, cols = 0;
    ParamState state;
    bool initialised = false;
  };

  // Elements of slot k of p (Traits::state_numel where the algorithm defines it).
  template <class T>
  static auto slot_numel_of(int k, const Param& p, int)
      -> decltype(T::state_numel(k, p.numel, p.rows, p.cols)) {
    return T::state_numel(k, p.numel, p.rows, p.cols);
  }
  template <class T>
  static std::size_t slot_numel_of(int, const Param& p, long) { return p.numel; }
  static std::size_t slot_numel(int k, const Param& p) { return slot_numel_of<Traits>(k, p, 0); }

  std::size_t add(float* param, std::uint16_t* param_bf16, const float* grad,
                  const std::uint16_t* grad16, std::size_t numel) {
    if (numel != 0 && ((!param && !param_bf16) || (!grad && !grad16)))
      throw Error(std::string(Traits::name) + "::add_param: " +
                  (param || param_bf16 ? "grad" : "param") + " is null (numel " +
                  std::to_string(numel) + ")");
    Param p;
    p.param = param;
    p.param_bf16 = param_bf16;
    p.grad = grad;
    p.grad16 = grad16;
    p.numel = numel;
    params_.push_back(std::move(p));
    return params_.size() - 1;
  }

  static constexpr bool int8_allowed() {
    return detail::Int8Slots<typename Traits::State>::allowed;
  }
  static bool is_signed(int k) {
    if constexpr (int8_allowed()) return Traits::State::int8_signed[k];
    else return true;
  }

  // The format of a parameter of n elements' state.
  StateFormat format_for(std::size_t n) const {
    return format_ == StateFormat::int8 && n < kInt8MinNumel ? StateFormat::float32 : format_;
  }

  static bool compact_state(const ParamState& s) {
    for (StateFormat f : s.format)
      if (f != StateFormat::float32) return true;
    return false;
  }

  // A zeroed slot k in the parameter's format.
  void allocate(Param& p, int k) {
    ParamState& s = p.state;
    const std::size_t n = slot_numel(k, p);
    s.format[k] = format_for(n);
    s.state[k].clear();
    s.bf16[k].clear();
    s.codes[k].clear();
    s.absmax[k].clear();
    if (s.format[k] == StateFormat::float32) s.state[k].assign(n, 0.0f);
    if (s.format[k] == StateFormat::bfloat16) s.bf16[k].assign(n, 0);
    if (s.format[k] == StateFormat::int8) {  // zeros: the code of 0 with any absmax
      s.codes[k].assign(n, static_cast<std::uint8_t>(is_signed(k) ? 127 : 0));
      s.absmax[k].assign(quant_blocks(n), 0.0f);
    }
  }

  static void view_slot(ParamState& s, int k, ParamBuffers& t) {
    t.state_format[k] = s.format[k];
    t.state[k] = s.state[k].empty() ? nullptr : s.state[k].data();
    t.packed_state[k] = s.format[k] == StateFormat::bfloat16 ? static_cast<void*>(s.bf16[k].data())
                        : s.format[k] == StateFormat::int8   ? static_cast<void*>(s.codes[k].data())
                                                             : nullptr;
    t.state_absmax[k] = s.absmax[k].empty() ? nullptr : s.absmax[k].data();
  }

  // Parameter i's slot k, converted to `format`.
  void convert(std::size_t i, int k, StateFormat format) {
    ParamState& s = params_[i].state;
    if (s.format[k] == format) return;
    std::vector<float> values = state_values(i, k);
    s.state[k].clear();
    s.bf16[k].clear();
    s.codes[k].clear();
    s.absmax[k].clear();
    s.format[k] = format;
    if (format == StateFormat::float32) {
      s.state[k] = std::move(values);
    } else if (format == StateFormat::bfloat16) {
      s.bf16[k].resize(values.size());
      round_bf16_stochastic(values.data(), values.size(),
                            rounding_seed(rounding_seed(seed_, i), 1 + k), s.bf16[k].data());
    } else {
      s.codes[k].resize(values.size());
      s.absmax[k].resize(quant_blocks(values.size()));
      quantize_blockwise(values.data(), values.size(), is_signed(k), s.codes[k].data(),
                         s.absmax[k].data());
    }
  }

  Param& at(std::size_t i) {
    if (i >= params_.size())
      throw Error(std::string(Traits::name) + ": param index " + std::to_string(i) +
                  " out of range (" + std::to_string(params_.size()) + " params)");
    return params_[i];
  }
  const Param& at(std::size_t i) const { return const_cast<Optimizer*>(this)->at(i); }

  // New state as torch initialises it (Traits::init on float32 arrays), then in this
  // optimizer's format.
  void init(Param& p) {
    ParamBuffers t;
    t.numel = p.numel;
    for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
      p.state.format[k] = StateFormat::float32;
      if (Traits::uses_state(options_, k)) p.state.state[k].assign(slot_numel(k, p), 0.0f);
      t.state[k] = p.state.state[k].empty() ? nullptr : p.state.state[k].data();
    }
    for (int k = 0; k < ParamBuffers::kMaxScalar; ++k) t.scalar[k] = &p.state.scalar[k];
    Traits::init(options_, t);
    p.initialised = true;
    const std::size_t i = static_cast<std::size_t>(&p - params_.data());
    for (int k = 0; k < ParamBuffers::kMaxState; ++k)
      if (!p.state.state[k].empty()) convert(i, k, format_for(p.numel));
  }

  // A mutex that copies and moves as a new one (the optimizer stays copyable).
  struct Mutex {
    std::mutex m;
    Mutex() = default;
    Mutex(const Mutex&) {}
    Mutex& operator=(const Mutex&) { return *this; }
  };

  Options options_;
  mutable Mutex mutex_;
  StateFormat format_ = StateFormat::float32;
  std::uint64_t seed_ = 0;
  int num_threads_ = 0;  // 0: roundpipe::num_threads()
  std::vector<Param> params_;
};

}  // namespace roundpipe
