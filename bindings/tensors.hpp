// The bindings' view of torch tensors, without building against torch: checking a tensor is
// what the kernels need (CPU, dense, C-contiguous, a dtype the argument accepts, matching element
// counts; each problem a TypeError/ValueError naming the argument and index) and reading its data
// pointer, through the tensor's own attributes with the Python C API.
//
// Reads go through the descriptors of torch._C.TensorBase (looked up once) rather than attribute
// lookups by name, for the types whose attributes resolve to those descriptors (torch.Tensor,
// nn.Parameter and any subclass that does not override them): the same getters and methods,
// without searching the type's MRO and the instance dict on every read. DLPack is not used:
// exporting a capsule costs ~3.5 us per tensor, more than stepping a 1k-element tensor.
// Nothing is converted: a float64 or strided tensor is refused, never copied, because an update
// applied to a temporary copy would leave the caller's tensor unchanged.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#include <unistd.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <string>
#include <vector>

#include "roundpipe/roundpipe.hpp"


namespace rpbind {

namespace nb = nanobind;

namespace {  // one translation unit includes this (module.cpp)

// One attribute read per tensor: its interned name and torch._C.TensorBase's descriptor for it
// (a getter or a method).
struct Attr {
  PyObject* name;
  PyObject* descr;
  bool method;
};

// torch's types and the attributes read per tensor, looked up once (and kept for the life of the
// process: they must outlive any call).
struct Torch {
  PyObject* tensor_type;
  PyObject *float32, *bfloat16, *float16, *uint8, *strided;
  Attr dtype, is_cpu, layout, numel, dim, is_contiguous, is_neg, data_ptr, device, grad, nbytes,
      version, shape;
  std::vector<std::pair<PyTypeObject*, bool>> types;  // tensor types seen: reads via descriptors?
};

inline Torch& torch_api() {
  static Torch* api = [] {
    nb::module_ torch = nb::module_::import_("torch");
    auto keep = [](nb::object o) { return o.release().ptr(); };
    nb::object base = nb::module_::import_("torch._C").attr("TensorBase");
    auto attr = [&](const char* n, bool method) {
      return Attr{PyUnicode_InternFromString(n), keep(base.attr("__dict__")[n]), method};
    };
    return new Torch{keep(torch.attr("Tensor")), keep(torch.attr("float32")),
                     keep(torch.attr("bfloat16")), keep(torch.attr("float16")),
                     keep(torch.attr("uint8")), keep(torch.attr("strided")),
                     attr("dtype", false), attr("is_cpu", false), attr("layout", false),
                     attr("numel", true), attr("dim", true), attr("is_contiguous", true),
                     attr("is_neg", true), attr("data_ptr", true), attr("device", false),
                     attr("grad", false), attr("nbytes", false), attr("_version", false),
                     attr("shape", false), {}};
  }();
  return *api;
}

// Whether every attribute of `type` resolves to TensorBase's descriptor (no subclass overrides
// it), so that reading through the descriptor is what getattr does. Decided once per type.
inline bool reads_via_descriptors(PyTypeObject* type) {
  Torch& T = torch_api();
  for (const auto& [t, fast] : T.types)
    if (t == type) return fast;
  bool fast = true;
  for (const Attr* a : {&T.dtype, &T.is_cpu, &T.layout, &T.numel, &T.dim, &T.is_contiguous,
                        &T.is_neg, &T.data_ptr, &T.grad, &T.nbytes, &T.version, &T.shape}) {
    PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(type), a->name);
    if (!d) {
      PyErr_Clear();
      fast = false;
      break;
    }
    fast = fast && d == a->descr;
    Py_DECREF(d);
  }
  Py_INCREF(type);  // kept with its verdict
  T.types.emplace_back(type, fast);
  return fast;
}

// The attribute's value (a getter's result, or the method called without arguments).
inline nb::object read(PyObject* obj, const Attr& a) {
  PyObject* r;
  if (reads_via_descriptors(Py_TYPE(obj))) {
    r = a.method ? PyObject_Vectorcall(a.descr, &obj, 1, nullptr)
                 : Py_TYPE(a.descr)->tp_descr_get(a.descr, obj,
                                                  reinterpret_cast<PyObject*>(Py_TYPE(obj)));
  } else {
    r = a.method ? PyObject_CallMethodNoArgs(obj, a.name) : PyObject_GetAttr(obj, a.name);
  }
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

inline std::string where(const char* fn, const char* arg, std::size_t i) {
  return std::string(fn) + ": " + arg + "[" + std::to_string(i) + "]";
}

std::string text(PyObject* obj) { return nb::cast<std::string>(nb::str(nb::handle(obj))); }

// Which dtypes an argument accepts: float32 only; float32, bfloat16 or float16 (gradients,
// model copies); float32 or bfloat16 (parameters with stochastic rounding); float32 (parameters
// without: the message says how to allow bfloat16); float32, bfloat16 or uint8 (state:
// float32, bfloat16 or int8 codes, roundpipe/compact.hpp).
enum class Accept { float32, any_float, param, param_fp32, state };

// A checked tensor: its data, size and element type (`codes`: uint8, int8 state codes).
struct Tensor {
  void* data;
  std::size_t numel;
  long ndim;
  roundpipe::Dtype dtype;
  bool codes = false;  // uint8 (int8 state codes)
};

const char* accepted(Accept a) {
  switch (a) {
    case Accept::float32: return "float32";
    case Accept::any_float: return "float32, bfloat16 or float16";
    case Accept::param: return "float32 or bfloat16";
    case Accept::param_fp32:
      return "float32 (bfloat16 parameters need stochastic rounding: stochastic_rounding=True)";
    default: return "float32, bfloat16 or uint8 (int8 codes)";
  }
}

// Checks one tensor and returns its data. `like` (if given) is the parameter it belongs to,
// whose number of elements and of dimensions it must have; `read_dim` reads the dimension count
// of a tensor that will serve as `like`. The shape itself is not compared:
// reading it costs more than all other checks together; torch checks a gradient's shape when it
// is assigned to .grad, and roundpipe.optim checks loaded state against the parameters.
Tensor checked(PyObject* t, const char* fn, const char* arg, std::size_t i, Accept accept,
               const Tensor* like, bool read_dim = false) {
  Torch& T = torch_api();
  if (!PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(T.tensor_type)))
    throw nb::type_error((where(fn, arg, i) + " must be a torch.Tensor, got " +
                          Py_TYPE(t)->tp_name).c_str());
  nb::object dtype = read(t, T.dtype);
  Tensor out{nullptr, 0, 0, roundpipe::Dtype::float32};
  if (dtype.ptr() == T.float32) {
  } else if ((accept == Accept::any_float || accept == Accept::param ||
              accept == Accept::state) && dtype.ptr() == T.bfloat16) {
    out.dtype = roundpipe::Dtype::bfloat16;
  } else if (accept == Accept::any_float && dtype.ptr() == T.float16) {
    out.dtype = roundpipe::Dtype::float16;
  } else if (accept == Accept::state && dtype.ptr() == T.uint8) {
    out.codes = true;
  } else {
    throw nb::type_error((where(fn, arg, i) + " must be " + accepted(accept) + ", got " +
                          text(dtype.ptr())).c_str());
  }
  if (read(t, T.is_cpu).ptr() != Py_True)
    throw nb::type_error((where(fn, arg, i) + " must be a CPU tensor, got " +
                          text(read(t, T.device).ptr())).c_str());
  if (read(t, T.layout).ptr() != T.strided)
    throw nb::type_error((where(fn, arg, i) + " must be a dense tensor, got " +
                          text(read(t, T.layout).ptr())).c_str());
  const Py_ssize_t numel = PyLong_AsSsize_t(read(t, T.numel).ptr());
  if (numel < 0) throw nb::python_error();
  out.numel = static_cast<std::size_t>(numel);
  if (like || read_dim) {
    out.ndim = PyLong_AsLong(read(t, T.dim).ptr());
    if (out.ndim < 0) throw nb::python_error();
  }
  if (like && (out.numel != like->numel || out.ndim != like->ndim))
    throw nb::value_error((where(fn, arg, i) + " must have the shape of params[" +
                           std::to_string(i) + "] (" + std::to_string(like->numel) +
                           " elements in " + std::to_string(like->ndim) + " dimensions), got " +
                           std::to_string(out.numel) + " in " + std::to_string(out.ndim)).c_str());
  if (numel > 1 && read(t, T.is_contiguous).ptr() != Py_True)
    throw nb::value_error((where(fn, arg, i) + " must be contiguous").c_str());
  if (read(t, T.is_neg).ptr() != Py_False)  // a lazily negated view: its memory holds -x
    throw nb::value_error((where(fn, arg, i) + " is a negated view (is_neg()); pass "
                           "t.resolve_neg()").c_str());
  out.data = PyLong_AsVoidPtr(read(t, T.data_ptr).ptr());
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

// Whether an algorithm's step reads ParamBuffers::rows and cols (State::factored).
template <class State, class = void>
struct Factored : std::false_type {};
template <class State>
struct Factored<State, std::void_t<decltype(State::factored)>> : std::bool_constant<State::factored> {};

// rows and cols of a tensor of two or more dimensions: its last two sizes.
void read_matrix_shape(PyObject* t, long ndim, roundpipe::ParamBuffers& out) {
  if (ndim < 2) return;
  nb::object shape = read(t, torch_api().shape);
  out.rows = nb::cast<std::size_t>(nb::handle(PyTuple_GetItem(shape.ptr(), ndim - 2)));
  out.cols = nb::cast<std::size_t>(nb::handle(PyTuple_GetItem(shape.ptr(), ndim - 1)));
}


// One parameter's tensors checked into the ParamBuffers a step takes (TypeError / ValueError
// naming `fn: <arg>[i]`, raised before anything is modified). `states[k]`, `absmax[k]` and
// `scalars[k]` are slot k's tensors: nullptr where the slot is not passed, None (a factored
// algorithm's slot that the tensor does not use) skipped. State is float32, bfloat16 or uint8
// int8 codes, which need their absmax (quant_blocks(numel) float32 values); `copy` (or nullptr)
// receives the updated parameter; a bfloat16 parameter only with `bf16_params`.
template <class State>
roundpipe::ParamBuffers check_param(const char* fn, std::size_t i, PyObject* p, PyObject* g,
                                    PyObject* const* states, PyObject* const* absmax,
                                    PyObject* const* scalars, PyObject* copy, bool bf16_params) {
  constexpr auto& state_names = State::state_names;
  constexpr auto& scalar_names = State::scalar_names;
  roundpipe::ParamBuffers t;
  const Tensor param = checked(p, fn, "params", i, bf16_params ? Accept::param : Accept::param_fp32,
                               nullptr, true);
  if (param.dtype == roundpipe::Dtype::bfloat16)
    t.param_bf16 = static_cast<std::uint16_t*>(param.data);
  else
    t.param = static_cast<float*>(param.data);
  t.numel = param.numel;
  if constexpr (Factored<State>::value) read_matrix_shape(p, param.ndim, t);
  const Tensor grad = checked(g, fn, "grads", i, Accept::any_float, &param);
  if (grad.dtype == roundpipe::Dtype::float32) {
    t.grad = static_cast<const float*>(grad.data);
  } else {
    t.grad16 = static_cast<const std::uint16_t*>(grad.data);
    t.grad16_dtype = grad.dtype;
  }
  for (std::size_t k = 0; k < state_names.size(); ++k) {
    if (!states[k]) continue;
    Tensor like = param;  // a factored algorithm's factors: the matrices' rows, columns
    if constexpr (Factored<State>::value) {
      // a tensor keeps either the factors or the variance: the other slots are None
      if (states[k] == Py_None || (k < 2 && param.numel == 0)) continue;
      if (k < 2 && param.ndim >= 2) like.numel = param.numel / (k == 0 ? t.cols : t.rows);
    }
    const Tensor st = checked(states[k], fn, state_names[k], i, Accept::state, &like);
    if (st.codes) {
      t.state_format[k] = roundpipe::StateFormat::int8;
      t.packed_state[k] = st.data;
      if (!absmax[k] || absmax[k] == Py_None)
        throw nb::value_error((where(fn, state_names[k], i) + " holds int8 codes (uint8) but "
                               "no absmax was given").c_str());
      const Tensor a = checked(absmax[k], fn, "absmax", i, Accept::float32, nullptr);
      if (a.numel != roundpipe::quant_blocks(param.numel))
        throw nb::value_error((where(fn, "absmax", i) + " (" + state_names[k] + ") must hold " +
                               std::to_string(roundpipe::quant_blocks(param.numel)) +
                               " values, one per block of " +
                               std::to_string(roundpipe::kQuantBlock) + " elements, got " +
                               std::to_string(a.numel)).c_str());
      t.state_absmax[k] = static_cast<float*>(a.data);
    } else if (st.dtype == roundpipe::Dtype::bfloat16) {
      t.state_format[k] = roundpipe::StateFormat::bfloat16;
      t.packed_state[k] = st.data;
    } else {
      t.state[k] = static_cast<float*>(st.data);
    }
  }
  for (std::size_t k = 0; k < scalar_names.size(); ++k) {
    if (!scalars[k]) continue;
    const Tensor s = checked(scalars[k], fn, scalar_names[k], i, Accept::float32, nullptr);
    if (s.numel != 1)
      throw nb::value_error((where(fn, scalar_names[k], i) + " must hold one element").c_str());
    t.scalar[k] = static_cast<float*>(s.data);
  }
  if (copy) {
    const Tensor c = checked(copy, fn, "model_copies", i, Accept::any_float, &param);
    t.model_copy = c.data;
    t.model_copy_dtype = c.dtype;
  }
  return t;
}

}  // namespace
}  // namespace rpbind
