// The optimizer classes for C++ trainers: roundpipe::Adam and its siblings, each an
// Optimizer<Options> (roundpipe/optimizer.hpp) that owns its state. Each class's traits say
// which state slots its options use and how torch.optim initialises them.
#pragma once
#include <cstddef>

#include "roundpipe/adam.hpp"
#include "roundpipe/optimizer.hpp"

namespace roundpipe {

template <>
struct AlgorithmTraits<AdamOptions> {
  static constexpr const char* name = "Adam";
  static void step(const AdamOptions& o, const ParamBuffers* t, std::size_t n) { adam_step(o, t, n); }
  static bool uses_state(const AdamOptions& o, int slot) {
    return slot < AdamState::max_exp_avg_sq || (slot == AdamState::max_exp_avg_sq && o.amsgrad);
  }
  static void init(const AdamOptions&, ParamBuffers&) {}  // zeros, step 0
};

/// Adam that owns its state (see roundpipe/optimizer.hpp); matches torch.optim.Adam.
using Adam = Optimizer<AdamOptions>;

}  // namespace roundpipe
