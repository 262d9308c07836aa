// roundpipe::adafactor_step against a float64 Adafactor written here from torch.optim.Adafactor's
// definition (roundpipe/adafactor.hpp), on every ISA: vectors of every tail size, matrices whose
// pass-1 tiles are whole matrices, whole rows, all rows or row and column blocks, batched
// (3-D) tensors, every option; one call over many tensors, thread counts, the fused
// mixed-precision pass and bfloat16 parameters, empty tensors, argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mixed_precision.hpp"
#include "roundpipe/adafactor.hpp"
#include "support.hpp"

namespace {

using roundpipe::AdafactorOptions;
using roundpipe::AdafactorState;

// One tensor: batch matrices of rows x cols (rows = cols = 0: a vector of n elements).
struct Shape {
  std::size_t batch, rows, cols, n;
  bool factored() const { return rows != 0 || cols != 0; }
  std::size_t numel() const { return factored() ? batch * rows * cols : n; }
};
Shape vec(std::size_t n) { return {0, 0, 0, n}; }
Shape mat(std::size_t b, std::size_t r, std::size_t c) { return {b, r, c, 0}; }

// Float64 Adafactor (torch.optim.Adafactor's algorithm).
struct RefAdafactor {
  Shape s;
  AdafactorOptions o;
  std::vector<double> param, row, col, var;
  double step = 0;

  RefAdafactor(const std::vector<float>& p0, Shape shape, const AdafactorOptions& options)
      : s(shape), o(options), param(p0.begin(), p0.end()) {
    if (s.factored()) {
      row.assign(s.batch * s.rows, 0.0);
      col.assign(s.batch * s.cols, 0.0);
    } else {
      var.assign(s.n, 0.0);
    }
  }

  void update(const std::vector<float>& grad) {
    const std::size_t n = param.size();
    step += 1;
    if (n == 0) return;
    const double w = std::pow(step, o.beta2_decay), rho = std::min(o.lr, 1 / std::sqrt(step));
    const double eps1 = o.eps1 < 0 ? std::ldexp(1.0, -23) : o.eps1;
    double psq = 0;
    for (double p : param) psq += p * p;
    const double alpha = std::max(o.eps2, std::sqrt(psq / n)) * rho;
    std::vector<double> g(n), u(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = o.maximize ? -double(grad[i]) : grad[i];
    if (s.factored()) {
      const std::size_t R = s.rows, C = s.cols;
      for (std::size_t b = 0; b < s.batch; ++b) {
        for (std::size_t r = 0; r < R; ++r) {
          double sum = 0;
          for (std::size_t c = 0; c < C; ++c) sum += g[(b * R + r) * C + c] * g[(b * R + r) * C + c];
          row[b * R + r] += w * (sum / C - row[b * R + r]);
        }
        for (std::size_t c = 0; c < C; ++c) {
          double sum = 0;
          for (std::size_t r = 0; r < R; ++r) sum += g[(b * R + r) * C + c] * g[(b * R + r) * C + c];
          col[b * C + c] += w * (sum / R - col[b * C + c]);
        }
        double mean = 0;
        for (std::size_t r = 0; r < R; ++r) mean += row[b * R + r];
        mean = std::max(mean / R, eps1);
        for (std::size_t r = 0; r < R; ++r)
          for (std::size_t c = 0; c < C; ++c) {
            const std::size_t i = (b * R + r) * C + c;
            const double v = row[b * R + r] * col[b * C + c] / mean;
            u[i] = g[i] / std::sqrt(std::max(v, eps1 * eps1));
          }
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        var[i] += w * (g[i] * g[i] - var[i]);
        u[i] = g[i] / std::sqrt(std::max(var[i], eps1 * eps1));
      }
    }
    double usq = 0;
    for (double x : u) usq += x * x;
    const double denom = std::max(1.0, std::sqrt(usq / n) / o.d);
    for (std::size_t i = 0; i < n; ++i)
      param[i] = param[i] * (1 - o.lr * o.weight_decay) - alpha / denom * u[i];
  }
};

// The library's buffers for one tensor.
struct Buffers {
  Shape s;
  std::vector<float> param, row, col, var;
  float step = 0;

  Buffers(const std::vector<float>& p0, Shape shape) : s(shape), param(p0) {
    if (s.factored()) {
      row.assign(s.batch * s.rows, 0.0f);
      col.assign(s.batch * s.cols, 0.0f);
    } else {
      var.assign(s.n, 0.0f);
    }
  }
  roundpipe::ParamBuffers view(const std::vector<float>& grad) {
    roundpipe::ParamBuffers t;
    t.param = param.data();
    t.grad = grad.data();
    t.numel = param.size();
    t.rows = s.rows;
    t.cols = s.cols;
    t.state[AdafactorState::row_var] = row.empty() ? nullptr : row.data();
    t.state[AdafactorState::col_var] = col.empty() ? nullptr : col.data();
    t.state[AdafactorState::variance] = var.empty() ? nullptr : var.data();
    t.scalar[AdafactorState::step] = &step;
    return t;
  }
};

// Options bit k: 1 maximize, 2 weight decay, 4 eps1 given (1e-3: it matters), 8 d = 1.5 with
// a large lr (clipping active).
AdafactorOptions options(int flags) {
  AdafactorOptions o;
  o.maximize = flags & 1;
  o.weight_decay = flags & 2 ? 0.25 : 0.0;
  if (flags & 4) o.eps1 = 1e-3;
  if (flags & 8) {
    o.d = 1.5;
    o.lr = 0.5;
  }
  return o;
}

void compare(Shape s, const AdafactorOptions& o, int steps) {
  std::mt19937 rng(31 + unsigned(s.numel()));
  const std::vector<float> p0 = rptest::randn(s.numel(), rng);
  RefAdafactor ref(p0, s, o);
  Buffers buf(p0, s);
  for (int k = 0; k < steps; ++k) {
    const std::vector<float> g = rptest::randn(s.numel(), rng, k % 2 ? 1e-3f : 3.0f);
    const roundpipe::ParamBuffers t = buf.view(g);
    roundpipe::adafactor_step(o, &t, 1);
    ref.update(g);
  }
  rptest::expect_close(buf.param, ref.param, "param", 2e-5, 1e-6);
  rptest::expect_close(buf.row, ref.row, "row_var", 2e-5, 0);
  rptest::expect_close(buf.col, ref.col, "col_var", 2e-5, 0);
  rptest::expect_close(buf.var, ref.var, "variance", 2e-5, 1e-12);
  EXPECT_EQ(buf.step, float(steps));
}

std::vector<Shape> shapes() {
  std::vector<Shape> out;
  for (std::size_t n : rptest::sizes()) out.push_back(vec(n));
  out.push_back(mat(1, 1, 1));
  out.push_back(mat(1, 7, 13));
  out.push_back(mat(3, 17, 33));          // batched matrices, several per tile
  out.push_back(mat(2, 0, 5));            // empty
  if (!rptest::quick()) {
    out.push_back(mat(1, 300, 5000));     // tiles of 256 rows x 4096 columns
    out.push_back(mat(1, 20, 100000));    // tiles of all rows
    out.push_back(mat(1, 150000, 10));    // tiles of whole rows
  }
  return out;
}

TEST(Adafactor, MatchesFloat64ReferenceOnEveryIsaShapeAndOption) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (const Shape& s : shapes())
      for (int flags = 0; flags < 16; ++flags) {
        if (s.numel() > 100000 && flags != 0 && flags != 15) continue;
        SCOPED_TRACE("shape " + std::to_string(s.batch) + "x" + std::to_string(s.rows) + "x" +
                     std::to_string(s.cols) + " n " + std::to_string(s.n) + " " +
                     rptest::describe_flags(flags, {"maximize", "weight_decay", "eps1", "d"}));
        compare(s, options(flags), 4);
      }
  });
}

// Many tensors of every kind in one call, 1 to 3 threads: the same bits as separate calls on
// one thread.
TEST(Adafactor, OneCallAndThreadCountsDoNotChangeResults) {
  const int before = roundpipe::num_threads();
  const std::vector<Shape> kinds = {vec(5), mat(1, 33, 70), vec(0), mat(2, 5, 3),
                                    mat(1, rptest::scaled(1200, 60), rptest::scaled(1100, 50)),
                                    vec(rptest::scaled(40000, 3000))};
  rptest::for_each_isa([&](roundpipe::Isa) {
    std::vector<std::vector<Buffers>> runs;
    for (int mode = 0; mode < 4; ++mode) {  // 0: separate calls, 1 thread; 1-3: one call
      roundpipe::set_num_threads(mode == 0 ? 1 : mode);
      std::mt19937 rng(9);
      std::vector<Buffers> bufs;
      for (const Shape& s : kinds) bufs.emplace_back(rptest::randn(s.numel(), rng), s);
      for (int k = 0; k < 3; ++k) {
        std::vector<std::vector<float>> grads;
        for (const Buffers& b : bufs) grads.push_back(rptest::randn(b.param.size(), rng));
        std::vector<roundpipe::ParamBuffers> ts;
        for (std::size_t j = 0; j < bufs.size(); ++j) ts.push_back(bufs[j].view(grads[j]));
        if (mode == 0)
          for (auto& t : ts) roundpipe::adafactor_step(options(15), &t, 1);
        else
          roundpipe::adafactor_step(options(15), ts.data(), ts.size());
      }
      runs.push_back(std::move(bufs));
    }
    for (int mode = 1; mode < 4; ++mode)
      for (std::size_t j = 0; j < kinds.size(); ++j) {
        rptest::expect_identical(runs[mode][j].param, runs[0][j].param, "param");
        rptest::expect_identical(runs[mode][j].row, runs[0][j].row, "row_var");
        rptest::expect_identical(runs[mode][j].col, runs[0][j].col, "col_var");
        rptest::expect_identical(runs[mode][j].var, runs[0][j].var, "variance");
      }
  });
  roundpipe::set_num_threads(before);
}

// The fused pass (bfloat16 gradients scaled by 1024, bfloat16 model copy, gradient norm) equals
// converting the gradients, the float32 step, and rounding the parameters.
TEST(Adafactor, MixedPrecisionPassEqualsItsComposition) {
  rptest::for_each_isa([](roundpipe::Isa) {
    for (const Shape& s : {mat(1, 40, rptest::scaled(3000, 100)), vec(rptest::scaled(20000, 999))}) {
      std::mt19937 rng(5);
      const std::vector<float> p0 = rptest::randn(s.numel(), rng);
      Buffers fused(p0, s), plain(p0, s);
      std::vector<std::uint16_t> g16(s.numel()), copy(s.numel());
      std::vector<float> g32(s.numel());
      double norm_sq = 0;
      for (std::size_t i = 0; i < g16.size(); ++i) {
        g16[i] = rptest::from_float(rptest::randn(1, rng)[0] * 1024, roundpipe::Dtype::bfloat16);
        const float g = rptest::bf16_to_float(g16[i]) * float(1.0 / 1024);
        g32[i] = g;
        norm_sq += double(g) * g;
      }
      roundpipe::ParamBuffers t = fused.view(g32);
      t.grad = nullptr;
      t.grad16 = g16.data();
      t.model_copy = copy.data();
      roundpipe::StepIO io;
      io.grad_scale = 1024;
      io.want_grad_norm = true;
      roundpipe::adafactor_step(options(2), &t, 1, &io);
      const roundpipe::ParamBuffers u = plain.view(g32);
      roundpipe::adafactor_step(options(2), &u, 1);
      rptest::expect_identical(fused.param, plain.param, "param");
      for (std::size_t i = 0; i < copy.size(); ++i)
        ASSERT_EQ(copy[i], rptest::float_to_bf16(plain.param[i])) << i;
      EXPECT_FALSE(io.found_inf);
      EXPECT_NEAR(io.grad_norm_sq, norm_sq, 1e-5 * norm_sq);  // float lanes, double sums
    }
  });
}

// A bfloat16 parameter is stepped in float32 and stored with stochastic rounding: within one
// bfloat16 step of the float32 step from the same (widened) values.
TEST(Adafactor, Bf16ParametersStayWithinOneBf16StepOfTheFloat32Step) {
  rptest::for_each_isa([](roundpipe::Isa) {
    const Shape s = mat(1, 64, 90);
    std::mt19937 rng(6);
    std::vector<float> p0 = rptest::randn(s.numel(), rng);
    std::vector<std::uint16_t> p16(p0.size());
    for (std::size_t i = 0; i < p0.size(); ++i) {
      p16[i] = rptest::float_to_bf16(p0[i]);
      p0[i] = rptest::bf16_to_float(p16[i]);
    }
    Buffers f32(p0, s), f16(p0, s);
    const std::vector<float> g = rptest::randn(s.numel(), rng);
    const roundpipe::ParamBuffers a = f32.view(g);
    roundpipe::adafactor_step(options(4), &a, 1);
    roundpipe::ParamBuffers b = f16.view(g);
    b.param = nullptr;
    b.param_bf16 = p16.data();
    b.rounding_seed = 7;
    AdafactorOptions o = options(4);  // eps1 given: the same for both dtypes
    roundpipe::adafactor_step(o, &b, 1);
    for (std::size_t i = 0; i < p16.size(); ++i) {
      const float got = rptest::bf16_to_float(p16[i]), want = f32.param[i];
      const float step = std::ldexp(1.0f, std::ilogb(want) - 7);
      ASSERT_LE(std::fabs(got - want), step) << i;
    }
  });
}

// The owning optimizer keeps the factors of a matrix and the variance of a vector, with the
// stateless step's results.
TEST(Adafactor, OptimizerClassMatchesTheStatelessStep) {
  std::mt19937 rng(2);
  const Shape m = mat(2, 30, 40), v = vec(77);
  const std::vector<float> pm = rptest::randn(m.numel(), rng), pv = rptest::randn(v.numel(), rng);
  Buffers ref_m(pm, m), ref_v(pv, v);
  std::vector<float> am = pm, av = pv, gm(m.numel()), gv(v.numel());
  roundpipe::Adafactor opt(options(15));
  opt.add_param({am.data(), nullptr, gm.data(), nullptr, am.size(), 30, 40});
  opt.add_param(av.data(), gv.data(), av.size());
  for (int k = 0; k < 3; ++k) {
    const auto a = rptest::randn(m.numel(), rng), b = rptest::randn(v.numel(), rng);
    std::copy(a.begin(), a.end(), gm.begin());
    std::copy(b.begin(), b.end(), gv.begin());
    roundpipe::ParamBuffers t[2] = {ref_m.view(gm), ref_v.view(gv)};
    roundpipe::adafactor_step(options(15), t, 2);
    opt.step();
  }
  EXPECT_EQ(am, ref_m.param);
  EXPECT_EQ(av, ref_v.param);
  EXPECT_EQ(opt.state(0).state[AdafactorState::row_var], ref_m.row);
  EXPECT_EQ(opt.state(0).state[AdafactorState::col_var], ref_m.col);
  EXPECT_TRUE(opt.state(0).state[AdafactorState::variance].empty());
  EXPECT_EQ(opt.state(1).state[AdafactorState::variance], ref_v.var);
  EXPECT_EQ(opt.state(1).scalar[0], 3.0f);
}

TEST(Adafactor, BadArgumentsThrowBeforeAnythingChanges) {
  std::vector<float> p(6, 1.0f), g(6, 1.0f), row(2), col(3);
  float step = 0;
  roundpipe::ParamBuffers t;
  t.param = p.data();
  t.grad = g.data();
  t.numel = 6;
  t.rows = 2;
  t.cols = 3;
  t.state[AdafactorState::row_var] = row.data();
  t.state[AdafactorState::col_var] = col.data();
  t.scalar[0] = &step;
  auto expect_error = [&](const AdafactorOptions& o, const roundpipe::ParamBuffers& bad,
                          const std::string& needle) {
    try {
      roundpipe::adafactor_step(o, &bad, 1);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(step, 0.0f);
    EXPECT_EQ(p, std::vector<float>(6, 1.0f));
  };
  AdafactorOptions o;
  o.lr = -1;
  expect_error(o, t, "lr");
  o = {};
  o.beta2_decay = 0.5;
  expect_error(o, t, "beta2_decay");
  o = {};
  o.eps1 = -0.5;
  expect_error(o, t, "eps1");
  o = {};
  o.d = 0.5;
  expect_error(o, t, "d must");
  o = {};
  o.eps2 = NAN;
  expect_error(o, t, "eps2");
  roundpipe::ParamBuffers bad = t;
  bad.state[AdafactorState::col_var] = nullptr;
  expect_error({}, bad, "tensors[0].col_var");
  bad = t;
  bad.cols = 4;
  expect_error({}, bad, "does not divide");
  bad = t;
  bad.rows = bad.cols = 0;  // a vector needs variance
  expect_error({}, bad, "tensors[0].variance");
  // One of rows and cols 0 with elements: was a division by zero (SIGFPE).
  bad = t;
  bad.cols = 0;
  expect_error({}, bad, "rows (2) and cols (0)");
  bad = t;
  bad.rows = 0;
  expect_error({}, bad, "rows (0) and cols (3)");
}

// The owning class refuses rows or cols 0 (with elements) when the parameter is added, naming
// them; an empty matrix (0 x 5) stays accepted.
TEST(Adafactor, AddParamRefusesOneOfRowsAndColsZero) {
  std::vector<float> p(8, 1.0f), g(8, 1.0f);
  for (auto rc : {std::pair<std::size_t, std::size_t>{4, 0}, {0, 4}}) {
    roundpipe::Adafactor opt;
    try {
      opt.add_param({p.data(), nullptr, g.data(), nullptr, p.size(), rc.first, rc.second});
      ADD_FAILURE() << "no error for rows " << rc.first << ", cols " << rc.second;
    } catch (const roundpipe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rows (" + std::to_string(rc.first) + ") and cols (" +
                                           std::to_string(rc.second) + ")"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(opt.num_params(), 0u);
  }
  roundpipe::Adafactor empty;
  empty.add_param({p.data(), nullptr, g.data(), nullptr, 0, 0, 5});
  empty.step();
  EXPECT_EQ(empty.state(0).scalar[0], 1.0f);
  EXPECT_EQ(p, std::vector<float>(8, 1.0f));
}

}  // namespace
