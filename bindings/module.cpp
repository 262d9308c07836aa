// roundpipe._C: the nanobind face of the C++ optimizer library. Thin by design: it checks that
// every tensor is what the kernels need (CPU, dense, C-contiguous, float32 — bfloat16 or float16
// allowed for gradients and model copies —, matching element counts; each problem a TypeError/ValueError
// naming the argument and index, raised before anything is touched), releases the GIL and calls
// the C++ step.
//
// Tensors are read through their own attributes (dtype, is_cpu, layout, numel(), dim(),
// is_contiguous(), is_neg(), data_ptr()) with the Python C API, not through DLPack: exporting a
// DLPack capsule costs ~3.5 us per tensor, more than stepping a 1k-element tensor, while these
// reads cost ~0.3 us. Nothing is converted: a float64 or strided tensor is refused, never
// copied, because an update applied to a temporary copy would leave the caller's tensor
// unchanged. The module is not built against torch; it imports torch on first use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include <cstdint>
#include <string>
#include <vector>

#include "roundpipe/optim.hpp"

namespace nb = nanobind;

namespace {

// torch's types and the attribute names read per tensor, looked up once (and kept for the
// life of the process: they must outlive any call).
struct Torch {
  PyObject* tensor_type;
  PyObject *float32, *bfloat16, *float16, *strided;
  PyObject *dtype, *is_cpu, *layout, *numel, *dim, *is_contiguous, *is_neg, *data_ptr, *device;
};

const Torch& torch_api() {
  static const Torch* api = [] {
    nb::module_ torch = nb::module_::import_("torch");
    auto keep = [](nb::object o) { return o.release().ptr(); };
    auto name = [](const char* n) { return PyUnicode_InternFromString(n); };
    return new Torch{keep(torch.attr("Tensor")), keep(torch.attr("float32")),
                     keep(torch.attr("bfloat16")), keep(torch.attr("float16")),
                     keep(torch.attr("strided")), name("dtype"), name("is_cpu"), name("layout"),
                     name("numel"), name("dim"), name("is_contiguous"), name("is_neg"), name("data_ptr"),
                     name("device")};
  }();
  return *api;
}

std::string where(const char* fn, const char* arg, std::size_t i) {
  return std::string(fn) + ": " + arg + "[" + std::to_string(i) + "]";
}

nb::object get(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

nb::object call(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

std::string text(PyObject* obj) { return nb::cast<std::string>(nb::str(nb::handle(obj))); }

// Which dtypes an argument accepts.
enum class Accept { float32, any_float };

// A checked tensor: its data, size and element type.
struct Tensor {
  void* data;
  std::size_t numel;
  long ndim;
  roundpipe::Dtype dtype;
};

// Checks one tensor and returns its data. `like` (if given) is the parameter it belongs to,
// whose number of elements and of dimensions it must have; `read_dim` reads the dimension count
// of a tensor that will serve as `like`. The shape itself is not compared:
// reading it costs more than all other checks together; torch checks a gradient's shape when it
// is assigned to .grad, and roundpipe.optim checks loaded state against the parameters.
Tensor checked(PyObject* t, const char* fn, const char* arg, std::size_t i, Accept accept,
               const Tensor* like, bool read_dim = false) {
  const Torch& T = torch_api();
  if (!PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(T.tensor_type)))
    throw nb::type_error((where(fn, arg, i) + " must be a torch.Tensor, got " +
                          Py_TYPE(t)->tp_name).c_str());
  nb::object dtype = get(t, T.dtype);
  Tensor out{nullptr, 0, 0, roundpipe::Dtype::float32};
  if (dtype.ptr() == T.float32) {
  } else if (accept == Accept::any_float && dtype.ptr() == T.bfloat16) {
    out.dtype = roundpipe::Dtype::bfloat16;
  } else if (accept == Accept::any_float && dtype.ptr() == T.float16) {
    out.dtype = roundpipe::Dtype::float16;
  } else {
    throw nb::type_error((where(fn, arg, i) + " must be " +
                          (accept == Accept::float32 ? "float32" : "float32, bfloat16 or float16") +
                          ", got " + text(dtype.ptr())).c_str());
  }
  if (get(t, T.is_cpu).ptr() != Py_True)
    throw nb::type_error((where(fn, arg, i) + " must be a CPU tensor, got " +
                          text(get(t, T.device).ptr())).c_str());
  if (get(t, T.layout).ptr() != T.strided)
    throw nb::type_error((where(fn, arg, i) + " must be a dense tensor, got " +
                          text(get(t, T.layout).ptr())).c_str());
  const Py_ssize_t numel = PyLong_AsSsize_t(call(t, T.numel).ptr());
  if (numel < 0) throw nb::python_error();
  out.numel = static_cast<std::size_t>(numel);
  if (like || read_dim) {
    out.ndim = PyLong_AsLong(call(t, T.dim).ptr());
    if (out.ndim < 0) throw nb::python_error();
  }
  if (like && (out.numel != like->numel || out.ndim != like->ndim))
    throw nb::value_error((where(fn, arg, i) + " must have the shape of params[" +
                           std::to_string(i) + "] (" + std::to_string(like->numel) +
                           " elements in " + std::to_string(like->ndim) + " dimensions), got " +
                           std::to_string(out.numel) + " in " + std::to_string(out.ndim)).c_str());
  if (numel > 1 && call(t, T.is_contiguous).ptr() != Py_True)
    throw nb::value_error((where(fn, arg, i) + " must be contiguous").c_str());
  if (call(t, T.is_neg).ptr() != Py_False)  // a lazily negated view: its memory holds -x
    throw nb::value_error((where(fn, arg, i) + " is a negated view (is_neg()); pass "
                           "t.resolve_neg()").c_str());
  out.data = PyLong_AsVoidPtr(call(t, T.data_ptr).ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  return out;
}

// A list argument: one entry per parameter (None marks a parameter without a gradient, which
// the step skips; its entries in every other list must be None too).
struct List {
  nb::object seq;  // the fast sequence
  const char* name;
  std::size_t size() const { return static_cast<std::size_t>(PySequence_Fast_GET_SIZE(seq.ptr())); }
  PyObject* operator[](std::size_t i) const { return PySequence_Fast_GET_ITEM(seq.ptr(), i); }
};

List as_list(nb::handle h, const char* fn, const char* name) {
  if (!PyList_Check(h.ptr()) && !PyTuple_Check(h.ptr()))
    throw nb::type_error((std::string(fn) + ": " + name + " must be a list, got " +
                          Py_TYPE(h.ptr())->tp_name).c_str());
  return List{nb::borrow(h), name};
}

void check_count(const char* fn, const List& l, std::size_t n) {
  if (l.size() != n)
    throw nb::value_error((std::string(fn) + ": " + l.name + " has " + std::to_string(l.size()) +
                           " tensors, params has " + std::to_string(n)).c_str());
}

// The entry at i of a list whose entry must be present (params[i] is).
PyObject* present(const List& l, const char* fn, std::size_t i) {
  PyObject* t = l[i];
  if (t == Py_None)
    throw nb::value_error((where(fn, l.name, i) + " is None but params[" + std::to_string(i) +
                           "] is not").c_str());
  return t;
}

template <class Options>
using StepFn = void (*)(const Options&, const roundpipe::ParamBuffers*, std::size_t,
                        roundpipe::StepIO*);

// Binds `fn` as `name(options, params, grads, states, scalars, model_copies=None, io=None)`.
// `states` holds one list per state slot, in slot order and named by state_names; `scalars` one
// list per 0-dim state slot, named by scalar_names (scalars[0]: the steps, or SGD's
// momentum-buffer flags). In both, an empty or missing trailing list means the slot is not
// passed (its pointers stay null, which the step accepts only for a slot its options leave
// unused). Gradients may be float32, bfloat16 or float16; model_copies (float32, bfloat16 or
// float16) receive the updated parameters; `io` (StepIO) scales gradients and reports found_inf
// and the squared gradient norm (roundpipe/step_io.hpp). `num_threads` > 0 runs this call on that
// many threads instead of num_threads() (a per-optimizer thread count).
template <class Options>
void def_step(nb::module_& m, const char* name, StepFn<Options> fn,
              std::vector<const char*> state_names, std::vector<const char*> scalar_names,
              const char* doc) {
  m.def(
      name,
      [fn, name, state_names, scalar_names](const Options& options, nb::handle params_arg,
                                            nb::handle grads_arg, nb::handle states_arg,
                                            nb::handle scalars_arg, nb::handle copies_arg,
                                            roundpipe::StepIO* io, int num_threads) {
        const roundpipe::ThreadCountScope threads(num_threads);
        const List params = as_list(params_arg, name, "params");
        const List grads = as_list(grads_arg, name, "grads");
        const List states_outer = as_list(states_arg, name, "states");
        const List scalars_outer = as_list(scalars_arg, name, "scalars");
        const std::size_t n = params.size();
        if (states_outer.size() > state_names.size() || scalars_outer.size() > scalar_names.size())
          throw nb::value_error((std::string(name) + ": expected at most " +
                                 std::to_string(state_names.size()) + " state lists and " +
                                 std::to_string(scalar_names.size()) + " scalar lists").c_str());
        check_count(name, grads, n);
        std::vector<List> states, scalars;
        for (std::size_t k = 0; k < states_outer.size(); ++k) {
          states.push_back(as_list(states_outer[k], name, state_names[k]));
          if (states.back().size() != 0) check_count(name, states.back(), n);
        }
        for (std::size_t k = 0; k < scalars_outer.size(); ++k) {
          scalars.push_back(as_list(scalars_outer[k], name, scalar_names[k]));
          if (scalars.back().size() != 0) check_count(name, scalars.back(), n);
        }
        std::optional<List> copies;
        if (!copies_arg.is_none()) {
          copies = as_list(copies_arg, name, "model_copies");
          check_count(name, *copies, n);
        }
        std::vector<roundpipe::ParamBuffers> tensors;
        tensors.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
          PyObject* p = params[i];
          if (p == Py_None) continue;
          roundpipe::ParamBuffers t;
          const Tensor param = checked(p, name, "params", i, Accept::float32, nullptr, true);
          t.param = static_cast<float*>(param.data);
          t.numel = param.numel;
          const Tensor g = checked(present(grads, name, i), name, "grads", i, Accept::any_float,
                                   &param);
          if (g.dtype == roundpipe::Dtype::float32) {
            t.grad = static_cast<const float*>(g.data);
          } else {
            t.grad16 = static_cast<const std::uint16_t*>(g.data);
            t.grad16_dtype = g.dtype;
          }
          for (std::size_t k = 0; k < states.size(); ++k)
            if (states[k].size() != 0)
              t.state[k] = static_cast<float*>(
                  checked(present(states[k], name, i), name, state_names[k], i, Accept::float32,
                          &param).data);
          for (std::size_t k = 0; k < scalars.size(); ++k) {
            if (scalars[k].size() == 0) continue;
            const Tensor s = checked(present(scalars[k], name, i), name, scalar_names[k], i,
                                     Accept::float32, nullptr);
            if (s.numel != 1)
              throw nb::value_error((where(name, scalar_names[k], i) + " must hold one element").c_str());
            t.scalar[k] = static_cast<float*>(s.data);
          }
          if (copies) {
            const Tensor c = checked(present(*copies, name, i), name, "model_copies", i,
                                     Accept::any_float, &param);
            t.model_copy = c.data;
            t.model_copy_dtype = c.dtype;
          }
          tensors.push_back(t);
        }
        nb::gil_scoped_release release;
        fn(options, tensors.data(), tensors.size(), io);
      },
      nb::arg("options"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
      nb::arg("scalars"), nb::arg("model_copies") = nb::none(), nb::arg("io").none() = nb::none(),
      nb::arg("num_threads") = 0, doc);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "RoundPipe CPU optimizer kernels (float32, CPU, contiguous tensors; gradients may also be\n"
      "bfloat16/float16). Every <algo>_step also takes model_copies=None (tensors receiving the\n"
      "updated parameters as float32/bfloat16/float16), io=None (a StepIO) and num_threads=0.";

  nb::class_<roundpipe::StepIO>(
      m, "StepIO",
      "roundpipe::StepIO: per-call gradient scale (gradients multiplied by float32(1 /\n"
      "grad_scale)) and want_grad_norm in; found_inf and grad_norm_sq out. Passing one (or any\n"
      "bfloat16/float16 gradient or model copy) selects the fused mixed-precision pass.")
      .def(nb::init<>())
      .def_rw("grad_scale", &roundpipe::StepIO::grad_scale)
      .def_rw("want_grad_norm", &roundpipe::StepIO::want_grad_norm)
      .def_rw("found_inf", &roundpipe::StepIO::found_inf)
      .def_rw("grad_norm_sq", &roundpipe::StepIO::grad_norm_sq);

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
