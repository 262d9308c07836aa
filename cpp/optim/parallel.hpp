// Internal: spreading one step over the worker pool (roundpipe/threads.hpp).
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

#include "roundpipe/buffers.hpp"

namespace roundpipe {
namespace detail {

// Elements per task: a multiple of 16 floats (one 64-byte cache line), small enough to balance
// two to a few dozen threads, large enough that a task's streams stay in flight.
constexpr std::size_t kChunkElements = 16384;

// Runs task(ctx, k) for k in [0, ntasks) on the pool (the caller takes part) and returns when all
// are done. Calls from several threads are serialised.
void run_tasks(std::size_t ntasks, void (*task)(void* ctx, std::size_t k), void* ctx);

// Calls fn(tensor, begin, end) over the elements [0, numel(tensor)) of tensors [0, count), cut
// into chunks of kChunkElements at chunk-aligned offsets, in parallel.
template <class NumelFn, class Fn>
void for_each_chunk(std::size_t count, NumelFn&& numel, Fn&& fn) {
  std::vector<std::size_t> first_chunk(count + 1, 0);
  for (std::size_t t = 0; t < count; ++t)
    first_chunk[t + 1] = first_chunk[t] + (numel(t) + kChunkElements - 1) / kChunkElements;
  struct Ctx {
    const std::vector<std::size_t>* first_chunk;
    NumelFn* numel;
    Fn* fn;
  } ctx{&first_chunk, &numel, &fn};
  run_tasks(first_chunk[count], [](void* p, std::size_t k) {
    auto& c = *static_cast<Ctx*>(p);
    const auto& fc = *c.first_chunk;
    const std::size_t t = std::upper_bound(fc.begin(), fc.end(), k) - fc.begin() - 1;
    const std::size_t begin = (k - fc[t]) * kChunkElements;
    const std::size_t end = std::min(begin + kChunkElements, (*c.numel)(t));
    (*c.fn)(t, begin, end);
  }, &ctx);
}

// Runs kernel(coeffs[i], tensors[i], begin, end) over every chunk of every tensor, in parallel.
template <class Coeffs>
void run_kernel(void (*kernel)(const Coeffs&, const ParamBuffers&, std::size_t, std::size_t),
                const Coeffs* coeffs, const ParamBuffers* tensors, std::size_t count) {
  for_each_chunk(
      count, [&](std::size_t i) { return tensors[i].numel; },
      [&](std::size_t i, std::size_t begin, std::size_t end) {
        kernel(coeffs[i], tensors[i], begin, end);
      });
}

}  // namespace detail
}  // namespace roundpipe
