// A plain C++ trainer (no Python, no PyTorch): fits a linear model y = W x + b to data from a
// hidden linear map plus noise, with hand-written gradients of the mean squared error, using
// roundpipe::Adam with a step learning-rate schedule and a checkpoint/resume in the middle.
// Prints the loss falling; exits 1 unless the final loss is below 2% of the first.
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include <roundpipe/roundpipe.hpp>

namespace {

constexpr int kIn = 32, kOut = 8, kBatch = 64, kSteps = 400;

struct Model {
  std::vector<float> w = std::vector<float>(kOut * kIn), b = std::vector<float>(kOut);
  std::vector<float> gw = std::vector<float>(kOut * kIn), gb = std::vector<float>(kOut);

  // Mean squared error over the batch; fills gw, gb with its gradient.
  float loss_and_grad(const std::vector<float>& x, const std::vector<float>& y) {
    std::fill(gw.begin(), gw.end(), 0.0f);
    std::fill(gb.begin(), gb.end(), 0.0f);
    double loss = 0;
    const float scale = 2.0f / (kBatch * kOut);
    for (int n = 0; n < kBatch; ++n)
      for (int o = 0; o < kOut; ++o) {
        float pred = b[o];
        for (int i = 0; i < kIn; ++i) pred += w[o * kIn + i] * x[n * kIn + i];
        const float err = pred - y[n * kOut + o];
        loss += double(err) * err;
        gb[o] += scale * err;
        for (int i = 0; i < kIn; ++i) gw[o * kIn + i] += scale * err * x[n * kIn + i];
      }
    return static_cast<float>(loss / (kBatch * kOut));
  }
};

}  // namespace

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w_true(kOut * kIn), b_true(kOut);
  for (auto& v : w_true) v = normal(rng);
  for (auto& v : b_true) v = normal(rng);
  auto batch = [&](std::vector<float>& x, std::vector<float>& y) {
    for (auto& v : x) v = normal(rng);
    for (int n = 0; n < kBatch; ++n)
      for (int o = 0; o < kOut; ++o) {
        float t = b_true[o] + 0.01f * normal(rng);
        for (int i = 0; i < kIn; ++i) t += w_true[o * kIn + i] * x[n * kIn + i];
        y[n * kOut + o] = t;
      }
  };

  Model model;
  roundpipe::AdamOptions options;
  options.lr = 0.05;
  auto opt = std::make_unique<roundpipe::Adam>(options);
  opt->add_param(model.w.data(), model.gw.data(), model.w.size());
  opt->add_param(model.b.data(), model.gb.data(), model.b.size());
  std::printf("training %d parameters with roundpipe::Adam on ISA %s, %d threads\n",
              kOut * kIn + kOut, roundpipe::isa_name(roundpipe::active_isa()),
              roundpipe::num_threads());

  std::vector<float> x(kBatch * kIn), y(kBatch * kOut);
  float first = 0, last = 0;
  for (int step = 1; step <= kSteps; ++step) {
    batch(x, y);
    last = model.loss_and_grad(x, y);
    if (step == 1) first = last;
    opt->step();
    if (step % 100 == 0) opt->options().lr *= 0.5;  // learning-rate schedule
    if (step == kSteps / 2) {
      // Checkpoint and resume into a fresh optimizer: training continues unchanged.
      std::vector<roundpipe::ParamState> saved = {opt->state(0), opt->state(1)};
      const roundpipe::AdamOptions o = opt->options();
      opt = std::make_unique<roundpipe::Adam>(o);
      opt->add_param(model.w.data(), model.gw.data(), model.w.size());
      opt->add_param(model.b.data(), model.gb.data(), model.b.size());
      opt->load_state(0, saved[0]);
      opt->load_state(1, saved[1]);
      std::printf("step %4d  resumed from a checkpoint at step %g\n", step,
                  opt->state(0).scalar[roundpipe::AdamState::step]);
    }
    if (step == 1 || step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, last);
  }
  const bool ok = last < 0.02f * first;
  std::printf("%s: loss %.4f -> %.6f\n", ok ? "ok" : "FAIL", first, last);
  return ok ? 0 : 1;
}
