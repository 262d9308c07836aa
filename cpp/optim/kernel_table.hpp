// Internal: the table of kernel entry points one ISA translation unit provides (one entry per
// step function of roundpipe/algorithms.hpp, plus the two ends of the mixed-precision pass), and
// the dispatcher's accessor for the active one.
//
// Included by an ISA translation unit (ROUNDPIPE_ISA_NS defined, its simd header included), the
// kernel headers below also define their per-ISA bodies; anywhere else only their ISA-neutral
// coefficient structs.
#pragma once
#include <cstddef>

#include "kernels/adadelta.hpp"
#include "kernels/adafactor.hpp"
#include "kernels/adagrad.hpp"
#include "kernels/adam.hpp"
#include "kernels/adamax.hpp"
#include "kernels/asgd.hpp"
#include "kernels/compact.hpp"
#include "kernels/dequant.hpp"
#include "kernels/mixed.hpp"
#include "kernels/nadam.hpp"
#include "kernels/radam.hpp"
#include "kernels/rmsprop.hpp"
#include "kernels/rprop.hpp"
#include "kernels/sgd.hpp"
#include "kernels/stream.hpp"
#include "roundpipe/algorithms.hpp"

namespace roundpipe {
namespace detail {

// One algorithm's kernel: its update on elements [begin, end) of one tensor. The coefficients
// and buffers are passed by value: the kernel's own copies, which its float stores cannot alias,
// so their fields stay in registers across the loop instead of being reloaded after each store.
template <class Coeffs>
using KernelFn = void (*)(Coeffs, ParamBuffers, std::size_t begin, std::size_t end);

// One algorithm's update on a slice of compact storage, converting inside its loop
// (kernels/compact.hpp: compact_slice); false, having done nothing, for a combination of
// formats it does not run.
template <class Coeffs>
using CompactKernelFn = bool (*)(Coeffs, const CompactSlice&);

struct KernelTable {
#define ROUNDPIPE_KERNEL_ENTRY(name, Name) KernelFn<Name##Coeffs> name;
  ROUNDPIPE_STEP_FUNCTIONS(ROUNDPIPE_KERNEL_ENTRY)
#undef ROUNDPIPE_KERNEL_ENTRY
  // the mixed-precision pass (kernels/mixed.hpp)
  void (*stage_grad)(const ParamBuffers&, std::size_t begin, std::size_t n, float inv_scale,
                     float clip, bool norm, float* out, GradStats& stats);
  void (*store_model_copy)(const ParamBuffers&, const float* param, std::size_t begin,
                           std::size_t n);
  void (*stream_fence)();  // after a chunk's last store_model_copy
  // Adafactor's reductions and passes besides its update (kernels/adafactor.hpp)
  double (*adafactor_squares)(const float* x, std::size_t n, float* acc);
  double (*adafactor_squares2)(const float* p, const float* g, std::size_t n, float* acc,
                               double& p_sq);
  void (*adafactor_lerp)(float* start, const float* end, std::size_t n, float weight,
                         bool from_end);
  double (*adafactor_variance)(AdafactorCoeffs, ParamBuffers, std::size_t begin,
                               std::size_t end);
  double (*adafactor_norm)(AdafactorCoeffs, ParamBuffers, std::size_t begin, std::size_t end);
  // compact storage (kernels/compact.hpp)
  void (*widen_bf16)(const std::uint16_t* x, std::size_t n, float* out);
  void (*round_bf16)(const float* x, std::size_t n, std::uint32_t key, std::uint32_t first,
                     std::uint16_t* out, float* kept);
  void (*dequantize_blocks)(const QuantMap&, const std::uint8_t* codes, const float* absmax,
                            std::size_t n, float* out);
  void (*quantize_blocks)(const QuantMap&, const float* x, std::size_t n, std::uint8_t* codes,
                          float* absmax);
  // the update fused with the conversions, where an algorithm has one (Adam/AdamW)
  CompactKernelFn<AdamCoeffs> adam_compact;
  // quantized weights (kernels/dequant.hpp): values [0, n) of a run of whole blocks
  void (*dequantize_nf4_blocks)(const std::uint8_t* codes, const float* absmax, std::size_t n,
                                Dtype dtype, void* out);
  void (*dequantize_int8_blocks)(const std::int8_t* codes, const float* scale, std::size_t n,
                                 Dtype dtype, void* out);
};

// The table of the active ISA (roundpipe::active_isa()); throws roundpipe::Error as that does.
const KernelTable& active_kernels();

}  // namespace detail
}  // namespace roundpipe
