// The optimizer classes for C++ trainers: roundpipe::Adam and its siblings, each an
// Optimizer<Options> (the class template in roundpipe/optimizer.hpp) that owns its state. Each
// class's AlgorithmTraits say which state slots its options use and how torch.optim
// initialises them. (Formerly roundpipe/optimizers.hpp, which still forwards here for one
// release.)
#pragma once
#include <cstddef>

#include "roundpipe/adadelta.hpp"
#include "roundpipe/adafactor.hpp"
#include "roundpipe/adagrad.hpp"
#include "roundpipe/adam.hpp"
#include "roundpipe/adamax.hpp"
#include "roundpipe/asgd.hpp"
#include "roundpipe/nadam.hpp"
#include "roundpipe/optimizer.hpp"
#include "roundpipe/radam.hpp"
#include "roundpipe/rmsprop.hpp"
#include "roundpipe/rprop.hpp"
#include "roundpipe/sgd.hpp"

namespace roundpipe {

/// Traits of an algorithm whose first `NumState` state slots are always used and start as
/// zeros, with its 0-dim values (step) starting at 0.
template <class Options, class StateSlots,
          void (*Step)(const Options&, const ParamBuffers*, std::size_t, StepIO*),
          int NumState>
struct ZeroInitTraits {
  using State = StateSlots;
  static void step(const Options& o, const ParamBuffers* t, std::size_t n) { Step(o, t, n, nullptr); }
  static bool uses_state(const Options&, int slot) { return slot < NumState; }
  static void init(const Options&, ParamBuffers&) {}
};

template <>
struct AlgorithmTraits<AdadeltaOptions> : ZeroInitTraits<AdadeltaOptions, AdadeltaState, adadelta_step, 2> {
  static constexpr const char* name = "Adadelta";
};
/// Adadelta that owns its state; matches torch.optim.Adadelta.
using Adadelta = Optimizer<AdadeltaOptions>;

template <>
struct AlgorithmTraits<AdafactorOptions>
    : ZeroInitTraits<AdafactorOptions, AdafactorState, adafactor_step, 3> {
  static constexpr const char* name = "Adafactor";
  // A tensor of >= 2 dimensions (rows, cols given: ParamArrays) keeps the row and column
  // factors, any other the whole variance.
  static std::size_t state_numel(int slot, std::size_t numel, std::size_t rows,
                                 std::size_t cols) {
    const bool factored = rows != 0 || cols != 0;
    if (slot == AdafactorState::variance) return factored ? 0 : numel;
    if (!factored || numel == 0) return 0;
    return slot == AdafactorState::row_var ? numel / cols : numel / rows;
  }
};
/// Adafactor that owns its state; matches torch.optim.Adafactor. Register a tensor of two or
/// more dimensions with add_param(ParamArrays{..., rows, cols}) (its last two sizes) for the
/// factored second moment; add_param(param, grad, numel) makes it a vector.
using Adafactor = Optimizer<AdafactorOptions>;

template <>
struct AlgorithmTraits<AdamaxOptions> : ZeroInitTraits<AdamaxOptions, AdamaxState, adamax_step, 2> {
  static constexpr const char* name = "Adamax";
};
/// Adamax that owns its state; matches torch.optim.Adamax.
using Adamax = Optimizer<AdamaxOptions>;

template <>
struct AlgorithmTraits<ASGDOptions> : ZeroInitTraits<ASGDOptions, ASGDState, asgd_step, 1> {
  static constexpr const char* name = "ASGD";
  static void init(const ASGDOptions& o, ParamBuffers& t) {  // torch: eta = lr, mu = 1
    *t.scalar[ASGDState::eta] = static_cast<float>(o.lr);
    *t.scalar[ASGDState::mu] = 1.0f;
  }
};
/// ASGD that owns its state; matches torch.optim.ASGD.
using ASGD = Optimizer<ASGDOptions>;
/// The old name, kept for one release.
using Asgd [[deprecated("renamed roundpipe::ASGD")]] = ASGD;

template <>
struct AlgorithmTraits<AdamOptions> {
  static constexpr const char* name = "Adam";
  using State = AdamState;
  static void step(const AdamOptions& o, const ParamBuffers* t, std::size_t n) { adam_step(o, t, n); }
  static bool uses_state(const AdamOptions& o, int slot) {
    return slot < AdamState::max_exp_avg_sq || (slot == AdamState::max_exp_avg_sq && o.amsgrad);
  }
  static void init(const AdamOptions&, ParamBuffers&) {}  // zeros, step 0
};

/// Adam that owns its state (see roundpipe/optimizer.hpp); matches torch.optim.Adam.
using Adam = Optimizer<AdamOptions>;
// AdamW is Adam with AdamOptions::decoupled_weight_decay = true (and, as torch.optim.AdamW's
// default, weight_decay = 1e-2).

template <>
struct AlgorithmTraits<NAdamOptions> : ZeroInitTraits<NAdamOptions, NAdamState, nadam_step, 2> {
  static constexpr const char* name = "NAdam";
  static void init(const NAdamOptions&, ParamBuffers& t) { *t.scalar[NAdamState::mu_product] = 1.0f; }
};
/// NAdam that owns its state; matches torch.optim.NAdam.
using NAdam = Optimizer<NAdamOptions>;

template <>
struct AlgorithmTraits<RAdamOptions> : ZeroInitTraits<RAdamOptions, RAdamState, radam_step, 2> {
  static constexpr const char* name = "RAdam";
};
/// RAdam that owns its state; matches torch.optim.RAdam.
using RAdam = Optimizer<RAdamOptions>;

template <>
struct AlgorithmTraits<RpropOptions> : ZeroInitTraits<RpropOptions, RpropState, rprop_step, 2> {
  static constexpr const char* name = "Rprop";
  static void init(const RpropOptions& o, ParamBuffers& t) { rprop_init_state(o, t); }  // step_size = lr
};
/// Rprop that owns its state; matches torch.optim.Rprop.
using Rprop = Optimizer<RpropOptions>;

template <>
struct AlgorithmTraits<SGDOptions> : ZeroInitTraits<SGDOptions, SGDState, sgd_step, 1> {
  static constexpr const char* name = "SGD";
  // The momentum buffer exists only with momentum (torch keeps none otherwise); it is filled by
  // the first step, which the momentum_buffer_ready flag (0 at creation) tells the kernel.
  static bool uses_state(const SGDOptions& o, int slot) {
    return slot == SGDState::momentum_buffer && o.momentum != 0.0;
  }
};
/// SGD that owns its state; matches torch.optim.SGD.
using SGD = Optimizer<SGDOptions>;

template <>
struct AlgorithmTraits<AdagradOptions> : ZeroInitTraits<AdagradOptions, AdagradState, adagrad_step, 1> {
  static constexpr const char* name = "Adagrad";
  static void init(const AdagradOptions& o, ParamBuffers& t) {
    const float v = static_cast<float>(o.initial_accumulator_value);
    for (std::size_t i = 0; i < t.numel; ++i) t.state[AdagradState::sum][i] = v;
  }
};
/// Adagrad that owns its state; matches torch.optim.Adagrad.
using Adagrad = Optimizer<AdagradOptions>;

template <>
struct AlgorithmTraits<RMSpropOptions> : ZeroInitTraits<RMSpropOptions, RMSpropState, rmsprop_step, 1> {
  static constexpr const char* name = "RMSprop";
  static bool uses_state(const RMSpropOptions& o, int slot) {
    return slot == RMSpropState::square_avg ||
           (slot == RMSpropState::momentum_buffer && o.momentum > 0.0) ||
           (slot == RMSpropState::grad_avg && o.centered);
  }
};
/// RMSprop that owns its state; matches torch.optim.RMSprop.
using RMSprop = Optimizer<RMSpropOptions>;

}  // namespace roundpipe
