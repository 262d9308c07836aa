// What generic code needs to know of an algorithm's State struct (roundpipe/<name>.hpp),
// derived from its state_names / scalar_names / int8_signed: whether it counts steps, and which
// state slots may be int8 and with which map. Used by the kernels (cpp/optim), the
// Optimizer<Options> class template and the Python bindings; namespace detail: not an API of
// its own.
#pragma once
#include <cstddef>
#include <string_view>
#include <type_traits>

namespace roundpipe {
namespace detail {

// Scalar slot 0 is the step count (every algorithm but SGD).
template <class State>
constexpr bool counts_steps() {
  if constexpr (State::scalar_names.size() == 0) return false;
  else return std::string_view(State::scalar_names[0]) == "step";
}

// A State that lists `int8_signed` (one bool per state slot: the slot's values take either sign)
// allows int8 state; the others do not.
template <class State, class = void>
struct Int8Slots {
  static constexpr bool allowed = false;
  static constexpr unsigned nonnegative = 0;
};
template <class State>
struct Int8Slots<State, std::void_t<decltype(State::int8_signed)>> {
  static constexpr bool allowed = true;
  static constexpr unsigned nonnegative = [] {
    unsigned mask = 0;
    for (std::size_t k = 0; k < State::int8_signed.size(); ++k)
      if (!State::int8_signed[k]) mask |= 1u << k;
    return mask;
  }();
};

// Bit k set: slot k is non-negative (int8: the unsigned dynamic map).
template <class State>
constexpr unsigned nonnegative_slots() { return Int8Slots<State>::nonnegative; }

}  // namespace detail
}  // namespace roundpipe
