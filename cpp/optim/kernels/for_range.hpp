// Loop driver shared by all kernels: full vectors of the ISA's Vec, then the tail one element at
// a time with Scalar. `body(V{}, i)` handles elements [i, i + V::width). Also the tensor ops
// several kernels share.
#pragma once
#ifndef ROUNDPIPE_ISA_NS
#error "define ROUNDPIPE_ISA_NS before including a kernel body"
#endif
#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "../prefetch.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

template <class Body>
inline void for_range(std::size_t begin, std::size_t end, Body&& body) {
  std::size_t i = begin;
  for (; i + Vec::width <= end; i += Vec::width) body(Vec{}, i);
  for (; i < end; ++i) body(Scalar{}, i);
}

// The sum over [begin, end) of body(V{}, i) (the lane sums of the V it returns), in double:
// float lanes in kWays independent accumulators (one chain of dependent adds would wait an add's
// latency per vector: Adafactor's read-only passes ran at ~60% of the bandwidth), each block of
// at most kBlock vectors added into the double total, then the tail one element at a time; a
// fixed order for given [begin, end). `body` is called in element order.
template <class Body>
inline double sum_range(std::size_t begin, std::size_t end, Body&& body) {
  constexpr std::size_t kWays = 4, kBlock = 256, W = Vec::width;
  double total = 0.0;
  std::size_t i = begin;
  while (i + W <= end) {
    Vec acc[kWays] = {Vec::set1(0.0f), Vec::set1(0.0f), Vec::set1(0.0f), Vec::set1(0.0f)};
    const std::size_t stop = i + std::min(kBlock * W, (end - i) / W * W);
    for (; i + kWays * W <= stop; i += kWays * W)
      for (std::size_t k = 0; k < kWays; ++k) acc[k] = acc[k] + body(Vec{}, i + k * W);
    for (; i < stop; i += W) acc[0] = acc[0] + body(Vec{}, i);
    float lanes[W];
    ((acc[0] + acc[1]) + (acc[2] + acc[3])).store(lanes);
    for (float l : lanes) total += l;
  }
  Scalar tail{0.0f};
  for (; i < end; ++i) tail = tail + body(Scalar{}, i);
  return total + tail.v;
}

// Software prefetch of each array a kernel streams through, detail::g_prefetch_elements elements
// ahead of i (in the vector body only; 0: none). The hardware prefetchers follow the streams
// too, but a kernel busy with divisions and square roots issues its loads late: without this,
// the division-heavy kernels (NAdam, RAdam, Adam, Adadelta, RMSprop) ran at 84-90% of the
// traffic floor with AVX-512 and Rprop at 78% with AVX2 on a Xeon, and 2 KiB ahead per float32
// stream brought every kernel to 92-102% there (16M elements, 1 thread). The best distance
// depends on the CPU, so it is chosen where the library runs (roundpipe/tuning.hpp: the
// environment, or a calibration by the first large steps); a prefetch changes no result.
// Prefetching past an array's end is harmless (a prefetch never faults).
template <class V, class... P>
inline void prefetch_streams(std::size_t i, const P*... arrays) {
  if constexpr (std::is_same_v<V, Vec>) {
    const std::size_t ahead = detail::g_prefetch_elements;
    if (ahead != 0) (__builtin_prefetch(arrays + i + ahead), ...);
  }
}

// The accumulator of lane type V: a reduction keeps one for the vector body and one for the tail.
template <class V>
inline V& lane_acc(Vec& vec_acc, Scalar& scalar_acc) {
  if constexpr (std::is_same_v<V, Vec>) return vec_acc;
  else return scalar_acc;
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
