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
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#include <unistd.h>

#include <cstdint>
#include <optional>
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

// Takes the GIL back after without_gil's call. When the interpreter is finalizing (a step ran in a
// daemon thread while the main thread exited), CPython before 3.14 ends this thread with
// pthread_exit, whose forced unwinding aborts the process ("terminate called without an active
// exception") at the first noexcept frame (nanobind's gil_scoped_release destructor) or catch
// (...) that does not rethrow (nanobind's dispatcher). The thread is parked instead, as CPython
// 3.14 does itself: the step is done, it holds no lock, and the process exits normally.
void take_gil(PyThreadState* state) {
#if defined(__GLIBCXX__)
  try {
    PyEval_RestoreThread(state);
  } catch (abi::__forced_unwind&) {
    for (;;) pause();
  }
#else
  PyEval_RestoreThread(state);
#endif
}

// Runs fn() with the GIL released (the step's threads never need it).
template <class Fn>
void without_gil(Fn&& fn) {
  PyThreadState* state = PyEval_SaveThread();
  try {
    fn();
  } catch (...) {
    take_gil(state);
    throw;
  }
  take_gil(state);
}

template <class Options>
using StepFn = void (*)(const Options&, const roundpipe::ParamBuffers*, std::size_t,
                        roundpipe::StepIO*);

// Binds `fn` as `name(options, params, grads, states, scalars, model_copies=None, io=None,
// num_threads=0)`. `states` holds one list per state slot, in slot order; `scalars` one list per
// 0-dim state slot (scalars[0]: the steps, or SGD's momentum-buffer flags); the slots are
// State's (e.g. roundpipe::AdamState), whose names the messages use (`exp_avg_sq[3]`: parameter
// 3's exp_avg_sq). In both, an empty or missing trailing list means the slot is not passed (its
// pointers stay null, which the step accepts only for a slot its options leave unused).
// Gradients may be float32, bfloat16 or float16; model_copies (float32, bfloat16 or float16)
// receive the updated parameters; `io` (StepIO) scales gradients and reports found_inf and the
// squared gradient norm (roundpipe/step_io.hpp). `num_threads` > 0 runs this call on that many
// threads instead of num_threads() (a per-optimizer thread count).
template <class Options, class State>
void def_step(nb::module_& m, const char* name, StepFn<Options> fn, const std::string& doc) {
  m.def(
      name,
      [fn, name](const Options& options, nb::handle params_arg, nb::handle grads_arg,
                 nb::handle states_arg, nb::handle scalars_arg, nb::handle copies_arg,
                 roundpipe::StepIO* io, int num_threads) {
        constexpr auto& state_names = State::state_names;
        constexpr auto& scalar_names = State::scalar_names;
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
        without_gil([&] { fn(options, tensors.data(), tensors.size(), io); });
      },
      nb::arg("options"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
      nb::arg("scalars"), nb::arg("model_copies") = nb::none(), nb::arg("io").none() = nb::none(),
      nb::arg("num_threads") = 0, doc.c_str());
}

template <class Names>
std::string join(const Names& names) {
  std::string out;
  for (const char* n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

// Binds roundpipe::<Name>Options as `<Name>Options` (every field read-write, named as in C++)
// and roundpipe::<name>_step as `<name>_step` (def_step).
template <class Options, class State>
void def_algorithm(nb::module_& m, const char* options_name, const char* step_name,
                   const char* header, StepFn<Options> fn) {
  const std::string doc = std::string("roundpipe::") + options_name + " (" + header +
                          "): the hyperparameters, named and defaulted as in torch.optim.";
  nb::class_<Options> options(m, options_name, doc.c_str());
  options.def(nb::init<>());
  Options::for_each_field([&](const char* field, auto member) { options.def_rw(field, member); });
  def_step<Options, State>(
      m, step_name, fn,
      std::string(step_name) + "(options, params, grads, [" + join(State::state_names) + "], [" +
          join(State::scalar_names) + "], model_copies=None, io=None, num_threads=0):\n"
          "roundpipe::" + step_name + " (" + header + ") over lists of CPU tensors, one entry per\n"
          "parameter: float32 params, float32/bfloat16/float16 grads, per-slot lists of float32\n"
          "state tensors shaped like the params and of 0-dim float32 scalars (a slot the options\n"
          "leave unused may be []). A None in params skips that position (None there in every\n"
          "list).");
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
      .def_rw("grad_clip", &roundpipe::StepIO::grad_clip)
      .def_rw("want_grad_norm", &roundpipe::StepIO::want_grad_norm)
      .def_rw("found_inf", &roundpipe::StepIO::found_inf)
      .def_rw("grad_norm_sq", &roundpipe::StepIO::grad_norm_sq);

#define ROUNDPIPE_BIND(name, Name)                                                      \
  def_algorithm<roundpipe::Name##Options, roundpipe::Name##State>(                           \
      m, #Name "Options", #name "_step", "roundpipe/" #name ".hpp", &roundpipe::name##_step);
  ROUNDPIPE_STEP_FUNCTIONS(ROUNDPIPE_BIND)
#undef ROUNDPIPE_BIND

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
