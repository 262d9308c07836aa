// Loop driver shared by all kernels: full vectors of the ISA's Vec, then the tail one element at
// a time with Scalar. `body(V{}, i)` handles elements [i, i + V::width). Also the tensor ops
// several kernels share.
#pragma once
#ifndef ROUNDPIPE_ISA_NS
#error "define ROUNDPIPE_ISA_NS before including a kernel body"
#endif
#include <cstddef>

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

template <class Body>
inline void for_range(std::size_t begin, std::size_t end, Body&& body) {
  std::size_t i = begin;
  for (; i + Vec::width <= end; i += Vec::width) body(Vec{}, i);
  for (; i < end; ++i) body(Scalar{}, i);
}

// torch's start.lerp_(end, w) as ATen's vectorized kernel computes it, given the coefficient
// and branch from detail::lerp_coeff (cpp/optim/check.hpp): fmadd(w, end - start, start) when
// |w| < 0.5, else fmadd(w - 1, end - start, end).
template <class V>
inline V torch_lerp(V start, V end, float coeff, bool from_end) {
  return fmadd(V::set1(coeff), end - start, from_end ? end : start);
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
