// adafactor_step (roundpipe/adafactor.hpp): checks, then three passes over the tensors on the
// worker pool with the active ISA's kernels (kernels/adafactor.hpp), the per-tensor scalars
// computed in double between them as torch.optim.Adafactor computes them.
//
// Pass 1 is cut into tasks of about kTile elements: a factored tensor's matrices in tiles of
// whole rows or of row and column blocks (each tile's row and column sums of g^2 kept apart and
// added in tile order afterwards), an unfactored tensor in chunks. Every sum is reduced in a
// fixed order, so the results do not depend on the thread count. Gradients given as 16-bit or
// scaled (StepIO) are staged as float32 slice by slice in every pass (the statistics of StepIO
// are taken in pass 1); a bfloat16 parameter is read as float32 and, in pass 3, stored with
// stochastic rounding; the model copy is written in pass 3.
#include "roundpipe/adafactor.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "check.hpp"
#include "kernel_table.hpp"
#include "parallel.hpp"

namespace roundpipe {
namespace {

using detail::AdafactorCoeffs;
using detail::KernelTable;

constexpr std::size_t kTile = std::size_t{1} << 20;   // elements per pass-1 task
constexpr std::size_t kFlushRows = 32;                // float column sums added into double

// One pass-1 task.
struct Task {
  Task(std::size_t tensor_, std::size_t b0_, std::size_t b1_, std::size_t r0_, std::size_t r1_,
       std::size_t c0_, std::size_t c1_, bool whole_)
      : tensor(tensor_), b0(b0_), b1(b1_), r0(r0_), r1(r1_), c0(c0_), c1(c1_), whole(whole_) {}

  std::size_t tensor;
  // factored: matrices [b0, b1) whole, or one matrix's rows [r0, r1) x columns [c0, c1);
  // unfactored: elements [c0, c1)
  std::size_t b0, b1, r0, r1, c0, c1;
  bool whole;
  // results: the squares of param; the sum of u^2 (unfactored); where the tile's row and
  // column sums go in `partial` (whole matrices write the tensor's sums directly)
  double p_sq = 0.0, u_sq = 0.0;
  std::size_t row_at = 0, col_at = 0;
  detail::GradStats stats;
};

// Per tensor: what the passes share.
struct Tensor {
  bool factored = false, stepped = false;
  std::size_t batch = 0;
  double step = 0.0, eps1 = 0.0;
  std::vector<double> row_sum, col_sum;  // of g^2, per matrix row / column
  std::vector<float> row_scale, col_scale;  // rsqrt(R / max(mean(R), eps1)), rsqrt(C)
  AdafactorCoeffs coeffs{};
  double p_sq = 0.0, u_sq = 0.0;
};

// Elements [begin, begin + n) of t's gradient and parameter as float32 pointers (staged in
// `grad` / `param` when 16-bit or scaled), and the slice of t they form (element 0 = begin).
struct Staging {
  Staging(const KernelTable& isa_, float inv_scale_, float clip_, bool norm_, bool stage_grad_)
      : isa(isa_), inv_scale(inv_scale_), clip(clip_), norm(norm_), stage_grad(stage_grad_) {}

  const KernelTable& isa;
  float inv_scale, clip;
  bool norm, stage_grad;
  alignas(64) float grad[detail::kStageElements];   // scratch: written before it is read
  alignas(64) float param[detail::kStageElements];

  ParamBuffers slice(const ParamBuffers& t, std::size_t begin, std::size_t n,
                     detail::GradStats& stats, bool want_param) {
    ParamBuffers x = t;
    x.numel = n;
    x.grad16 = nullptr;
    x.model_copy = nullptr;
    x.param_bf16 = nullptr;
    if (stage_grad || t.grad16) {
      isa.stage_grad(t, begin, n, inv_scale, clip, norm, grad, stats);
      x.grad = grad;
    } else {
      x.grad = t.grad + begin;
    }
    if (!want_param) {
      x.param = nullptr;
    } else if (t.param_bf16) {
      isa.widen_bf16(t.param_bf16 + begin, n, param);
      x.param = param;
    } else {
      x.param = t.param + begin;
    }
    if (t.state[AdafactorState::variance])
      x.state[AdafactorState::variance] = t.state[AdafactorState::variance] + begin;
    return x;
  }
};

void check(const AdafactorOptions& o, const ParamBuffers* tensors, std::size_t count,
           StepIO* io) {
  constexpr const char* fn = "adafactor_step";
  detail::check_range(fn, "lr", o.lr, 0.0);
  detail::check_range(fn, "beta2_decay", o.beta2_decay, -INFINITY, 0.0);
  if (o.eps1 != AdafactorOptions::kMachineEpsilon) detail::check_range(fn, "eps1", o.eps1, 0.0);
  detail::check_range(fn, "eps2", o.eps2, 0.0);
  detail::check_range(fn, "d", o.d, 1.0);
  detail::check_range(fn, "weight_decay", o.weight_decay, 0.0);
  detail::check_buffers<AdafactorState>(fn, tensors, count, 0u,
                                        detail::all_scalars<AdafactorState>(), io);
  for (std::size_t i = 0; i < count; ++i) {
    const ParamBuffers& t = tensors[i];
    const std::string at = std::string(fn) + ": tensors[" + std::to_string(i) + "]";
    for (StateFormat f : t.state_format)
      if (f != StateFormat::float32)
        throw Error(at + ": compact state is not supported by Adafactor (its factored state "
                    "is small already)");
    const bool factored = t.rows != 0 || t.cols != 0;
    if (factored && t.numel != 0 && (t.rows == 0 || t.cols == 0))
      throw Error(at + ": rows (" + std::to_string(t.rows) + ") and cols (" +
                  std::to_string(t.cols) + ") must both be nonzero for a tensor of " +
                  std::to_string(t.numel) + " elements (or both 0: unfactored)");
    if (factored && t.rows * t.cols != 0 && t.numel % (t.rows * t.cols) != 0)
      throw Error(at + ": rows * cols (" + std::to_string(t.rows) + " * " +
                  std::to_string(t.cols) + ") does not divide numel " + std::to_string(t.numel));
    if (t.numel == 0) continue;
    if (factored && !t.state[AdafactorState::row_var])
      throw Error(at + ".row_var is null (numel " + std::to_string(t.numel) + ")");
    if (factored && !t.state[AdafactorState::col_var])
      throw Error(at + ".col_var is null (numel " + std::to_string(t.numel) + ")");
    if (!factored && !t.state[AdafactorState::variance])
      throw Error(at + ".variance is null (numel " + std::to_string(t.numel) + ")");
  }
}

// Pass-1 tasks of a factored tensor: whole matrices when one fits a tile, else tiles of whole
// rows (at least 16 rows of at most 64k columns: contiguous memory, which this read-only pass
// streams fastest; 256 x 4096 tiles of a 4000 x 5000 matrix took 25% longer), of all rows
// (short, very wide matrices) or of 256 rows x 4096 columns; the tiles' partial sums are laid
// out in `partial` from `at` on.
void factored_tasks(std::size_t i, const ParamBuffers& t, std::size_t batch,
                    std::vector<Task>& tasks, std::size_t& at) {
  const std::size_t R = t.rows, C = t.cols, matrix = R * C;
  if (matrix <= kTile) {
    const std::size_t per = std::max<std::size_t>(1, kTile / matrix);
    for (std::size_t b = 0; b < batch; b += per)
      tasks.push_back({i, b, std::min(batch, b + per), 0, R, 0, C, true});
    return;
  }
  std::size_t rows, cols;
  if (C <= kTile / 16) {
    cols = C;
    rows = kTile / C;
  } else if (R <= 256) {
    rows = R;
    cols = (kTile / R + 15) / 16 * 16;
  } else {
    cols = 4096;
    rows = kTile / 4096;
  }
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t r = 0; r < R; r += rows)
      for (std::size_t c = 0; c < C; c += cols) {
        Task task{i, b, b + 1, r, std::min(R, r + rows), c, std::min(C, c + cols), false};
        task.row_at = at;
        at += task.r1 - task.r0;
        task.col_at = at;
        at += task.c1 - task.c0;
        tasks.push_back(task);
      }
}

// Pass 1 of a factored task: the squares of param and the row and column sums of g^2.
void run_factored(Task& task, const ParamBuffers& t, Tensor& ts, Staging& st,
                  std::vector<double>& partial) {
  const std::size_t R = t.rows, C = t.cols;
  std::vector<float> acc(task.c1 - task.c0);
  std::vector<double> cols(task.c1 - task.c0, 0.0);
  for (std::size_t b = task.b0; b < task.b1; ++b) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (task.whole) std::fill(cols.begin(), cols.end(), 0.0);
    for (std::size_t r = task.r0; r < task.r1; ++r) {
      double row = 0.0;
      for (std::size_t c = task.c0; c < task.c1; c += detail::kStageElements) {
        const std::size_t n = std::min(detail::kStageElements, task.c1 - c);
        const std::size_t begin = (b * R + r) * C + c;
        const ParamBuffers x = st.slice(t, begin, n, task.stats, true);
        double p_sq;
        row += st.isa.adafactor_squares2(x.param, x.grad, n, acc.data() + (c - task.c0), p_sq);
        task.p_sq += p_sq;
      }
      if (task.whole) ts.row_sum[b * R + r] = row;
      else partial[task.row_at + (r - task.r0)] = row;
      if ((r - task.r0 + 1) % kFlushRows == 0 || r + 1 == task.r1) {
        for (std::size_t j = 0; j < acc.size(); ++j) cols[j] += acc[j];
        std::fill(acc.begin(), acc.end(), 0.0f);
      }
    }
    if (task.whole) std::copy(cols.begin(), cols.end(), ts.col_sum.begin() + b * C);
  }
  if (!task.whole) std::copy(cols.begin(), cols.end(), partial.begin() + task.col_at);
}

// Pass 1 of an unfactored chunk: the squares of param, the variance, the sum of u^2.
void run_unfactored(Task& task, const ParamBuffers& t, Tensor& ts, Staging& st) {
  for (std::size_t b = task.c0; b < task.c1; b += detail::kStageElements) {
    const std::size_t n = std::min(detail::kStageElements, task.c1 - b);
    const ParamBuffers x = st.slice(t, b, n, task.stats, true);
    task.p_sq += st.isa.adafactor_squares(x.param, n, nullptr);
    AdafactorCoeffs c = ts.coeffs;
    c.first = b;
    task.u_sq += st.isa.adafactor_variance(c, x, 0, n);
  }
}

// A float32 norm from a sum of squares, as torch's float32 norm() returns it.
double norm32(double sum_sq) { return static_cast<float>(std::sqrt(sum_sq)); }

}  // namespace

void adafactor_step(const AdafactorOptions& o, const ParamBuffers* tensors, std::size_t count,
                    StepIO* io) {
  check(o, tensors, count, io);
  const KernelTable& isa = detail::active_kernels();
  const bool norm = io && io->want_grad_norm;
  const float inv_scale = io ? static_cast<float>(1.0 / io->grad_scale) : 1.0f;
  const float clip = io ? static_cast<float>(io->grad_clip) : 1.0f;

  // the step counts and the scalars torch computes before touching the tensors
  std::vector<Tensor> ts(count);
  std::vector<Task> tasks;
  std::size_t partial_size = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const ParamBuffers& t = tensors[i];
    Tensor& s = ts[i];
    float& step = *t.scalar[AdafactorState::step];
    step += 1.0f;
    s.step = step;
    if (t.numel == 0) continue;
    s.stepped = true;
    s.factored = t.rows != 0 || t.cols != 0;
    s.eps1 = o.eps1 != AdafactorOptions::kMachineEpsilon ? o.eps1
             : t.param_bf16                               ? 0x1p-7
                                                          : 0x1p-23;
    const detail::Lerp lerp = detail::lerp_coeff(std::pow(s.step, o.beta2_decay));
    AdafactorCoeffs& c = s.coeffs;
    c.grad = detail::grad_coeffs(0.0, o.maximize);
    c.factored = s.factored;
    c.rows = t.rows;
    c.cols = t.cols;
    c.eps1_sq = static_cast<float>(s.eps1 * s.eps1);
    c.inv_eps1 = static_cast<float>(1.0 / s.eps1);
    c.lerp_weight = lerp.weight;
    c.lerp_from_end = lerp.from_end;
    c.decays = o.weight_decay != 0.0;
    c.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
    if (s.factored) {
      s.batch = t.numel / (t.rows * t.cols);
      s.row_sum.assign(s.batch * t.rows, 0.0);
      s.col_sum.assign(s.batch * t.cols, 0.0);
      factored_tasks(i, t, s.batch, tasks, partial_size);
    } else {
      for (std::size_t b = 0; b < t.numel; b += detail::kChunkElements)
        tasks.push_back({i, 0, 0, 0, 0, b, std::min(t.numel, b + detail::kChunkElements), false});
    }
  }

  // pass 1: norms of param, sums of g^2 (factored) or the variance and sum of u^2
  std::vector<double> partial(partial_size);
  detail::for_each_task(tasks.size(), [&](std::size_t k) {
    Task& task = tasks[k];
    const ParamBuffers& t = tensors[task.tensor];
    Staging st{isa, inv_scale, clip, norm, io != nullptr};
    if (ts[task.tensor].factored) run_factored(task, t, ts[task.tensor], st, partial);
    else run_unfactored(task, t, ts[task.tensor], st);
  });
  double nonfinite = 0.0, grad_sq = 0.0;
  for (const Task& task : tasks) {  // in task order
    Tensor& s = ts[task.tensor];
    s.p_sq += task.p_sq;
    s.u_sq += task.u_sq;
    nonfinite += task.stats.nonfinite;
    grad_sq += task.stats.sum_sq;
    if (!s.factored || task.whole) continue;
    const ParamBuffers& t = tensors[task.tensor];
    for (std::size_t r = task.r0; r < task.r1; ++r)
      s.row_sum[task.b0 * t.rows + r] += partial[task.row_at + (r - task.r0)];
    for (std::size_t c = task.c0; c < task.c1; ++c)
      s.col_sum[task.b0 * t.cols + c] += partial[task.col_at + (c - task.c0)];
  }
  if (io) {
    io->found_inf = nonfinite != nonfinite;
    io->grad_norm_sq = norm ? grad_sq : 0.0;
  }

  // the factors: R = lerp(R, norm(g, dim=-1)^2 / cols, w), C likewise, the clamped means
  std::vector<std::size_t> chunks;  // pass 2 and 3: (tensor, begin) of each chunk
  for (std::size_t i = 0; i < count; ++i) {
    Tensor& s = ts[i];
    const ParamBuffers& t = tensors[i];
    if (!s.stepped) continue;
    if (s.factored) {
      auto means = [](const std::vector<double>& sums, std::size_t n) {
        std::vector<float> out(sums.size());
        for (std::size_t j = 0; j < sums.size(); ++j) {
          const float nrm = static_cast<float>(norm32(sums[j]));
          out[j] = nrm * nrm / static_cast<float>(n);
        }
        return out;
      };
      float* row_var = t.state[AdafactorState::row_var];
      float* col_var = t.state[AdafactorState::col_var];
      const std::vector<float> row_mean = means(s.row_sum, t.cols), col_mean = means(s.col_sum, t.rows);
      isa.adafactor_lerp(row_var, row_mean.data(), row_mean.size(), s.coeffs.lerp_weight,
                         s.coeffs.lerp_from_end);
      isa.adafactor_lerp(col_var, col_mean.data(), col_mean.size(), s.coeffs.lerp_weight,
                         s.coeffs.lerp_from_end);
      s.row_scale.resize(s.batch * t.rows);
      s.col_scale.resize(s.batch * t.cols);
      for (std::size_t b = 0; b < s.batch; ++b) {
        double sum = 0.0;
        for (std::size_t r = 0; r < t.rows; ++r) sum += row_var[b * t.rows + r];
        const float mean = static_cast<float>(sum / t.rows);
        const float eps1 = static_cast<float>(s.eps1);
        const float divisor = mean != mean || mean > eps1 ? mean : eps1;  // clamp_(min=eps1)
        for (std::size_t r = 0; r < t.rows; ++r)
          s.row_scale[b * t.rows + r] = 1.0f / std::sqrt(row_var[b * t.rows + r] / divisor);
      }
      for (std::size_t k = 0; k < s.col_scale.size(); ++k)
        s.col_scale[k] = 1.0f / std::sqrt(col_var[k]);
      s.coeffs.row_scale = s.row_scale.data();
      s.coeffs.col_scale = s.col_scale.data();
    }
    for (std::size_t b = 0; b < t.numel; b += detail::kChunkElements) {
      chunks.push_back(i);
      chunks.push_back(b);
    }
  }

  // pass 2: the sum of u^2 of the factored tensors, per chunk
  const std::size_t nchunks = chunks.size() / 2;
  std::vector<double> u_sq(nchunks, 0.0);
  detail::for_each_task(nchunks, [&](std::size_t k) {
    const std::size_t i = chunks[2 * k], begin = chunks[2 * k + 1];
    if (!ts[i].factored) return;
    const ParamBuffers& t = tensors[i];
    Staging st{isa, inv_scale, clip, false, io != nullptr};
    detail::GradStats unused;
    const std::size_t end = std::min(t.numel, begin + detail::kChunkElements);
    for (std::size_t b = begin; b < end; b += detail::kStageElements) {
      const std::size_t n = std::min(detail::kStageElements, end - b);
      AdafactorCoeffs c = ts[i].coeffs;
      c.first = b;
      u_sq[k] += isa.adafactor_norm(c, st.slice(t, b, n, unused, false), 0, n);
    }
  });
  for (std::size_t k = 0; k < nchunks; ++k) ts[chunks[2 * k]].u_sq += u_sq[k];

  // the step sizes: alpha = max(eps2, RMS(param)) * rho_t, over max(1, RMS(u) / d)
  for (std::size_t i = 0; i < count; ++i) {
    Tensor& s = ts[i];
    if (!s.stepped) continue;
    const double n = static_cast<double>(tensors[i].numel);
    const double rho = std::min(o.lr, 1.0 / std::pow(s.step, 0.5));
    const double alpha = std::max(o.eps2, norm32(s.p_sq) / std::pow(n, 0.5)) * rho;
    const double denom = std::max(1.0, norm32(s.u_sq) / (std::pow(n, 0.5) * o.d));
    s.coeffs.alpha = static_cast<float>(-alpha / denom);
  }

  // pass 3: the update (and the bfloat16 parameter's rounding, the model copy)
  detail::for_each_task(nchunks, [&](std::size_t k) {
    const std::size_t i = chunks[2 * k], begin = chunks[2 * k + 1];
    const ParamBuffers& t = tensors[i];
    Staging st{isa, inv_scale, clip, false, io != nullptr};
    detail::GradStats unused;
    const std::size_t end = std::min(t.numel, begin + detail::kChunkElements);
    if (!io && !t.grad16 && !t.param_bf16 && !t.model_copy) {  // nothing staged: the whole chunk
      AdafactorCoeffs c = ts[i].coeffs;
      c.first = 0;
      isa.adafactor(c, t, begin, end);
      return;
    }
    const std::uint64_t seed = detail::step_seed(t.rounding_seed, ts[i].step);
    for (std::size_t b = begin; b < end; b += detail::kStageElements) {
      const std::size_t n = std::min(detail::kStageElements, end - b);
      AdafactorCoeffs c = ts[i].coeffs;
      c.first = b;
      const ParamBuffers x = st.slice(t, b, n, unused, true);
      isa.adafactor(c, x, 0, n);
      if (t.param_bf16)
        isa.round_bf16(x.param, n, detail::stream_key(seed, 0, b >> 32),
                       static_cast<std::uint32_t>(b), t.param_bf16 + b, x.param);
      if (t.model_copy) isa.store_model_copy(t, x.param, b, n);
    }
    if (t.model_copy) isa.stream_fence();
  });
}

}  // namespace roundpipe
