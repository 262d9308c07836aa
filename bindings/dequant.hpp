// roundpipe._C.dequantize_nf4 / dequantize_int8 (roundpipe/dequant.hpp): the CPU path of
// python/roundpipe/quant.py's dequantize. The tensors arrive through DLPack (nanobind ndarray):
// each must be a CPU, C-contiguous tensor of the named dtype, or a TypeError names the argument
// (noconvert: nanobind would otherwise hand a strided `out` over as a contiguous copy, and the
// values written would be lost); sizes that do not fit are a ValueError. Both checks come before
// anything is written.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "roundpipe/dequant.hpp"
#include "tensors.hpp"

namespace rpbind {
namespace {

using Array = nanobind::ndarray<nanobind::c_contig, nanobind::device::cpu>;

bool is(const Array& a, nanobind::dlpack::dtype_code code, int bits) {
  const nanobind::dlpack::dtype d = a.dtype();
  return d.code == static_cast<std::uint8_t>(code) && d.bits == bits && d.lanes == 1;
}

// The output dtype of `out` (float32, bfloat16 or float16), or a TypeError.
roundpipe::Dtype out_dtype(const Array& out, const char* fn) {
  using C = nanobind::dlpack::dtype_code;
  if (is(out, C::Float, 32)) return roundpipe::Dtype::float32;
  if (is(out, C::Bfloat, 16)) return roundpipe::Dtype::bfloat16;
  if (is(out, C::Float, 16)) return roundpipe::Dtype::float16;
  throw nanobind::type_error((std::string(fn) + ": out must be float32, bfloat16 or float16").c_str());
}

void check_sizes(const char* fn, const Array& codes, std::size_t codes_needed, const Array& scale,
                 std::size_t n) {
  if (codes.size() < codes_needed)
    throw nanobind::value_error((std::string(fn) + ": codes holds " + std::to_string(codes.size()) +
                                 " values, out's " + std::to_string(n) + " need " +
                                 std::to_string(codes_needed)).c_str());
  if (scale.size() < roundpipe::weight_blocks(n))
    throw nanobind::value_error((std::string(fn) + ": scale holds " + std::to_string(scale.size()) +
                                 " values, out's " + std::to_string(n) + " need " +
                                 std::to_string(roundpipe::weight_blocks(n)) +
                                 " (one per block of " + std::to_string(roundpipe::kWeightBlock) +
                                 ")").c_str());
}

void def_dequant(nanobind::module_& m) {
  namespace nb = nanobind;
  using C = nb::dlpack::dtype_code;
  m.attr("WEIGHT_BLOCK") = roundpipe::kWeightBlock;
  m.def("dequantize_nf4", [](Array codes, Array absmax, Array out) {
    constexpr const char* fn = "dequantize_nf4";
    if (!is(codes, C::UInt, 8)) throw nb::type_error("dequantize_nf4: codes must be uint8");
    if (!is(absmax, C::Float, 32)) throw nb::type_error("dequantize_nf4: absmax must be float32");
    const roundpipe::Dtype dtype = out_dtype(out, fn);
    const std::size_t n = out.size();
    check_sizes(fn, codes, (n + 1) / 2, absmax, n);
    without_gil([&] {
      roundpipe::dequantize_nf4(static_cast<const std::uint8_t*>(codes.data()),
                                static_cast<const float*>(absmax.data()), n, dtype, out.data());
    });
  }, nb::arg("codes").noconvert(), nb::arg("absmax").noconvert(), nb::arg("out").noconvert(),
     "roundpipe::dequantize_nf4: out[i] = NF4[nibble i of codes] * absmax[i // WEIGHT_BLOCK]\n"
     "(high nibble first), float32 product rounded to out's dtype. codes: uint8, >= ceil(n/2)\n"
     "values; absmax: float32, >= ceil(n/WEIGHT_BLOCK); out: float32, bfloat16 or float16, n\n"
     "values; all CPU and C-contiguous (any shape). TypeError / ValueError otherwise.");
  m.def("dequantize_int8", [](Array codes, Array scale, Array out) {
    constexpr const char* fn = "dequantize_int8";
    if (!is(codes, C::Int, 8)) throw nb::type_error("dequantize_int8: codes must be int8");
    if (!is(scale, C::Float, 32)) throw nb::type_error("dequantize_int8: scale must be float32");
    const roundpipe::Dtype dtype = out_dtype(out, fn);
    const std::size_t n = out.size();
    check_sizes(fn, codes, n, scale, n);
    without_gil([&] {
      roundpipe::dequantize_int8(static_cast<const std::int8_t*>(codes.data()),
                                 static_cast<const float*>(scale.data()), n, dtype, out.data());
    });
  }, nb::arg("codes").noconvert(), nb::arg("scale").noconvert(), nb::arg("out").noconvert(),
     "roundpipe::dequantize_int8: out[i] = codes[i] * scale[i // WEIGHT_BLOCK], float32 product\n"
     "rounded to out's dtype. codes: int8, >= n values; scale: float32, >= ceil(n/WEIGHT_BLOCK);\n"
     "out: float32, bfloat16 or float16, n values; all CPU and C-contiguous.");
}

}  // namespace
}  // namespace rpbind
