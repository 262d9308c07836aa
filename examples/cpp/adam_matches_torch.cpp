// Checks the installed library against torch.optim.Adam: five AMSGrad steps with weight decay
// on 19 elements (vector body and tail on every ISA); the expected parameters were produced by
// torch (expected_from_torch.py beside this file) from the same inputs.
#include <cmath>
#include <cstdio>
#include <vector>

#include <roundpipe/roundpipe.hpp>

int main() {
  constexpr int kN = 19, kSteps = 5;
  const float expected[kN] = {
    0.6319921016693115f,
    0.8616375923156738f,
    0.2839566767215729f,
    -0.39822134375572205f,
    -0.6883297562599182f,
    -0.14830783009529114f,
    0.5899489521980286f,
    0.6162899136543274f,
    0.09276873618364334f,
    -0.7449966669082642f,
    -1.0332014560699463f,
    -0.38850951194763184f,
    0.7744124531745911f,
    1.2523785829544067f,
    0.7733848094940186f,
    -0.35476529598236084f,
    -1.329249620437622f,
    -1.064913034439087f,
    -0.050393857061862946f};
  std::vector<float> param(kN), grad(kN);
  for (int i = 0; i < kN; ++i) param[i] = static_cast<float>(std::sin(i + 1.0));
  roundpipe::AdamOptions o;
  o.lr = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.weight_decay = 0.01;
  o.amsgrad = true;
  roundpipe::Adam adam(o);
  adam.add_param(param.data(), grad.data(), kN);
  for (int s = 0; s < kSteps; ++s) {
    for (int i = 0; i < kN; ++i) grad[i] = static_cast<float>(std::cos(0.7 * i + s));
    adam.step();
  }
  int bad = 0;
  for (int i = 0; i < kN; ++i) {
    const float tol = 1e-6f + 1e-5f * std::fabs(expected[i]);
    if (!(std::fabs(param[i] - expected[i]) <= tol)) {
      std::printf("param[%d] = %.9g, torch.optim.Adam gives %.9g\n", i, param[i], expected[i]);
      ++bad;
    }
  }
  std::printf("%s: %d of %d parameters match torch.optim.Adam (ISA %s, step %g)\n",
              bad ? "FAIL" : "ok", kN - bad, kN, roundpipe::isa_name(roundpipe::active_isa()),
              adam.state(0).scalar[roundpipe::AdamState::step]);
  return bad ? 1 : 0;
}
