// roundpipe._C: the nanobind face of the C++ optimizer library. Thin by design: it checks that
// every tensor is what the kernels need (tensors.hpp: CPU, dense, C-contiguous, float32 —
// bfloat16 or float16 allowed for gradients and model copies, bfloat16 for parameters with
// stochastic rounding, bfloat16 or uint8 codes for compact state —, matching element counts;
// each problem a TypeError/ValueError naming the argument and index, raised before anything is
// touched), releases the GIL and calls the C++ step: over lists of tensors (`<algo>_step`) or
// over a param group's cached StepPlan (`<algo>_step_plan`, step_plan.hpp). Also the compact
// storage conversions and the ISA, thread and prefetch controls, and the per-algorithm metadata the Python
// optimizers derive their tables from (`algorithms`, `<Name>Options.fields`, `<Name>State`'s
// slot names and int8 signedness). The module is not built against torch;
// it imports torch on first use.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dequant.hpp"
#include "roundpipe/roundpipe.hpp"
#include "step_plan.hpp"
#include "tensors.hpp"

namespace nb = nanobind;
using namespace rpbind;

namespace {

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
                 roundpipe::StepIO* io, int num_threads, nb::handle absmax_arg,
                 nb::handle seeds_arg, bool bf16_params) {
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
        std::vector<List> states, scalars, absmax;
        for (std::size_t k = 0; k < states_outer.size(); ++k) {
          states.push_back(as_list(states_outer[k], name, state_names[k]));
          if (states.back().size() != 0) check_count(name, states.back(), n);
        }
        for (std::size_t k = 0; k < scalars_outer.size(); ++k) {
          scalars.push_back(as_list(scalars_outer[k], name, scalar_names[k]));
          if (scalars.back().size() != 0) check_count(name, scalars.back(), n);
        }
        if (!absmax_arg.is_none()) {
          const List outer = as_list(absmax_arg, name, "absmax");
          if (outer.size() > state_names.size())
            throw nb::value_error((std::string(name) + ": expected at most " +
                                   std::to_string(state_names.size()) + " absmax lists").c_str());
          for (std::size_t k = 0; k < outer.size(); ++k) {
            absmax.push_back(as_list(outer[k], name, state_names[k]));
            if (absmax.back().size() != 0) check_count(name, absmax.back(), n);
          }
        }
        std::optional<List> copies, seeds;
        if (!copies_arg.is_none()) {
          copies = as_list(copies_arg, name, "model_copies");
          check_count(name, *copies, n);
        }
        if (!seeds_arg.is_none()) {
          seeds = as_list(seeds_arg, name, "rounding_seeds");
          check_count(name, *seeds, n);
        }
        std::vector<roundpipe::ParamBuffers> tensors;
        tensors.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
          PyObject* p = params[i];
          if (p == Py_None) continue;
          // slot k's tensor: nullptr where no list is passed; None only for a factored
          // algorithm's slot that the tensor does not use
          auto entry = [&](const List& l) -> PyObject* {
            if (l.size() == 0) return nullptr;
            return Factored<State>::value && l[i] == Py_None ? Py_None : present(l, name, i);
          };
          PyObject* slot[roundpipe::ParamBuffers::kMaxState] = {};
          PyObject* scale[roundpipe::ParamBuffers::kMaxState] = {};
          PyObject* scalar[roundpipe::ParamBuffers::kMaxScalar] = {};
          for (std::size_t k = 0; k < states.size(); ++k) slot[k] = entry(states[k]);
          for (std::size_t k = 0; k < absmax.size(); ++k)
            scale[k] = absmax[k].size() != 0 ? absmax[k][i] : nullptr;
          for (std::size_t k = 0; k < scalars.size(); ++k)
            scalar[k] = scalars[k].size() != 0 ? present(scalars[k], name, i) : nullptr;
          roundpipe::ParamBuffers t = check_param<State>(
              name, i, p, present(grads, name, i), slot, scale, scalar,
              copies ? present(*copies, name, i) : nullptr, bf16_params);
          if (seeds) t.rounding_seed = nb::cast<std::uint64_t>(nb::handle((*seeds)[i]));
          tensors.push_back(t);
        }
        without_gil([&] { fn(options, tensors.data(), tensors.size(), io); });
      },
      nb::arg("options"), nb::arg("params"), nb::arg("grads"), nb::arg("states"),
      nb::arg("scalars"), nb::arg("model_copies") = nb::none(), nb::arg("io").none() = nb::none(),
      nb::arg("num_threads") = 0, nb::arg("absmax") = nb::none(),
      nb::arg("rounding_seeds") = nb::none(), nb::arg("bf16_params") = false, doc.c_str());
}

template <class Names>
std::string join(const Names& names) {
  std::string out;
  for (const char* n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

// Binds `fn` as `<name>_plan(options, plan, params, opt_state, active, num_threads,
// bf16_params, rounds, seed, first_index, seed_mix) -> bool`: the step over a param group's
// StepPlan (step_plan.hpp); false, with nothing modified, when the list-based step must run.
template <class Options, class State>
void def_plan_step(nb::module_& m, const char* name, StepFn<Options> fn) {
  const std::string plan_name = std::string(name) + "_plan";
  m.def(
      plan_name.c_str(),
      [fn, name](const Options& options, StepPlan& plan, nb::handle params, nb::handle opt_state,
                 unsigned active, int num_threads, bool bf16_params, bool rounds,
                 std::uint64_t seed, std::size_t first_index, std::uint64_t seed_mix) {
        const roundpipe::ThreadCountScope threads(num_threads);
        if (!plan.prepare<State>(name, params, opt_state, active, bf16_params, rounds, seed,
                                 first_index, seed_mix))
          return false;
        std::vector<roundpipe::ParamBuffers>& tensors = plan.tensors();
        without_gil([&] { fn(options, tensors.data(), tensors.size(), nullptr); });
        plan.mark_updated();
        return true;
      },
      nb::arg("options"), nb::arg("plan"), nb::arg("params"), nb::arg("opt_state"),
      nb::arg("active"), nb::arg("num_threads"), nb::arg("bf16_params"), nb::arg("rounds"),
      nb::arg("seed"), nb::arg("first_index"), nb::arg("seed_mix"),
      (plan_name + "(options, plan, params, opt_state, active, num_threads, bf16_params, rounds,\n"
       "seed, first_index, seed_mix) -> bool: roundpipe::" + name + " over a param group's\n"
       "StepPlan: `params` the group's list, `opt_state` the optimizer's state dict, `active` a\n"
       "bit per state slot the group uses. False (nothing modified) when the list-based " + name +
       "\nmust run instead: state to create, a tensor it would refuse.").c_str());
}

// A Python tuple of a C++ array's values (names, flags).
template <class Values>
nb::tuple as_tuple(const Values& values) {
  nb::list out;
  for (const auto& v : values) out.append(v);
  return nb::steal<nb::tuple>(PyList_AsTuple(out.ptr()));
}

// Binds roundpipe::<Name>State as `<Name>State`: no instances, only the metadata the Python
// optimizers derive their tables from (the single source: the C++ header), as class attributes
//   state_names   the per-element state slots, in slot order (torch.optim's state keys)
//   scalar_names  the 0-dim slots, in slot order ("step" first where the algorithm counts steps)
//   int8_signed   per state slot, whether int8 storage takes the signed map (the slot's values
//                 take either sign); None when the algorithm does not allow int8 state.
template <class State>
void def_state(nb::module_& m, const std::string& state_name, const char* header) {
  const std::string doc = "roundpipe::" + state_name + " (" + header +
                          "): the state slots' names (state_names, scalar_names) and int8_signed.";
  nb::class_<State> state(m, state_name.c_str(), doc.c_str());
  state.attr("state_names") = as_tuple(State::state_names);
  state.attr("scalar_names") = as_tuple(State::scalar_names);
  if constexpr (roundpipe::detail::Int8Slots<State>::allowed)
    state.attr("int8_signed") = as_tuple(State::int8_signed);
  else
    state.attr("int8_signed") = nb::none();
}

// Binds roundpipe::<Name>Options as `<Name>Options` (every field read-write, named as in C++;
// `fields`: their names, in order), roundpipe::<Name>State as `<Name>State` (def_state) and
// roundpipe::<name>_step as `<name>_step` (def_step) and `<name>_step_plan`.
template <class Options, class State>
void def_algorithm(nb::module_& m, const char* options_name, const char* state_name,
                   const char* step_name, const char* header, StepFn<Options> fn) {
  const std::string doc = std::string("roundpipe::") + options_name + " (" + header +
                          "): the hyperparameters, named and defaulted as in torch.optim.";
  nb::class_<Options> options(m, options_name, doc.c_str());
  options.def(nb::init<>());
  std::vector<const char*> fields;
  Options::for_each_field([&](const char* field, auto member) {
    options.def_rw(field, member);
    fields.push_back(field);
  });
  options.attr("fields") = as_tuple(fields);
  def_state<State>(m, state_name, header);
  def_step<Options, State>(
      m, step_name, fn,
      std::string(step_name) + "(options, params, grads, [" + join(State::state_names) + "], [" +
          join(State::scalar_names) + "], model_copies=None, io=None, num_threads=0, absmax=None,\n"
          "rounding_seeds=None, bf16_params=False):\n"
          "roundpipe::" + step_name + " (" + header + ") over lists of CPU tensors, one entry per\n"
          "parameter: float32 (or, with bf16_params, bfloat16: stochastic rounding) params,\nfloat32/bfloat16/float16 "
          "grads, per-slot lists of state tensors shaped like the params (float32, bfloat16, or\n"
          "uint8 int8 codes with their per-slot `absmax` float32 tensors of quant_blocks(numel)\n"
          "values; roundpipe/compact.hpp) and of 0-dim float32 scalars (a slot the options leave\n"
          "unused may be []), `rounding_seeds` one int per param (ParamBuffers::rounding_seed).\n"
          "A None in params skips that position (None there in every list).");
  def_plan_step<Options, State>(m, step_name, fn);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "RoundPipe CPU optimizer kernels (float32, CPU, contiguous tensors; gradients may also be\n"
      "bfloat16/float16). Every <algo>_step also takes model_copies=None (tensors receiving the\n"
      "updated parameters as float32/bfloat16/float16), io=None (a StepIO) and num_threads=0.";

  nb::class_<StepPlan>(
      m, "StepPlan",
      "StepPlan(state_keys, scalar_specs): a param group's tensors checked once for\n"
      "<algo>_step_plan, re-checked at each step only where they can change (bindings/\n"
      "step_plan.hpp). state_keys: the state key of each slot; scalar_specs: per 0-dim slot, a\n"
      "state key or a tensor shared by every parameter.")
      .def(nb::init<std::vector<std::string>, nb::tuple>(), nb::arg("state_keys"),
           nb::arg("scalar_specs"));

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

#define ROUNDPIPE_BIND(name, Name)                                                   \
  def_algorithm<roundpipe::Name##Options, roundpipe::Name##State>(                        \
      m, #Name "Options", #Name "State", #name "_step", "roundpipe/" #name ".hpp",        \
      &roundpipe::name##_step);
  ROUNDPIPE_STEP_FUNCTIONS(ROUNDPIPE_BIND)
#undef ROUNDPIPE_BIND

  // The optimizer algorithms (roundpipe/algorithms.hpp), each with its class in
  // roundpipe/optimizer_classes.hpp (a missing AlgorithmTraits does not compile): the list the
  // Python classes and their completeness test (tests/test_algorithms.py) start from.
  nb::dict algorithms;
#define ROUNDPIPE_ALGORITHM(prefix, Name)                                                    \
  static_assert(                                                                             \
      std::string_view(roundpipe::AlgorithmTraits<roundpipe::Name##Options>::name) == #Name, \
      "AlgorithmTraits<" #Name "Options>::name must be " #Name);                             \
  algorithms[#Name] = #prefix;
  ROUNDPIPE_ALGORITHMS(ROUNDPIPE_ALGORITHM)
#undef ROUNDPIPE_ALGORITHM
  m.attr("algorithms") = algorithms;

  // compact storage (roundpipe/compact.hpp): whole-tensor conversions, for checkpoints
  m.attr("QUANT_BLOCK") = roundpipe::kQuantBlock;
  m.attr("INT8_MIN_NUMEL") = roundpipe::kInt8MinNumel;
  m.def("dynamic_map", [](bool is_signed) {
    const float* v = roundpipe::dynamic_map(is_signed);
    return std::vector<float>(v, v + 256);
  }, nb::arg("is_signed"), "The 256 values of the signed or unsigned 8-bit dynamic map, ascending.");
  m.def("rounding_seed", &roundpipe::rounding_seed, nb::arg("seed"), nb::arg("index"),
        "roundpipe::rounding_seed: the stream of tensor `index` of an optimizer seeded `seed`.");
  m.def("quantize_blockwise", [](nb::handle src, bool is_signed, nb::handle codes, nb::handle absmax) {
    constexpr const char* fn = "quantize_blockwise";
    const Tensor x = checked(src.ptr(), fn, "src", 0, Accept::float32, nullptr, true);
    const Tensor c = checked(codes.ptr(), fn, "codes", 0, Accept::state, &x);
    const Tensor a = checked(absmax.ptr(), fn, "absmax", 0, Accept::float32, nullptr);
    if (!c.codes) throw nb::type_error("quantize_blockwise: codes must be uint8");
    if (a.numel != roundpipe::quant_blocks(x.numel))
      throw nb::value_error("quantize_blockwise: absmax must hold quant_blocks(src.numel()) values");
    without_gil([&] {
      roundpipe::quantize_blockwise(static_cast<const float*>(x.data), x.numel, is_signed,
                                    static_cast<std::uint8_t*>(c.data), static_cast<float*>(a.data));
    });
  }, nb::arg("src"), nb::arg("is_signed"), nb::arg("codes"), nb::arg("absmax"),
     "roundpipe::quantize_blockwise: float32 `src` into uint8 `codes` (same element count) and\n"
     "float32 `absmax` (one per block of QUANT_BLOCK elements).");
  m.def("dequantize_blockwise", [](nb::handle codes, nb::handle absmax, bool is_signed, nb::handle dst) {
    constexpr const char* fn = "dequantize_blockwise";
    const Tensor x = checked(dst.ptr(), fn, "dst", 0, Accept::float32, nullptr, true);
    const Tensor c = checked(codes.ptr(), fn, "codes", 0, Accept::state, &x);
    const Tensor a = checked(absmax.ptr(), fn, "absmax", 0, Accept::float32, nullptr);
    if (!c.codes) throw nb::type_error("dequantize_blockwise: codes must be uint8");
    if (a.numel != roundpipe::quant_blocks(x.numel))
      throw nb::value_error("dequantize_blockwise: absmax must hold quant_blocks(dst.numel()) values");
    without_gil([&] {
      roundpipe::dequantize_blockwise(static_cast<const std::uint8_t*>(c.data),
                                      static_cast<const float*>(a.data), x.numel, is_signed,
                                      static_cast<float*>(x.data));
    });
  }, nb::arg("codes"), nb::arg("absmax"), nb::arg("is_signed"), nb::arg("dst"),
     "roundpipe::dequantize_blockwise: uint8 `codes` and float32 `absmax` into float32 `dst`.");
  m.def("round_bf16_stochastic", [](nb::handle src, std::uint64_t seed, nb::handle dst) {
    constexpr const char* fn = "round_bf16_stochastic";
    const Tensor x = checked(src.ptr(), fn, "src", 0, Accept::float32, nullptr, true);
    const Tensor d = checked(dst.ptr(), fn, "dst", 0, Accept::param, &x);
    if (d.dtype != roundpipe::Dtype::bfloat16)
      throw nb::type_error("round_bf16_stochastic: dst must be bfloat16");
    without_gil([&] {
      roundpipe::round_bf16_stochastic(static_cast<const float*>(x.data), x.numel, seed,
                                       static_cast<std::uint16_t*>(d.data));
    });
  }, nb::arg("src"), nb::arg("seed"), nb::arg("dst"),
     "roundpipe::round_bf16_stochastic: float32 `src` into bfloat16 `dst`, stream `seed`.");

  def_dequant(m);  // quantized weights (dequant.hpp)

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
  m.def("prefetch_choice", [] {
    const roundpipe::PrefetchChoice c = roundpipe::prefetch_choice();
    nb::dict d;
    d["bytes"] = c.bytes;
    d["source"] = c.source;
    d["candidates"] = c.candidates;
    d["relative_time"] = c.relative_time;
    d["ns_per_element"] = c.ns_per_element;
    d["rounds"] = c.rounds;
    return d;
  }, "The kernels' software prefetch distance and how it was chosen (roundpipe/tuning.hpp):\n"
     "a dict of bytes, source, candidates, relative_time, ns_per_element, rounds. ValueError\n"
     "if ROUNDPIPE_PREFETCH is neither 'auto' nor a multiple of 64 in [0, 16384].");
  m.attr("PREFETCH_CALIBRATION_ELEMENTS") = roundpipe::kPrefetchCalibrationElements;
  m.def("set_prefetch_distance", &roundpipe::set_prefetch_distance, nb::arg("bytes"),
        "Fixes the prefetch distance (bytes ahead per float32 array, a multiple of 64 in\n"
        "[0, 16384]; 0: none). ValueError otherwise.");
  m.def("calibrate_prefetch", &roundpipe::calibrate_prefetch,
        "Forgets the prefetch choice: the next large steps calibrate it again.");
  m.def("num_threads", &roundpipe::num_threads, "Threads an optimizer step uses.");
  m.def("set_num_threads", &roundpipe::set_num_threads, nb::arg("n"),
        "Sets the threads an optimizer step uses (>= 1).");
}
