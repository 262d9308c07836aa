// roundpipe._C: the nanobind face of the C++ optimizer library. Thin by design: it checks that
// every tensor is what the kernels need (float32, CPU, C-contiguous, matching shapes; each
// problem a TypeError/ValueError naming the argument and index, raised before anything is
// touched), releases the GIL and calls the C++ step. Tensors arrive through DLPack without any
// implicit conversion: a float64 or strided tensor is refused, never copied, because an update
// applied to a temporary copy would leave the caller's tensor unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "roundpipe/optim.hpp"

namespace nb = nanobind;
// One entry per parameter; None marks a parameter without a gradient, which the step skips
// (its entries in every other list must be None too).
using Tensors = std::vector<std::optional<nb::ndarray<>>>;

namespace {

std::string where(const char* fn, const char* arg, std::size_t i) {
  return std::string(fn) + ": " + arg + "[" + std::to_string(i) + "]";
}

std::string dtype_name(nb::dlpack::dtype d) {
  const char* kind = d.code == uint8_t(nb::dlpack::dtype_code::Float)   ? "float"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Int)   ? "int"
                     : d.code == uint8_t(nb::dlpack::dtype_code::UInt)  ? "uint"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bool)  ? "bool"
                                                                         : "other";
  return std::string(kind) + std::to_string(d.bits);
}

bool c_contiguous(const nb::ndarray<>& a) {
  int64_t expected = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) return false;
    expected *= a.shape(d);
  }
  return true;
}

// Checks one tensor and returns its data. `like` (if given) must have the same shape.
float* checked(const nb::ndarray<>& a, const char* fn, const char* arg, std::size_t i,
               const nb::ndarray<>* like) {
  if (a.dtype() != nb::dtype<float>())
    throw nb::type_error((where(fn, arg, i) + " must be float32, got " + dtype_name(a.dtype())).c_str());
  if (a.device_type() != nb::device::cpu::value)
    throw nb::type_error((where(fn, arg, i) + " must be a CPU tensor, got DLPack device type " +
                          std::to_string(a.device_type())).c_str());
  if (a.size() != 0 && !c_contiguous(a))
    throw nb::value_error((where(fn, arg, i) + " must be contiguous").c_str());
  if (like) {
    bool same = a.ndim() == like->ndim();
    for (std::size_t d = 0; same && d < a.ndim(); ++d) same = a.shape(d) == like->shape(d);
    if (!same)
      throw nb::value_error((where(fn, arg, i) + " must have the shape of params[" +
                             std::to_string(i) + "]").c_str());
  }
  return static_cast<float*>(a.data());
}

void check_count(const char* fn, const char* arg, const Tensors& t, std::size_t n) {
  if (t.size() != n)
    throw nb::value_error((std::string(fn) + ": " + arg + " has " + std::to_string(t.size()) +
                           " tensors, params has " + std::to_string(n)).c_str());
}

float* checked_step(const nb::ndarray<>& a, const char* fn, std::size_t i) {
  float* p = checked(a, fn, "steps", i, nullptr);
  if (a.size() != 1)
    throw nb::value_error((where(fn, "steps", i) + " must hold one element").c_str());
  return p;
}

// The tensor at i of a list whose entry must be present (params[i] is).
const nb::ndarray<>& present(const Tensors& list, const char* fn, const char* arg, std::size_t i) {
  if (!list[i])
    throw nb::value_error((where(fn, arg, i) + " is None but params[" + std::to_string(i) +
                           "] is not").c_str());
  return *list[i];
}

void adam_step(const Tensors& params, const Tensors& grads, const Tensors& exp_avgs,
               const Tensors& exp_avg_sqs, const Tensors& max_exp_avg_sqs, const Tensors& steps,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               bool amsgrad, bool maximize, bool decoupled_weight_decay) {
  constexpr const char* fn = "adam_step";
  const std::size_t n = params.size();
  check_count(fn, "grads", grads, n);
  check_count(fn, "exp_avgs", exp_avgs, n);
  check_count(fn, "exp_avg_sqs", exp_avg_sqs, n);
  check_count(fn, "steps", steps, n);
  if (amsgrad) check_count(fn, "max_exp_avg_sqs", max_exp_avg_sqs, n);
  std::vector<roundpipe::AdamTensor> tensors;
  tensors.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (!params[i]) continue;
    const nb::ndarray<>& p = *params[i];
    roundpipe::AdamTensor t;
    t.param = checked(p, fn, "params", i, nullptr);
    t.grad = checked(present(grads, fn, "grads", i), fn, "grads", i, &p);
    t.exp_avg = checked(present(exp_avgs, fn, "exp_avgs", i), fn, "exp_avgs", i, &p);
    t.exp_avg_sq = checked(present(exp_avg_sqs, fn, "exp_avg_sqs", i), fn, "exp_avg_sqs", i, &p);
    if (amsgrad)
      t.max_exp_avg_sq = checked(present(max_exp_avg_sqs, fn, "max_exp_avg_sqs", i), fn,
                                 "max_exp_avg_sqs", i, &p);
    t.step = checked_step(present(steps, fn, "steps", i), fn, i);
    t.numel = p.size();
    tensors.push_back(t);
  }
  roundpipe::AdamOptions o;
  o.lr = lr;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.amsgrad = amsgrad;
  o.maximize = maximize;
  o.decoupled_weight_decay = decoupled_weight_decay;
  nb::gil_scoped_release release;
  roundpipe::adam_step(o, tensors.data(), tensors.size());
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "RoundPipe CPU optimizer kernels (float32, CPU, contiguous tensors only).";

  m.def("adam_step", &adam_step, nb::arg("params").noconvert(), nb::arg("grads").noconvert(),
        nb::arg("exp_avgs").noconvert(), nb::arg("exp_avg_sqs").noconvert(),
        nb::arg("max_exp_avg_sqs").noconvert(), nb::arg("steps").noconvert(), nb::kw_only(),
        nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        nb::arg("weight_decay"), nb::arg("amsgrad"), nb::arg("maximize"),
        nb::arg("decoupled_weight_decay"),
        "One Adam step (torch.optim.Adam semantics) over lists of float32 CPU tensors: params,\n"
        "grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs (may be empty unless amsgrad) and the\n"
        "0-dim float32 steps, which are incremented. A None in params skips that position.\n"
        "Raises TypeError (dtype, device) or ValueError (shape, contiguity, counts, None where\n"
        "a tensor is needed, hyperparameter range) before touching anything.");

  m.def("supported_isas", [] {
    std::vector<std::string> out;
    for (auto isa : roundpipe::supported_isas()) out.emplace_back(roundpipe::isa_name(isa));
    return out;
  }, "ISAs this CPU, OS and build can run, narrowest first.");
  m.def("active_isa", [] { return std::string(roundpipe::isa_name(roundpipe::active_isa())); },
        "The ISA the kernels use (ROUNDPIPE_ISA or the widest supported). ValueError if\n"
        "ROUNDPIPE_ISA names an unknown or unsupported ISA.");
  m.def("set_isa", [](const std::string& name) { roundpipe::set_isa(roundpipe::parse_isa(name)); },
        nb::arg("isa"), "Forces an ISA by name. ValueError if unknown or unsupported.");
  m.def("num_threads", &roundpipe::num_threads, "Threads an optimizer step uses.");
  m.def("set_num_threads", &roundpipe::set_num_threads, nb::arg("n"),
        "Sets the threads an optimizer step uses (>= 1).");
}
