// The two ends of the mixed-precision pass (roundpipe/step_io.hpp), written once over the SIMD
// vector types: staging a chunk's gradient as float32 (converted, unscaled, checked, squared)
// into a small buffer, and rounding the updated parameter into the model copy.
#pragma once
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "roundpipe/buffers.hpp"

namespace roundpipe {
namespace detail {

// What a chunk's gradients held: `nonfinite` is NaN once an element was inf or NaN (sum of
// g * 0), `sum_sq` the sum of their squares.
struct GradStats {
  float nonfinite = 0.0f;
  double sum_sq = 0.0;
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

template <bool Clip, class Load>
inline void stage_with(Load load, std::size_t n, float inv_scale, float clip, bool norm,
                       float* out, detail::GradStats& stats) {
  Vec vec_inf = Vec::set1(0.0f), vec_sq = Vec::set1(0.0f);
  Scalar scalar_inf{0.0f}, scalar_sq{0.0f};
  for_range(0, n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    const V g = load(tag, i) * V::set1(inv_scale);
    if constexpr (Clip) (g * V::set1(clip)).store(out + i);
    else g.store(out + i);
    V& inf = lane_acc<V>(vec_inf, scalar_inf);
    inf = inf + g * V::set1(0.0f);
    if (norm) {
      V& sq = lane_acc<V>(vec_sq, scalar_sq);
      sq = fmadd(g, g, sq);
    }
  });
  float lanes[2][Vec::width];
  vec_inf.store(lanes[0]);
  vec_sq.store(lanes[1]);
  float inf = scalar_inf.v;
  double sq = scalar_sq.v;
  for (std::size_t k = 0; k < Vec::width; ++k) {
    inf += lanes[0][k];
    sq += lanes[1][k];
  }
  stats.nonfinite += inf;
  stats.sum_sq += sq;
}

// out[0, n) = float32 gradient of t's elements [begin, begin + n), times inv_scale, then times
// clip (a second rounding, skipped when clip is 1); the statistics are of the unscaled,
// unclipped gradient.
inline void stage_grad(const ParamBuffers& t, std::size_t begin, std::size_t n, float inv_scale,
                       float clip, bool norm, float* out, detail::GradStats& stats) {
  auto stage = [&](auto load) {
    if (clip != 1.0f) stage_with<true>(load, n, inv_scale, clip, norm, out, stats);
    else stage_with<false>(load, n, inv_scale, clip, norm, out, stats);
  };
  // the source is read ahead as the kernels read theirs (for_range.hpp: prefetch_streams)
  if (!t.grad16) {
    const float* g = t.grad + begin;
    stage([&](auto tag, std::size_t i) {
      prefetch_streams<decltype(tag)>(i, g);
      return decltype(tag)::load(g + i);
    });
  } else if (t.grad16_dtype == Dtype::bfloat16) {
    const std::uint16_t* g = t.grad16 + begin;
    stage([&](auto tag, std::size_t i) {
      prefetch_streams<decltype(tag)>(i, g);
      return decltype(tag)::load_bf16(g + i);
    });
  } else {
    const std::uint16_t* g = t.grad16 + begin;
    stage([&](auto tag, std::size_t i) {
      prefetch_streams<decltype(tag)>(i, g);
      return decltype(tag)::load_f16(g + i);
    });
  }
}

// t.model_copy's elements [begin, begin + n) = param[0, n) (those elements of the updated
// parameter), rounded to t.model_copy_dtype. The copy is a write-only stream: where the ISA has
// them and the slice is aligned, non-temporal stores write it without first reading its cache
// lines. The caller orders them with one stream_fence after a chunk's last slice, not one per
// slice: a fence waits for the write-combining buffers to drain, and per 256-element slice it
// cost 0.4 ns per element (AdamW, bf16 state, bf16 model copy, one AVX-512 thread: 1.88 ->
// 1.50 ns per element).
inline void store_model_copy(const ParamBuffers& t, const float* param, std::size_t begin,
                             std::size_t n) {
  const float* p = param;
  if (t.model_copy_dtype == Dtype::float32) {
    std::memcpy(static_cast<float*>(t.model_copy) + begin, p, n * sizeof(float));
    return;
  }
  std::uint16_t* out = static_cast<std::uint16_t*>(t.model_copy) + begin;
  const bool bf16 = t.model_copy_dtype == Dtype::bfloat16;
  const bool stream = reinterpret_cast<std::uintptr_t>(out) % Vec::stream_align == 0;
  for_range(0, n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    const V x = V::load(p + i);
    if (stream) {
      if (bf16) x.stream_bf16(out + i); else x.stream_f16(out + i);
    } else {
      if (bf16) x.store_bf16(out + i); else x.store_f16(out + i);
    }
  });
}

// Orders the non-temporal stores made so far by this thread (store_model_copy's) before its later
// stores: once per chunk, before the pool reports the chunk done.
inline void stream_fence() { Vec::stream_fence(); }

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
