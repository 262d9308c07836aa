// Internal: spreading one step over the worker pool (roundpipe/threads.hpp).
#pragma once
#include <algorithm>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "kernel_table.hpp"
#include "prefetch.hpp"
#include "roundpipe/buffers.hpp"
#include "roundpipe/step_io.hpp"
#include "roundpipe/state_traits.hpp"

namespace roundpipe {
namespace detail {

// Elements per task: a multiple of 16 floats (one 64-byte cache line), small enough to balance
// two to a few dozen threads, large enough that a task's streams stay in flight.
constexpr std::size_t kChunkElements = 16384;

// Elements a step needs per thread it runs on: a step over n elements (all its tensors together)
// uses at most max(1, n / kElementsPerThread) threads, whatever its thread count. Waking a
// sleeping worker costs ~60 us on a KVM guest (2 vCPUs), as long as one thread takes for ~80k
// elements of AdamW; AdamW on one float32 tensor, median us per step:
//
//     elements   1 thread   2 threads
//        32768       30.6        81.6
//        65536       50.2        97.7
//       131072      100.9       142.9
//       262144      211.0       236.0
//       524288      379.4       341.3
//
// The two cross near 370k elements: 196608 (12 chunks) gives a step its second thread from
// 393216. A small step (a pipeline's per-layer step of a small layer) runs on the caller alone.
constexpr std::size_t kElementsPerThread = 196608;

// Runs task(ctx, k) for k in [0, ntasks) on the pool (the caller takes part) and returns when all
// are done, on at most `max_threads` threads (the caller counted) and at most the thread count
// (threads.hpp), the kernels prefetching the chosen distance ahead (roundpipe/tuning.hpp). Calls
// from several threads are serialised.
void run_tasks(std::size_t ntasks, void (*task)(void* ctx, std::size_t k), void* ctx,
               std::size_t max_threads);

// As run_tasks, the kernels prefetching `prefetch_elements` ahead (g_prefetch_elements, set
// under the step lock before the tasks run).
void run_tasks_prefetching(std::size_t ntasks, void (*task)(void* ctx, std::size_t k), void* ctx,
                           std::size_t max_threads, std::size_t prefetch_elements);

// The prefetch distance (tuning.cpp, roundpipe/tuning.hpp). check_tuning() reads
// ROUNDPIPE_PREFETCH on first use (every step calls it through active_kernels(), before it
// changes anything; throws roundpipe::Error for a bad value); chosen_prefetch_elements() is the
// distance in use, in float32 elements; prefetch_calibrates(n): a step over n elements
// calibrates (calibration not finished, n >= kPrefetchCalibrationElements).
void check_tuning();
std::size_t chosen_prefetch_elements();
bool prefetch_calibrates(std::size_t elements);

// Runs task(ctx, k) for k in [0, ntasks) as run_tasks does, the first tasks in as many whole
// calibration rounds as they hold and the calibration still needs: per round one timed block of
// 16 consecutive tasks per candidate distance, in an order rotated from round to round; `ends[k]`
// is the number of elements of tasks [0, k] (a block's time per element). The tasks, and so the
// results, are the same as run_tasks'.
void run_calibrating(std::size_t ntasks, const std::size_t* ends,
                     void (*task)(void* ctx, std::size_t k), void* ctx, std::size_t max_threads);

// As run_tasks (no limit but the thread count) when no other call is running; else returns false
// at once, having run nothing (for work that must not wait for an optimizer step: it runs on its
// own thread instead).
bool try_run_tasks(std::size_t ntasks, void (*task)(void* ctx, std::size_t k), void* ctx);

// Runs fn(k) for k in [0, ntasks) on the pool (as many threads as tasks, up to the thread count).
template <class Fn>
void for_each_task(std::size_t ntasks, Fn&& fn) {
  run_tasks(ntasks, [](void* ctx, std::size_t k) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(k); },
            &fn, ntasks);
}

// Elements per step of the mixed-precision pass: its float32 gradient buffer (8 KiB) and the
// slices of param and state it updates stay in L1 between staging, update and copy-out.
constexpr std::size_t kStageElements = 2048;

// Calls fn(tensor, begin, end, chunk) over the elements [0, numel(tensor)) of tensors
// [0, count), cut into chunks of kChunkElements at chunk-aligned offsets, in parallel on at most
// one thread per kElementsPerThread elements; `chunk` numbers them 0, 1, ... in tensor and
// element order (count_chunks of them). The chunks, and so the results, do not depend on the
// number of threads. With `step` (an optimizer step's kernels, which prefetch their arrays), a
// call may run prefetch calibration rounds (run_calibrating): the same chunks, timed.
template <class NumelFn, class Fn>
void for_each_chunk(std::size_t count, NumelFn&& numel, Fn&& fn, bool step = false) {
  std::vector<std::size_t> first_chunk(count + 1, 0);
  std::size_t elements = 0;
  for (std::size_t t = 0; t < count; ++t) {
    const std::size_t n = numel(t);
    elements += n;
    first_chunk[t + 1] = first_chunk[t] + (n + kChunkElements - 1) / kChunkElements;
  }
  struct Ctx {
    const std::vector<std::size_t>* first_chunk;
    std::remove_reference_t<NumelFn>* numel;
    std::remove_reference_t<Fn>* fn;
  } ctx{&first_chunk, &numel, &fn};
  void (*task)(void*, std::size_t) = [](void* p, std::size_t k) {
    auto& c = *static_cast<Ctx*>(p);
    const auto& fc = *c.first_chunk;
    const std::size_t t = std::upper_bound(fc.begin(), fc.end(), k) - fc.begin() - 1;
    const std::size_t begin = (k - fc[t]) * kChunkElements;
    const std::size_t end = std::min(begin + kChunkElements, (*c.numel)(t));
    (*c.fn)(t, begin, end, k);
  };
  const std::size_t ntasks = first_chunk[count];
  const std::size_t max_threads = std::max<std::size_t>(1, elements / kElementsPerThread);
  if (!step || !prefetch_calibrates(elements)) return run_tasks(ntasks, task, &ctx, max_threads);
  std::vector<std::size_t> ends(ntasks);  // elements of chunks [0, k]
  for (std::size_t t = 0, k = 0, total = 0; t < count; ++t)
    for (std::size_t b = 0, n = numel(t); b < n; b += kChunkElements, ++k)
      ends[k] = total += std::min(kChunkElements, n - b);
  run_calibrating(ntasks, ends.data(), task, &ctx, max_threads);
}

// Number of chunks for_each_chunk cuts `tensors` into.
inline std::size_t count_chunks(const ParamBuffers* tensors, std::size_t count) {
  std::size_t chunks = 0;
  for (std::size_t i = 0; i < count; ++i)
    chunks += (tensors[i].numel + kChunkElements - 1) / kChunkElements;
  return chunks;
}

// Whether a tensor's parameter or any of its state is stored compactly (roundpipe/compact.hpp).
inline bool compact(const ParamBuffers& t) {
  if (t.param_bf16) return true;
  for (StateFormat f : t.state_format)
    if (f != StateFormat::float32) return true;
  return false;
}

// Whether a call takes the staged pass: the mixed-precision pass (roundpipe/step_io.hpp) or
// compact storage.
inline bool staged(const ParamBuffers* tensors, std::size_t count, const StepIO* io) {
  if (io) return true;
  for (std::size_t i = 0; i < count; ++i)
    if (tensors[i].grad16 || tensors[i].model_copy || compact(tensors[i])) return true;
  return false;
}

// Elements per step of the staged pass over compact storage: up to five float32 buffers
// (gradient, parameter, three state slots) stay in L1. One int8 block (kQuantBlock, the least
// a slice may hold): a slice's passes (widen, the algorithm's kernel, rounding) are then short
// enough for the core to run one pass's integer work while the next waits on its divisions;
// AdamW with bf16 state took 1.40 ns per element with 1024 and 1.26 with 256, int8 state 2.19
// and 1.83 (one AVX-512 thread, 32M elements; 128 gained nothing).
constexpr std::size_t kCompactStageElements = 256;

// Runs kernel(coeffs[i], tensors[i], begin, end) over every chunk of every tensor, in parallel.
// With `io`, any grad16 / model_copy or compact storage, each chunk runs in slices of
// kStageElements (kCompactStageElements for a compact tensor): the gradient staged as float32
// into a stack buffer (when it is 16-bit or io is given), a bfloat16 parameter and compact state
// read into float32 buffers, the kernel on the slice, the compact arrays written back, the model
// copy written; per-chunk gradient statistics are reduced into `io` in chunk order. `State` (the
// algorithm's slot names, roundpipe/<name>.hpp) says which slots take the unsigned int8 map and
// whether the tensor's step count (scalar slot 0) enters the rounding seed.
//
// With `fused` (the algorithm's CompactKernelFn), a compact tensor's slice runs it instead of
// the separate conversion passes around `kernel` (where it runs the slice's formats): every
// array is converted inside its loop, a vector at a time, with the same result bits
// (kernels/compact.hpp: compact_slice): AdamW with bf16 state took 1.19 -> 0.90 ns per element
// on one AVX-512 thread, int8 state 1.69 -> 1.43 (32M elements; docs/benchmarks.md).
template <class State, class Coeffs>
void run_kernel(KernelFn<Coeffs> kernel,
                const Coeffs* coeffs, const ParamBuffers* tensors, std::size_t count,
                StepIO* io, CompactKernelFn<Coeffs> fused = nullptr) {
  static_assert(kCompactStageElements == kQuantBlock, "a fused slice is one int8 block");
  auto numel = [&](std::size_t i) { return tensors[i].numel; };
  if (!staged(tensors, count, io)) {
    for_each_chunk(count, numel, [&](std::size_t i, std::size_t begin, std::size_t end,
                                     std::size_t) { kernel(coeffs[i], tensors[i], begin, end); },
                   true);
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
    alignas(64) float param[kStageElements];
    alignas(64) float state[ParamBuffers::kMaxState][kCompactStageElements];
    const ParamBuffers& t = tensors[i];
    const bool packed = compact(t);
    const std::uint64_t seed =
        counts_steps<State>() && t.scalar[0] ? step_seed(t.rounding_seed, *t.scalar[0])
                                             : t.rounding_seed;
    GradStats s;
    const std::size_t step = packed ? kCompactStageElements : kStageElements;
    for (std::size_t b = begin; b < end; b += step) {
      const std::size_t n = std::min(step, end - b);
      if (t.grad16 || io) isa.stage_grad(t, b, n, inv_scale, clip, norm, grad, s);
      const float* g = t.grad16 || io ? grad : t.grad + b;
      if (packed && fused) {
        CompactSlice slice;
        slice.n = n;
        slice.first = static_cast<std::uint32_t>(b);
        slice.grad = g;
        if (t.param_bf16) {
          slice.param.format = StateFormat::bfloat16;
          slice.param.packed = t.param_bf16 + b;
          slice.param.key = stream_key(seed, 0, b >> 32);
          slice.param.values = t.model_copy ? param : nullptr;
        } else {
          slice.param.values = t.param + b;
        }
        for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
          CompactArray& a = slice.state[k];
          a.format = t.state_format[k];
          if (a.format == StateFormat::float32) {
            a.values = t.state[k] ? t.state[k] + b : nullptr;
          } else if (a.format == StateFormat::bfloat16) {
            a.packed = static_cast<std::uint16_t*>(t.packed_state[k]) + b;
            a.key = stream_key(seed, 1 + k, b >> 32);
          } else {
            a.values = state[k];
            a.packed = static_cast<std::uint8_t*>(t.packed_state[k]) + b;
            a.absmax = t.state_absmax[k] + b / kQuantBlock;
            a.scale = *a.absmax;
            a.map = &quant_map(!(nonnegative_slots<State>() >> k & 1u));
          }
        }
        if (fused(coeffs[i], slice)) {
          if (t.model_copy) isa.store_model_copy(t, t.param_bf16 ? param : t.param + b, b, n);
          continue;
        }
      }
      ParamBuffers x = t;  // the slice, all float32
      x.numel = n;
      x.grad16 = nullptr;
      x.model_copy = nullptr;
      x.param_bf16 = nullptr;
      x.grad = g;
      if (t.param_bf16) {
        isa.widen_bf16(t.param_bf16 + b, n, param);
        x.param = param;
      } else {
        x.param = t.param + b;
      }
      for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
        x.state_format[k] = StateFormat::float32;
        x.packed_state[k] = nullptr;
        x.state_absmax[k] = nullptr;
        if (t.state_format[k] == StateFormat::float32) {
          x.state[k] = t.state[k] ? t.state[k] + b : nullptr;
        } else if (t.state_format[k] == StateFormat::bfloat16) {
          isa.widen_bf16(static_cast<const std::uint16_t*>(t.packed_state[k]) + b, n, state[k]);
          x.state[k] = state[k];
        } else {
          isa.dequantize_blocks(quant_map(!(nonnegative_slots<State>() >> k & 1u)),
                                static_cast<const std::uint8_t*>(t.packed_state[k]) + b,
                                t.state_absmax[k] + b / kQuantBlock, n, state[k]);
          x.state[k] = state[k];
        }
      }
      kernel(coeffs[i], x, 0, n);
      for (int k = 0; k < ParamBuffers::kMaxState; ++k) {
        if (t.state_format[k] == StateFormat::bfloat16)
          isa.round_bf16(state[k], n, stream_key(seed, 1 + k, b >> 32),
                         static_cast<std::uint32_t>(b),
                         static_cast<std::uint16_t*>(t.packed_state[k]) + b, nullptr);
        else if (t.state_format[k] == StateFormat::int8)
          isa.quantize_blocks(quant_map(!(nonnegative_slots<State>() >> k & 1u)), state[k], n,
                              static_cast<std::uint8_t*>(t.packed_state[k]) + b,
                              t.state_absmax[k] + b / kQuantBlock);
      }
      if (t.param_bf16)
        isa.round_bf16(param, n, stream_key(seed, 0, b >> 32), static_cast<std::uint32_t>(b),
                       t.param_bf16 + b, param);
      if (t.model_copy) isa.store_model_copy(t, x.param, b, n);
    }
    if (t.model_copy) isa.stream_fence();
    if (io) stats[chunk] = s;
  }, true);
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
