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
                     : d.code == uint8_t(nb::dlpack::dtype_code::Complex) ? "complex"
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

// The tensor at i of a list whose entry must be present (params[i] is).
const nb::ndarray<>& present(const Tensors& list, const char* fn, const char* arg, std::size_t i) {
  if (!list[i])
    throw nb::value_error((where(fn, arg, i) + " is None but params[" + std::to_string(i) +
                           "] is not").c_str());
  return *list[i];
}

template <class Options>
using StepFn = void (*)(const Options&, const roundpipe::ParamBuffers*, std::size_t);

// Binds `fn` as `name(options, params, grads, states, scalars)`. `states` holds one list per
// state slot, in slot order and named by state_names; `scalars` one list per 0-dim state slot,
// named by scalar_names (scalars[0]: the steps, or SGD's momentum-buffer flags). In both, an
// empty or missing trailing list means the slot is not passed (its pointers stay null, which
// the step accepts only for a slot its options leave unused).
template <class Options>
void def_step(nb::module_& m, const char* name, StepFn<Options> fn,
              std::vector<const char*> state_names, std::vector<const char*> scalar_names,
              const char* doc) {
  m.def(
      name,
      [fn, name, state_names, scalar_names](const Options& options, const Tensors& params,
                                            const Tensors& grads, const std::vector<Tensors>& states,
                                            const std::vector<Tensors>& scalars) {
        const std::size_t n = params.size();
        if (states.size() > state_names.size() || scalars.size() > scalar_names.size())
          throw nb::value_error((std::string(name) + ": expected at most " +
                                 std::to_string(state_names.size()) + " state lists and " +
                                 std::to_string(scalar_names.size()) + " scalar lists").c_str());
        check_count(name, "grads", grads, n);
        for (std::size_t k = 0; k < states.size(); ++k)
          if (!states[k].empty()) check_count(name, state_names[k], states[k], n);
        for (std::size_t k = 0; k < scalars.size(); ++k)
          if (!scalars[k].empty()) check_count(name, scalar_names[k], scalars[k], n);
        std::vector<roundpipe::ParamBuffers> tensors;
        tensors.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
          if (!params[i]) continue;
          const nb::ndarray<>& p = *params[i];
          roundpipe::ParamBuffers t;
          t.param = checked(p, name, "params", i, nullptr);
          t.grad = checked(present(grads, name, "grads", i), name, "grads", i, &p);
          for (std::size_t k = 0; k < states.size(); ++k)
            if (!states[k].empty())
              t.state[k] = checked(present(states[k], name, state_names[k], i), name,
                                   state_names[k], i, &p);
          for (std::size_t k = 0; k < scalars.size(); ++k) {
            if (scalars[k].empty()) continue;
            const nb::ndarray<>& s = present(scalars[k], name, scalar_names[k], i);
            t.scalar[k] = checked(s, name, scalar_names[k], i, nullptr);
            if (s.size() != 1)
              throw nb::value_error((where(name, scalar_names[k], i) + " must hold one element").c_str());
          }
          t.numel = p.size();
          tensors.push_back(t);
        }
        nb::gil_scoped_release release;
        fn(options, tensors.data(), tensors.size());
      },
      nb::arg("options"), nb::arg("params").noconvert(), nb::arg("grads").noconvert(),
      nb::arg("states").noconvert(), nb::arg("scalars").noconvert(), doc);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "RoundPipe CPU optimizer kernels (float32, CPU, contiguous tensors only).";

  nb::class_<roundpipe::AdamOptions>(m, "AdamOptions", "roundpipe::AdamOptions (torch.optim.Adam's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::AdamOptions::lr)
      .def_rw("beta1", &roundpipe::AdamOptions::beta1)
      .def_rw("beta2", &roundpipe::AdamOptions::beta2)
      .def_rw("eps", &roundpipe::AdamOptions::eps)
      .def_rw("weight_decay", &roundpipe::AdamOptions::weight_decay)
      .def_rw("amsgrad", &roundpipe::AdamOptions::amsgrad)
      .def_rw("maximize", &roundpipe::AdamOptions::maximize)
      .def_rw("decoupled_weight_decay", &roundpipe::AdamOptions::decoupled_weight_decay);
  def_step<roundpipe::AdamOptions>(
      m, "adam_step", &roundpipe::adam_step, {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"},
      {"steps"},
      "adam_step(options, params, grads, [exp_avgs, exp_avg_sqs, max_exp_avg_sqs], [steps]):\n"
      "one Adam step (torch.optim.Adam semantics) over lists of float32 CPU tensors; steps are\n"
      "the 0-dim float32 step counts, incremented. max_exp_avg_sqs may be [] unless amsgrad.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::AdadeltaOptions>(m, "AdadeltaOptions", "roundpipe::AdadeltaOptions (torch.optim.Adadelta's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::AdadeltaOptions::lr)
      .def_rw("rho", &roundpipe::AdadeltaOptions::rho)
      .def_rw("eps", &roundpipe::AdadeltaOptions::eps)
      .def_rw("weight_decay", &roundpipe::AdadeltaOptions::weight_decay)
      .def_rw("maximize", &roundpipe::AdadeltaOptions::maximize);
  def_step<roundpipe::AdadeltaOptions>(
      m, "adadelta_step", &roundpipe::adadelta_step, {"square_avgs", "acc_deltas"}, {"steps"},
      "adadelta_step(options, params, grads, [square_avgs, acc_deltas], [steps]):\n"
      "one Adadelta step (torch.optim.Adadelta semantics) over lists of float32 CPU tensors;\n"
      "steps are the 0-dim float32 step counts, incremented.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::AdamaxOptions>(m, "AdamaxOptions", "roundpipe::AdamaxOptions (torch.optim.Adamax's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::AdamaxOptions::lr)
      .def_rw("beta1", &roundpipe::AdamaxOptions::beta1)
      .def_rw("beta2", &roundpipe::AdamaxOptions::beta2)
      .def_rw("eps", &roundpipe::AdamaxOptions::eps)
      .def_rw("weight_decay", &roundpipe::AdamaxOptions::weight_decay)
      .def_rw("maximize", &roundpipe::AdamaxOptions::maximize);
  def_step<roundpipe::AdamaxOptions>(
      m, "adamax_step", &roundpipe::adamax_step, {"exp_avgs", "exp_infs"}, {"steps"},
      "adamax_step(options, params, grads, [exp_avgs, exp_infs], [steps]):\n"
      "one Adamax step (torch.optim.Adamax semantics) over lists of float32 CPU tensors;\n"
      "steps are the 0-dim float32 step counts, incremented.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::AsgdOptions>(m, "AsgdOptions", "roundpipe::AsgdOptions (torch.optim.ASGD's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::AsgdOptions::lr)
      .def_rw("lambd", &roundpipe::AsgdOptions::lambd)
      .def_rw("alpha", &roundpipe::AsgdOptions::alpha)
      .def_rw("t0", &roundpipe::AsgdOptions::t0)
      .def_rw("weight_decay", &roundpipe::AsgdOptions::weight_decay)
      .def_rw("maximize", &roundpipe::AsgdOptions::maximize);
  def_step<roundpipe::AsgdOptions>(
      m, "asgd_step", &roundpipe::asgd_step, {"axs"}, {"steps", "etas", "mus"},
      "asgd_step(options, params, grads, [axs], [steps, etas, mus]):\n"
      "one ASGD step (torch.optim.ASGD semantics) over lists of float32 CPU tensors; steps,\n"
      "etas and mus are 0-dim float32 tensors: steps incremented, the update uses the stored\n"
      "eta and mu, which are then replaced by the next step's values.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::NAdamOptions>(m, "NAdamOptions", "roundpipe::NAdamOptions (torch.optim.NAdam's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::NAdamOptions::lr)
      .def_rw("beta1", &roundpipe::NAdamOptions::beta1)
      .def_rw("beta2", &roundpipe::NAdamOptions::beta2)
      .def_rw("eps", &roundpipe::NAdamOptions::eps)
      .def_rw("weight_decay", &roundpipe::NAdamOptions::weight_decay)
      .def_rw("momentum_decay", &roundpipe::NAdamOptions::momentum_decay)
      .def_rw("decoupled_weight_decay", &roundpipe::NAdamOptions::decoupled_weight_decay)
      .def_rw("maximize", &roundpipe::NAdamOptions::maximize);
  def_step<roundpipe::NAdamOptions>(
      m, "nadam_step", &roundpipe::nadam_step, {"exp_avgs", "exp_avg_sqs"},
      {"steps", "mu_products"},
      "nadam_step(options, params, grads, [exp_avgs, exp_avg_sqs], [steps, mu_products]):\n"
      "one NAdam step (torch.optim.NAdam semantics) over lists of float32 CPU tensors; steps\n"
      "(incremented) and mu_products (multiplied by mu_t) are 0-dim float32 tensors.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::RAdamOptions>(m, "RAdamOptions", "roundpipe::RAdamOptions (torch.optim.RAdam's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::RAdamOptions::lr)
      .def_rw("beta1", &roundpipe::RAdamOptions::beta1)
      .def_rw("beta2", &roundpipe::RAdamOptions::beta2)
      .def_rw("eps", &roundpipe::RAdamOptions::eps)
      .def_rw("weight_decay", &roundpipe::RAdamOptions::weight_decay)
      .def_rw("decoupled_weight_decay", &roundpipe::RAdamOptions::decoupled_weight_decay)
      .def_rw("maximize", &roundpipe::RAdamOptions::maximize);
  def_step<roundpipe::RAdamOptions>(
      m, "radam_step", &roundpipe::radam_step, {"exp_avgs", "exp_avg_sqs"}, {"steps"},
      "radam_step(options, params, grads, [exp_avgs, exp_avg_sqs], [steps]):\n"
      "one RAdam step (torch.optim.RAdam semantics) over lists of float32 CPU tensors; steps\n"
      "are the 0-dim float32 step counts, incremented.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::RpropOptions>(m, "RpropOptions", "roundpipe::RpropOptions (torch.optim.Rprop's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::RpropOptions::lr)
      .def_rw("etaminus", &roundpipe::RpropOptions::etaminus)
      .def_rw("etaplus", &roundpipe::RpropOptions::etaplus)
      .def_rw("step_size_min", &roundpipe::RpropOptions::step_size_min)
      .def_rw("step_size_max", &roundpipe::RpropOptions::step_size_max)
      .def_rw("maximize", &roundpipe::RpropOptions::maximize);
  def_step<roundpipe::RpropOptions>(
      m, "rprop_step", &roundpipe::rprop_step, {"prevs", "step_sizes"}, {"steps"},
      "rprop_step(options, params, grads, [prevs, step_sizes], [steps]):\n"
      "one Rprop step (torch.optim.Rprop semantics) over lists of float32 CPU tensors; the\n"
      "caller creates step_sizes filled with lr (options.lr is not read); steps are the 0-dim\n"
      "float32 step counts, incremented.\n"
      "A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::SGDOptions>(m, "SGDOptions", "roundpipe::SGDOptions (torch.optim.SGD's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::SGDOptions::lr)
      .def_rw("momentum", &roundpipe::SGDOptions::momentum)
      .def_rw("dampening", &roundpipe::SGDOptions::dampening)
      .def_rw("weight_decay", &roundpipe::SGDOptions::weight_decay)
      .def_rw("nesterov", &roundpipe::SGDOptions::nesterov)
      .def_rw("maximize", &roundpipe::SGDOptions::maximize);
  def_step<roundpipe::SGDOptions>(
      m, "sgd_step", &roundpipe::sgd_step, {"momentum_buffers"}, {"momentum_buffer_ready"},
      "sgd_step(options, params, grads, [momentum_buffers], [momentum_buffer_ready]):\n"
      "one SGD step (torch.optim.SGD semantics) over lists of float32 CPU tensors.\n"
      "momentum_buffer_ready holds 0-dim float32 flags: 0 means the buffer holds no value yet\n"
      "(the step copies the decayed gradient into it and sets the flag to 1), 1 that it holds\n"
      "the running momentum; a flag is written only when it changes. Pass [], [] when momentum\n"
      "is 0. A None in params skips that position (None there in every list).");

  nb::class_<roundpipe::AdagradOptions>(m, "AdagradOptions", "roundpipe::AdagradOptions (torch.optim.Adagrad's hyperparameters but initial_accumulator_value,\nwhich is the value state_sums start with).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::AdagradOptions::lr)
      .def_rw("lr_decay", &roundpipe::AdagradOptions::lr_decay)
      .def_rw("weight_decay", &roundpipe::AdagradOptions::weight_decay)
      .def_rw("eps", &roundpipe::AdagradOptions::eps)
      .def_rw("maximize", &roundpipe::AdagradOptions::maximize);
  def_step<roundpipe::AdagradOptions>(
      m, "adagrad_step", &roundpipe::adagrad_step, {"state_sums"}, {"steps"},
      "adagrad_step(options, params, grads, [state_sums], [steps]):\n"
      "one Adagrad step (torch.optim.Adagrad semantics) over lists of float32 CPU tensors; steps\n"
      "are the 0-dim float32 step counts, incremented. A None in params skips that position\n"
      "(None there in every list).");

  nb::class_<roundpipe::RMSpropOptions>(m, "RMSpropOptions", "roundpipe::RMSpropOptions (torch.optim.RMSprop's hyperparameters).")
      .def(nb::init<>())
      .def_rw("lr", &roundpipe::RMSpropOptions::lr)
      .def_rw("alpha", &roundpipe::RMSpropOptions::alpha)
      .def_rw("eps", &roundpipe::RMSpropOptions::eps)
      .def_rw("weight_decay", &roundpipe::RMSpropOptions::weight_decay)
      .def_rw("momentum", &roundpipe::RMSpropOptions::momentum)
      .def_rw("centered", &roundpipe::RMSpropOptions::centered)
      .def_rw("maximize", &roundpipe::RMSpropOptions::maximize);
  def_step<roundpipe::RMSpropOptions>(
      m, "rmsprop_step", &roundpipe::rmsprop_step, {"square_avgs", "momentum_buffers", "grad_avgs"},
      {"steps"},
      "rmsprop_step(options, params, grads, [square_avgs, momentum_buffers, grad_avgs], [steps]):\n"
      "one RMSprop step (torch.optim.RMSprop semantics) over lists of float32 CPU tensors; steps\n"
      "are the 0-dim float32 step counts, incremented. momentum_buffers may be [] unless\n"
      "momentum > 0, grad_avgs [] unless centered. A None in params skips that position (None\n"
      "there in every list).");

  nb::class_<roundpipe::StreamOptions>(m, "StreamOptions", "roundpipe::StreamOptions (state arrays streamed).")
      .def(nb::init<>())
      .def_rw("states", &roundpipe::StreamOptions::states);
  def_step<roundpipe::StreamOptions>(
      m, "stream_step", &roundpipe::stream_step, {"state0s", "state1s", "state2s"}, {},
      "stream_step(options, params, grads, [state0s, ...], []): the memory-traffic floor of a\n"
      "step with options.states state arrays (reads param, grad, states; writes param, states;\n"
      "one add per element). For benchmarks; the values written are meaningless.");

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
