// The streaming floor kernel (roundpipe/stream.hpp): reads param, grad and `states` state
// arrays, writes their sum to param and the state arrays.
#pragma once
#include <cstddef>

#include "roundpipe/stream.hpp"

namespace roundpipe {
namespace detail {

struct StreamCoeffs {
  int states;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

template <int States>
inline void stream_kernel_n(const ParamBuffers& t, std::size_t begin, std::size_t end) {
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param, t.grad);
    for (int k = 0; k < States; ++k) prefetch_streams<V>(i, t.state[k]);
    V s = V::load(t.param + i) + V::load(t.grad + i);
    for (int k = 0; k < States; ++k) s = s + V::load(t.state[k] + i);
    s.store(t.param + i);
    for (int k = 0; k < States; ++k) s.store(t.state[k] + i);
  });
}

inline void stream_kernel(detail::StreamCoeffs c, ParamBuffers t, std::size_t begin,
                          std::size_t end) {
  switch (c.states) {
    case 0: return stream_kernel_n<0>(t, begin, end);
    case 1: return stream_kernel_n<1>(t, begin, end);
    case 2: return stream_kernel_n<2>(t, begin, end);
    default: return stream_kernel_n<3>(t, begin, end);
  }
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
