// Internal: spreading one step over the worker pool (roundpipe/threads.hpp).
#pragma once
#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kernel_table.hpp"
#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"

namespace roundpipe {
namespace detail {

// Elements per task: a multiple of 16 floats (one 64-byte cache line), small enough to balance
// two to a few dozen threads, large enough that a task's streams stay in flight.
constexpr std::size_t kChunkElements = 16384;

// Runs task(ctx, k) for k in [0, ntasks) on the pool (the caller takes part) and returns when all
// are done. Calls from several threads are serialised.
void run_tasks(std::size_t ntasks, void (*task)(void* ctx, std::size_t k), void* ctx);

// Elements per step of the mixed-precision pass: its float32 gradient buffer (8 KiB) and the
// slices of param and state it updates stay in L1 between staging, update and copy-out.
constexpr std::size_t kStageElements = 2048;

// Calls fn(tensor, begin, end, chunk) over the elements [0, numel(tensor)) of tensors
// [0, count), cut into chunks of kChunkElements at chunk-aligned offsets, in parallel; `chunk`
// numbers them 0, 1, ... in tensor and element order (count_chunks of them).
template <class NumelFn, class Fn>
void for_each_chunk(std::size_t count, NumelFn&& numel, Fn&& fn) {
  std::vector<std::size_t> first_chunk(count + 1, 0);
  for (std::size_t t = 0; t < count; ++t)
    first_chunk[t + 1] = first_chunk[t] + (numel(t) + kChunkElements - 1) / kChunkElements;
  struct Ctx {
    const std::vector<std::size_t>* first_chunk;
    std::remove_reference_t<NumelFn>* numel;
    std::remove_reference_t<Fn>* fn;
  } ctx{&first_chunk, &numel, &fn};
  run_tasks(first_chunk[count], [](void* p, std::size_t k) {
    auto& c = *static_cast<Ctx*>(p);
    const auto& fc = *c.first_chunk;
    const std::size_t t = std::upper_bound(fc.begin(), fc.end(), k) - fc.begin() - 1;
    const std::size_t begin = (k - fc[t]) * kChunkElements;
    const std::size_t end = std::min(begin + kChunkElements, (*c.numel)(t));
    (*c.fn)(t, begin, end, k);
  }, &ctx);
}

// Number of chunks for_each_chunk cuts `tensors` into.
inline std::size_t count_chunks(const ParamBuffers* tensors, std::size_t count) {
  std::size_t chunks = 0;
  for (std::size_t i = 0; i < count; ++i)
    chunks += (tensors[i].numel + kChunkElements - 1) / kChunkElements;
  return chunks;
}

// Whether a call takes the mixed-precision pass (roundpipe/step_io.hpp).
inline bool mixed_precision(const ParamBuffers* tensors, std::size_t count, const StepIO* io) {
  if (io) return true;
  for (std::size_t i = 0; i < count; ++i)
    if (tensors[i].grad16 || tensors[i].model_copy) return true;
  return false;
}

// Tensor t's elements [begin, begin + n) as a tensor of its own, with `grad` as its gradient.
inline ParamBuffers slice(const ParamBuffers& t, std::size_t begin, std::size_t n,
                          const float* grad) {
  ParamBuffers s = t;
  s.param = t.param + begin;
  for (float*& state : s.state)
    if (state) state += begin;
  s.grad = grad;
  s.grad16 = nullptr;
  s.model_copy = nullptr;
  s.numel = n;
  return s;
}

// Runs kernel(coeffs[i], tensors[i], begin, end) over every chunk of every tensor, in parallel.
// With `io` or any grad16 / model_copy, each chunk runs in slices of kStageElements: the
// gradient staged as float32 into a stack buffer, the kernel on the slice, the model copy
// written; per-chunk gradient statistics are reduced into `io` in chunk order.
template <class Coeffs>
void run_kernel(void (*kernel)(const Coeffs&, const ParamBuffers&, std::size_t, std::size_t),
                const Coeffs* coeffs, const ParamBuffers* tensors, std::size_t count,
                StepIO* io) {
  auto numel = [&](std::size_t i) { return tensors[i].numel; };
  if (!mixed_precision(tensors, count, io)) {
    for_each_chunk(count, numel, [&](std::size_t i, std::size_t begin, std::size_t end,
                                     std::size_t) { kernel(coeffs[i], tensors[i], begin, end); });
    return;
  }
  const KernelTable& isa = active_kernels();
  const float inv_scale = io ? static_cast<float>(1.0 / io->grad_scale) : 1.0f;
  const float clip = io ? static_cast<float>(io->grad_clip) : 1.0f;
  const bool norm = io && io->want_grad_norm;
  std::vector<GradStats> stats(io ? count_chunks(tensors, count) : 0);
  for_each_chunk(count, numel, [&](std::size_t i, std::size_t begin, std::size_t end,
                                   std::size_t chunk) {
    alignas(64) float grad[kStageElements];
    const ParamBuffers& t = tensors[i];
    GradStats s;
    for (std::size_t b = begin; b < end; b += kStageElements) {
      const std::size_t n = std::min(kStageElements, end - b);
      isa.stage_grad(t, b, n, inv_scale, clip, norm, grad, s);
      kernel(coeffs[i], slice(t, b, n, grad), 0, n);
      if (t.model_copy) isa.store_model_copy(t, b, n);
    }
    if (io) stats[chunk] = s;
  });
  if (!io) return;
  float nonfinite = 0.0f;
  double sum_sq = 0.0;
  for (const GradStats& s : stats) {
    nonfinite += s.nonfinite;
    sum_sq += s.sum_sq;
  }
  io->found_inf = nonfinite != nonfinite;
  io->grad_norm_sq = norm ? sum_sq : 0.0;
}

}  // namespace detail
}  // namespace roundpipe
