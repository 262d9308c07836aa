// The memory-traffic floor of an optimizer step, for benchmarks.
//
// stream_step moves exactly the bytes of a step that keeps `states` float32 state arrays per
// parameter: it reads param, grad and each state array and writes param and each state array
// (4 * (2 * states + 3) bytes per element; Adam, with 2 states, moves 28), with one addition
// per element and no other arithmetic, through the same ISA dispatch, chunking and worker pool
// as the optimizers. An optimizer step as fast as stream_step runs at the machine's memory
// bandwidth for its byte count. The values it writes are meaningless.
#pragma once
#include <array>
#include <cstddef>

#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {

struct StreamOptions {
  int states = 2;  ///< state arrays read and written per parameter, in [0, ParamBuffers::kMaxState]

  /// Calls f(name, member pointer) for every field above, in order (for generic code such
  /// as the Python bindings).
  template <class F>
  static void for_each_field(F&& f) {
    f("states", &StreamOptions::states);
  }
};

/// ParamBuffers slots for stream_step: the first `states` state arrays, no scalars.
struct StreamState {
  static constexpr auto state_names = std::array{"state0", "state1", "state2"};
  static constexpr std::array<const char*, 0> scalar_names{};
};

/// Streams over `count` tensors: for each element, s = param + grad + state[0..states), then
/// param and every state[k] are set to s. Throws roundpipe::Error if `states` is out of range or
/// a needed pointer is null.
void stream_step(const StreamOptions& options, const ParamBuffers* tensors, std::size_t count,
                 StepIO* io = nullptr);

}  // namespace roundpipe
