// StepPlan: a param group's tensors, checked once and kept as the ParamBuffers the step takes;
// each step re-checks only what can change between steps, so that a step over many small
// tensors costs little more than the kernels' work (docs/design.md §4):
// - the group's parameter list (the same objects), the optimizer's state dict (the same
//   per-parameter dicts, each holding the same tensors: compared by identity, the objects kept
//   alive by the plan so that identity means what it says);
// - per parameter: its gradient (a new tensor at each backward unless zero_grad keeps them:
//   checked fully when new); the parameter's data pointer, size in bytes and version counter
//   (a replaced .data, a resize, an in-place view op such as t_()).
// State tensors and a gradient seen before are recognised by identity (a state tensor replaced
// in its dict, a new dict from load_state_dict, a new gradient, is seen); the plan keeps their
// storages alive, so that replacing such a tensor's .data in place, which it does not see,
// cannot make it touch freed memory (the step then uses the storage the tensor had). Reading a
// data pointer through Tensor.data_ptr() costs 50-200 ns (cold caches after the previous step
// streamed the state), which per tensor and step is what this saves.
// Anything else differing re-checks that parameter as the list-based step does. A step the plan
// cannot take as the list-based step would (missing or new state to create, a tensor the checks
// refuse, a sparse gradient) leaves everything untouched and returns false: the caller then
// takes the list-based path, which creates the state or raises the error.
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "roundpipe/roundpipe.hpp"
#include "tensors.hpp"

namespace rpbind {

class StepPlan {
 public:
  /// `state_keys`: the state key of each per-element slot, in slot order; `scalar_specs`: per
  /// 0-dim slot, its state key (str) or a tensor every parameter shares (SGD's momentum-ready
  /// flag).
  StepPlan(std::vector<std::string> state_keys, nb::tuple scalar_specs)
      : state_keys_(std::move(state_keys)) {
    for (nb::handle spec : scalar_specs) scalar_specs_.push_back(nb::borrow(spec));
    for (const std::string& k : state_keys_)
      absmax_keys_.push_back(nb::steal(PyUnicode_FromString((k + "_absmax").c_str())));
    for (const std::string& k : state_keys_)
      state_key_objs_.push_back(nb::steal(PyUnicode_FromString(k.c_str())));
  }

  /// The step's tensors, or false when the list-based step must run instead (nothing was
  /// modified). `params`: the group's list; `opt_state`: the optimizer's state dict; `active`:
  /// bit k set when the group uses slot k; rounding seeds from `seed` and the parameters'
  /// positions from `first_index` (mixed with `seed_mix` unless 0) when `rounds`.
  template <class State>
  bool prepare(const char* fn, nb::handle params, nb::handle opt_state, unsigned active,
               bool bf16_params, bool rounds, std::uint64_t seed, std::size_t first_index,
               std::uint64_t seed_mix) {
    if (!PyList_Check(params.ptr()) || !PyDict_Check(opt_state.ptr())) return false;
    const std::size_t n = static_cast<std::size_t>(PyList_GET_SIZE(params.ptr()));
    const bool settings = active != active_ || bf16_params != bf16_params_ || rounds != rounds_ ||
                          seed != seed_ || first_index != first_index_;
    if (!params_.is(params) || entries_.size() != n || settings) {
      params_ = nb::borrow(params);
      entries_.assign(n, Entry{});
      active_ = active;
      bf16_params_ = bf16_params;
      rounds_ = rounds;
      seed_ = seed;
      first_index_ = first_index;
    }
    track_state(opt_state);
    tensors_.clear();
    stepped_.clear();
    Torch& T = torch_api();
    for (std::size_t i = 0; i < n; ++i) {
      PyObject* p = PyList_GET_ITEM(params.ptr(), i);
      Entry& e = entries_[i];
      if (!e.param.is(p)) {
        e = Entry{};
        e.param = nb::borrow(p);
      }
      nb::object grad = read(p, T.grad);
      if (grad.is_none()) continue;
      if (!(e.valid && unchanged(e))) {
        e.valid = false;
        if (!validate<State>(fn, i, e, grad.ptr())) return false;
      }
      roundpipe::ParamBuffers t = e.buffers;
      if (!set_grad(t, grad.ptr(), e)) {  // not what the quick check accepts: check it fully
        e.valid = false;
        if (!validate<State>(fn, i, e, grad.ptr())) return false;
        t = e.buffers;
      }
      if (rounds_ && seed_mix) t.rounding_seed = roundpipe::rounding_seed(t.rounding_seed, seed_mix);
      tensors_.push_back(t);
      stepped_.push_back(i);
    }
    return true;
  }

  std::vector<roundpipe::ParamBuffers>& tensors() { return tensors_; }

  /// After the step: the stepped parameters' version counters, bumped as torch's in-place ops
  /// do (the kernels write through raw pointers, which autograd cannot see).
  void mark_updated() {
    if (stepped_.empty()) return;
    nb::list updated;
    for (std::size_t i : stepped_) updated.append(entries_[i].param);
    static PyObject* bump =
        nb::object(nb::module_::import_("torch._C").attr("_increment_version")).release().ptr();
    nb::handle{bump}(updated);
    for (std::size_t i : stepped_) ++entries_[i].version;
  }

 private:
  struct Sig {  // what must not change under a cached pointer
    void* data = nullptr;
    Py_ssize_t nbytes = -1;
  };
  struct Entry {
    nb::object param;
    bool valid = false;
    nb::object state;                       // the parameter's state dict (or none)
    std::size_t state_generation = ~std::size_t{0};  // of the optimizer's dict it was found in
    std::vector<nb::object> items;          // its (key, value) pairs, as checked
    std::vector<nb::object> storages;       // of the state tensors: kept alive (header comment)
    Sig param_sig;
    long version = 0;
    nb::object grad, grad_storage;          // the gradient checked last (its storage kept alive)
    const void* grad_data = nullptr;
    PyObject* grad_dtype = nullptr;
    roundpipe::ParamBuffers buffers;
  };

  static Py_ssize_t as_size(const nb::object& o) {
    const Py_ssize_t v = PyLong_AsSsize_t(o.ptr());
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    return v;
  }
  static Sig sig(PyObject* t) {
    Torch& T = torch_api();
    void* data = PyLong_AsVoidPtr(read(t, T.data_ptr).ptr());
    if (PyErr_Occurred()) throw nb::python_error();
    return Sig{data, as_size(read(t, T.nbytes))};
  }
  static bool same(PyObject* t, const Sig& s) {
    const Sig now = sig(t);
    return now.data == s.data && now.nbytes == s.nbytes;
  }

  // The optimizer's state dict as a map from parameter to its dict, rebuilt when the dict is
  // another object or its (key, value) pairs differ from those seen last.
  void track_state(nb::handle opt_state) {
    PyObject* d = opt_state.ptr();
    bool same_items = state_.is(opt_state) &&
                      static_cast<std::size_t>(PyDict_GET_SIZE(d)) == state_items_.size() / 2;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    for (std::size_t j = 0; same_items && PyDict_Next(d, &pos, &k, &v); j += 2)
      same_items = state_items_[j].is(k) && state_items_[j + 1].is(v);
    if (same_items) return;
    ++state_generation_;
    state_ = nb::borrow(opt_state);
    state_items_.clear();
    state_of_.clear();
    pos = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
      state_items_.push_back(nb::borrow(k));
      state_items_.push_back(nb::borrow(v));
      state_of_[k] = v;
    }
  }

  // Whether nothing a cached entry relies on changed (its state dict, that dict's pairs, the
  // parameter's and state's pointers and sizes, the parameter's version).
  bool unchanged(Entry& e) {
    Torch& T = torch_api();
    PyObject* d = e.state.ptr();
    if (e.state_generation != state_generation_) {  // the optimizer's state dict changed
      const auto it = state_of_.find(e.param.ptr());
      if ((it == state_of_.end() ? nullptr : it->second) != d) return false;
      e.state_generation = state_generation_;
    }
    if (d) {
      if (static_cast<std::size_t>(PyDict_GET_SIZE(d)) != e.items.size() / 2) return false;
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      for (std::size_t j = 0; PyDict_Next(d, &pos, &k, &v); j += 2)
        if (!e.items[j].is(k) || !e.items[j + 1].is(v)) return false;
    }
    return same(e.param.ptr(), e.param_sig) &&
           as_size(read(e.param.ptr(), T.version)) == e.version;
  }

  // A gradient for a checked entry: the one checked last (its pointer and size compared), or a
  // new one, checked as the list-based step checks it (the same dtype as the one before).
  bool set_grad(roundpipe::ParamBuffers& t, PyObject* g, Entry& e) {
    Torch& T = torch_api();
    void* data;
    if (e.grad.is(g)) {  // the same tensor (zero_grad(set_to_none=False), reused buffers)
      data = const_cast<void*>(e.grad_data);
    } else {
      if (!PyObject_TypeCheck(g, reinterpret_cast<PyTypeObject*>(T.tensor_type))) return false;
      if (!read(g, T.dtype).is(nb::handle(e.grad_dtype))) return false;
      if (read(g, T.is_cpu).ptr() != Py_True || !read(g, T.layout).is(nb::handle(T.strided)))
        return false;
      const Py_ssize_t elem = e.grad_dtype == T.float32 ? 4 : 2;
      const Py_ssize_t nbytes = as_size(read(g, T.nbytes));
      if (nbytes != static_cast<Py_ssize_t>(t.numel) * elem) return false;
      if (t.numel > 1 && read(g, T.is_contiguous).ptr() != Py_True) return false;
      if (read(g, T.is_neg).ptr() != Py_False) return false;
      data = PyLong_AsVoidPtr(read(g, T.data_ptr).ptr());
      if (PyErr_Occurred()) throw nb::python_error();
      e.grad = nb::borrow(g);
      e.grad_storage = nb::steal(PyObject_CallMethod(g, "untyped_storage", nullptr));
      if (!e.grad_storage.is_valid()) throw nb::python_error();
      e.grad_data = data;
    }
    if (e.grad_dtype == T.float32) {
      t.grad = static_cast<const float*>(data);
    } else {
      t.grad16 = static_cast<const std::uint16_t*>(data);
      t.grad16_dtype = e.grad_dtype == T.bfloat16 ? roundpipe::Dtype::bfloat16 : roundpipe::Dtype::float16;
    }
    return true;
  }

  // Checks parameter i and its state as the list-based step does; false when that step must
  // run instead (state to create, a key missing, any check failing).
  template <class State>
  bool validate(const char* fn, std::size_t i, Entry& e, PyObject* grad) {
    constexpr int kS = roundpipe::ParamBuffers::kMaxState, kC = roundpipe::ParamBuffers::kMaxScalar;
    e.storages.clear();
    e.items.clear();
    e.grad = nb::object();
    const auto it = state_of_.find(e.param.ptr());
    PyObject* d = it == state_of_.end() ? nullptr : it->second;
    e.state = d ? nb::borrow(d) : nb::object();
    e.state_generation = state_generation_;
    bool needs_state = active_ != 0;
    for (const nb::object& spec : scalar_specs_) needs_state = needs_state || PyUnicode_Check(spec.ptr());
    if (needs_state && (!d || !PyDict_Check(d) || PyDict_GET_SIZE(d) == 0)) return false;
    PyObject* slot[kS] = {}, *absmax[kS] = {}, *scalar[kC] = {};
    for (std::size_t k = 0; k < state_keys_.size() && k < std::size_t(kS); ++k) {
      if (!(active_ >> k & 1u)) continue;
      PyObject* v = PyDict_GetItemWithError(d, state_key_objs_[k].ptr());
      if (!v) {
        if (PyErr_Occurred()) throw nb::python_error();
        if (!Factored<State>::value) return false;  // torch's KeyError: the list-based step
        slot[k] = Py_None;
        continue;
      }
      slot[k] = v;
      absmax[k] = PyDict_GetItemWithError(d, absmax_keys_[k].ptr());
      if (!absmax[k] && PyErr_Occurred()) throw nb::python_error();
    }
    for (std::size_t k = 0; k < scalar_specs_.size() && k < std::size_t(kC); ++k) {
      PyObject* spec = scalar_specs_[k].ptr();
      if (!PyUnicode_Check(spec)) {
        scalar[k] = spec;
        continue;
      }
      scalar[k] = PyDict_GetItemWithError(d, spec);
      if (!scalar[k]) {
        if (PyErr_Occurred()) throw nb::python_error();
        return false;
      }
    }
    try {
      e.buffers = check_param<State>(fn, i, e.param.ptr(), grad, slot, absmax, scalar, nullptr,
                                     bf16_params_);
    } catch (const nb::python_error&) {
      PyErr_Clear();
      return false;
    } catch (const nb::builtin_exception&) {
      return false;
    }
    Torch& T = torch_api();
    e.grad_dtype = read(grad, T.dtype).ptr();  // a torch.dtype: interned for the process
    e.param_sig = sig(e.param.ptr());
    e.version = as_size(read(e.param.ptr(), T.version));
    auto keep_storage = [&](PyObject* t) {
      e.storages.push_back(nb::steal(PyObject_CallMethod(t, "untyped_storage", nullptr)));
      if (!e.storages.back().is_valid()) throw nb::python_error();
    };
    for (int k = 0; k < kS; ++k) {
      if (slot[k] && slot[k] != Py_None) keep_storage(slot[k]);
      if (absmax[k] && e.buffers.state_absmax[k]) keep_storage(absmax[k]);
    }
    for (int k = 0; k < kC; ++k)
      if (scalar[k]) keep_storage(scalar[k]);
    if (d) {
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(d, &pos, &k, &v)) {
        e.items.push_back(nb::borrow(k));
        e.items.push_back(nb::borrow(v));
      }
    }
    e.buffers.grad = nullptr;
    e.buffers.grad16 = nullptr;
    e.buffers.rounding_seed = rounds_ ? roundpipe::rounding_seed(seed_, first_index_ + i) : 0;
    e.valid = true;
    return true;
  }

  std::vector<std::string> state_keys_;
  std::vector<nb::object> state_key_objs_, absmax_keys_, scalar_specs_;
  nb::object params_, state_;
  std::vector<nb::object> state_items_;                 // key, value, key, value, ...
  std::unordered_map<PyObject*, PyObject*> state_of_;   // parameter -> its state dict
  std::size_t state_generation_ = 0;                    // of state_of_
  std::vector<Entry> entries_;
  unsigned active_ = 0;
  bool bf16_params_ = false, rounds_ = false;
  std::uint64_t seed_ = 0;
  std::size_t first_index_ = 0;
  std::vector<roundpipe::ParamBuffers> tensors_;
  std::vector<std::size_t> stepped_;
};

}  // namespace rpbind
