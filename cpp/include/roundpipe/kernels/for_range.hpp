// Loop driver shared by all kernels: full vectors of the ISA's Vec, then the tail one element at
// a time with Scalar. `body(V{}, i)` handles elements [i, i + V::width).
#pragma once
#ifndef ROUNDPIPE_ISA_NS
#error "define ROUNDPIPE_ISA_NS before including a roundpipe kernel"
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

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
