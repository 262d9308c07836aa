// Adafactor's element-wise passes and its reductions, written once over the SIMD vector types of
// cpp/optim/simd (the driver, cpp/optim/adafactor.cpp, cuts the work into tiles and chunks and
// computes the per-tensor scalars in double between the passes, as torch.optim.Adafactor does):
//   adafactor_squares   sum of x^2 over a row segment, also added element-wise into a column
//                       accumulator: the row and column sums of g^2, and the norm of param
//   adafactor_squares2  both of those in one loop over a row segment of param and grad
//   adafactor_lerp      R = lerp(R, mean, w) on the small factor arrays (torch's lerp_)
//   adafactor_variance  unfactored: variance = lerp(variance, g * g, w), returns sum of u^2
//   adafactor_norm      factored: sum of u^2
//   adafactor_kernel    the update: param = fmadd(u, -alpha / denom, param * decay)
// with u = rsqrt(max(v, eps1^2)) * g (rsqrt as ATen's: 1 / sqrt); unfactored, v is the
// variance. Factored, torch's v = (R[row] * C[col]) / divisor[matrix] (row_var @ col_var over the
// clamped mean of row_var) gives rsqrt(max(v, eps1^2)) = min(rsqrt(R[row] / divisor) *
// rsqrt(C[col]), 1 / eps1): the driver computes those two factors once per row and per column,
// so the element-wise passes multiply instead of dividing twice and taking a square root per
// element (equal to torch's up to float32 rounding: a few ulp).
#pragma once
#include <cstddef>

#include "gradient.hpp"
#include "roundpipe/adafactor.hpp"

namespace roundpipe {
namespace detail {

struct AdafactorCoeffs {
  GradCoeffs grad;            // maximize (no L2: the weight decay is decoupled)
  bool factored;              // rows * cols matrices (else a whole variance)
  std::size_t rows, cols;
  const float* row_scale;     // batch * rows: rsqrt(row_var / max(mean(row_var), eps1)),
                              // absolute (not sliced with the tensor)
  const float* col_scale;     // batch * cols: rsqrt(col_var)
  float eps1_sq;              // float(eps1 * eps1)
  float inv_eps1;             // 1 / eps1: the largest factored rsqrt
  float lerp_weight;          // torch's lerp_ coefficient for 1 - beta2_t (check.hpp lerp_coeff)
  bool lerp_from_end;
  bool decays;                // weight_decay != 0
  float decay;                // 1 - lr * weight_decay
  float alpha;                // -alpha / denom
  std::size_t first;          // element index of the buffers' element 0 (a slice's offset)
};

}  // namespace detail
}  // namespace roundpipe

#ifdef ROUNDPIPE_ISA_NS
#include "for_range.hpp"

namespace roundpipe {
namespace ROUNDPIPE_ISA_NS {

// Sum over x[0, n) of x^2 (in double); with `acc`, acc[j] += x[j]^2 too.
inline double adafactor_squares(const float* x, std::size_t n, float* acc) {
  return sum_range(0, n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, x);
    const V v = V::load(x + i);
    const V sq = v * v;
    if (acc) (V::load(acc + i) + sq).store(acc + i);
    return sq;
  });
}

// adafactor_squares(p, n, nullptr) into p_sq and adafactor_squares(g, n, acc) returned, in one
// loop: the two streams read at once (two loops read one array at a time), each sum added in
// sum_range's order (the same bits).
inline double adafactor_squares2(const float* p, const float* g, std::size_t n, float* acc,
                                 double& p_sq) {
  constexpr std::size_t kWays = 4, kBlock = 256, W = Vec::width;
  double p_total = 0.0, g_total = 0.0;
  std::size_t i = 0;
  while (i + W <= n) {
    Vec pa[kWays], ga[kWays];
    for (std::size_t k = 0; k < kWays; ++k) pa[k] = ga[k] = Vec::set1(0.0f);
    auto body = [&](std::size_t k, std::size_t j) {
      prefetch_streams<Vec>(j, p, g);
      const Vec pv = Vec::load(p + j), gv = Vec::load(g + j);
      const Vec sq = gv * gv;
      (Vec::load(acc + j) + sq).store(acc + j);
      pa[k] = pa[k] + pv * pv;
      ga[k] = ga[k] + sq;
    };
    const std::size_t stop = i + std::min(kBlock * W, (n - i) / W * W);
    for (; i + kWays * W <= stop; i += kWays * W)
      for (std::size_t k = 0; k < kWays; ++k) body(k, i + k * W);
    for (; i < stop; i += W) body(0, i);
    float lanes[W];
    ((pa[0] + pa[1]) + (pa[2] + pa[3])).store(lanes);
    for (float l : lanes) p_total += l;
    ((ga[0] + ga[1]) + (ga[2] + ga[3])).store(lanes);
    for (float l : lanes) g_total += l;
  }
  Scalar p_tail{0.0f}, g_tail{0.0f};
  for (; i < n; ++i) {
    const Scalar pv = Scalar::load(p + i), gv = Scalar::load(g + i);
    const Scalar sq = gv * gv;
    (Scalar::load(acc + i) + sq).store(acc + i);
    p_tail = p_tail + pv * pv;
    g_tail = g_tail + sq;
  }
  p_sq = p_total + p_tail.v;
  return g_total + g_tail.v;
}

// start[0, n) = lerp(start, end, w): torch's lerp_ with a scalar weight (for_range.hpp).
inline void adafactor_lerp(float* start, const float* end, std::size_t n, float weight,
                           bool from_end) {
  for_range(0, n, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    torch_lerp(V::load(start + i), V::load(end + i), weight, from_end).store(start + i);
  });
}

template <class V>
inline V adafactor_u(const detail::AdafactorCoeffs& c, V v, V g) {
  return V::set1(1.0f) / sqrt(maximum(v, V::set1(c.eps1_sq))) * g;
}

// The elements [begin, end) of the slice t (element i is the tensor's element c.first + i) a
// row segment at a time: f(i, stop, u) for each segment [i, stop), where u(tag, j) loads the
// gradient at j and returns u of the factored second moment, g * min(row_scale * col_scale,
// 1 / eps1) (1 / eps1 is never NaN, and neither that nor row_scale * col_scale is ever -0:
// minimum_bound's condition).
template <class F>
inline void for_each_row_segment(const detail::AdafactorCoeffs& c, const ParamBuffers& t,
                                 std::size_t begin, std::size_t end, F&& f) {
  if (begin >= end) return;
  // the first element's row (of all matrices: b * rows + r), its matrix b and column, then row
  // after row (no division per segment: a row is short on small matrices)
  const std::size_t at = c.first + begin;
  std::size_t row = at / c.cols, col = at % c.cols, b = row / c.rows, r = row % c.rows;
  std::size_t i = begin;
  while (true) {
    const std::size_t stop = std::min(end, i + (c.cols - col));
    const float scale = c.row_scale[row];
    const float* cols = c.col_scale + b * c.cols + col - i;  // cols[j]: column of element j
    f(i, stop, [&](auto tag, std::size_t j) {
      using V = decltype(tag);
      prefetch_streams<V>(j, t.grad);
      const V g = load_grad(c.grad, t, j, V::set1(0.0f));
      return minimum_bound(V::set1(scale) * V::load(cols + j), V::set1(c.inv_eps1)) * g;
    });
    if (stop == end) return;
    i = stop;
    col = 0;
    ++row;
    if (++r == c.rows) {
      r = 0;
      ++b;
    }
  }
}

// Unfactored: variance = lerp(variance, g * g, w) (stored), returns the sum of u^2.
inline double adafactor_variance(detail::AdafactorCoeffs c, ParamBuffers t,
                                 std::size_t begin, std::size_t end) {
  float* const variance = t.state[AdafactorState::variance];
  return sum_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.grad, variance);
    const V g = load_grad(c.grad, t, i, V::set1(0.0f));
    const V v = torch_lerp(V::load(variance + i), g * g, c.lerp_weight, c.lerp_from_end);
    v.store(variance + i);
    const V u = adafactor_u(c, v, g);
    return u * u;
  });
}

// Factored: the sum of u^2.
inline double adafactor_norm(detail::AdafactorCoeffs c, ParamBuffers t,
                             std::size_t begin, std::size_t end) {
  double total = 0.0;
  for_each_row_segment(c, t, begin, end, [&](std::size_t i, std::size_t stop, auto u) {
    total += sum_range(i, stop, [&](auto tag, std::size_t j) {
      const auto x = u(tag, j);
      return x * x;
    });
  });
  return total;
}

// The update of param, from the variance (unfactored) or the factors.
inline void adafactor_kernel(detail::AdafactorCoeffs c, ParamBuffers t,
                             std::size_t begin, std::size_t end) {
  auto apply = [&](auto tag, std::size_t i, auto u) {
    using V = decltype(tag);
    prefetch_streams<V>(i, t.param);
    V p = V::load(t.param + i);
    if (c.decays) p = p * V::set1(c.decay);
    fmadd(u, V::set1(c.alpha), p).store(t.param + i);
  };
  if (c.factored) {
    for_each_row_segment(c, t, begin, end, [&](std::size_t i, std::size_t stop, auto u) {
      for_range(i, stop, [&](auto tag, std::size_t j) { apply(tag, j, u(tag, j)); });
    });
    return;
  }
  const float* const variance = t.state[AdafactorState::variance];
  for_range(begin, end, [&](auto tag, std::size_t i) {
    using V = decltype(tag);
    const V g = load_grad(c.grad, t, i, V::set1(0.0f));
    apply(tag, i, adafactor_u(c, V::load(variance + i), g));
  });
}

}  // namespace ROUNDPIPE_ISA_NS
}  // namespace roundpipe
#endif
