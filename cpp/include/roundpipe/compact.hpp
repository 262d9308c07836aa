// Compact storage of parameters and optimizer state: less host memory per parameter.
//
// - bfloat16 parameters ("master weights" kept in bfloat16) and bfloat16 state: read as
//   float32, updated by the algorithm's float32 arithmetic, stored with stochastic rounding
//   (Gupta et al., "Deep Learning with Limited Numerical Precision", 2015): the 16 bits a
//   bfloat16 drops decide, against 16 random bits, whether it rounds up, so the expected stored
//   value is the float32 result and many small updates are not lost to rounding. The random bits
//   are a hash of (seed, step, element index): reproducible, independent of the thread count.
// - int8 state, blockwise: the scheme of 8-bit Adam (Dettmers et al., "8-bit Optimizers via
//   Block-wise Quantization", 2022). A state array is cut into blocks of kQuantBlock elements;
//   a block keeps its absolute maximum as a float and each element as the 8-bit code of the
//   value of the *dynamic map* nearest to element / absmax. The dynamic map (Dettmers, "8-Bit
//   Approximations for Parallelism in Deep Learning", 2016) spends its codes on 7 decades:
//   decade i = 0..6 spans [10^(i-7), 10^(i-6)) with 2^i values (signed map, for state of either
//   sign such as Adam's exp_avg: those magnitudes, their negatives, 0 and 1) or 2^(i+1) values
//   (unsigned map, for non-negative state such as exp_avg_sq: those, 0 and 1), the means of
//   equal bins: 10^(i-6) * (0.1 + 0.9 * (j + 0.5) / n_i), j < n_i, rounded to float32 from
//   float64. An element is given the code of the nearest map value (at the float32-rounded
//   midpoint between two values, the lower one), and reads back as map[code] * absmax in float32.
//   A block with an inf or NaN reads back as NaN everywhere.
//
// The step functions read and write these forms directly (ParamBuffers::param_bf16,
// state_format, packed_state, state_absmax, rounding_seed in roundpipe/buffers.hpp); the
// functions below convert whole arrays (checkpoints, initialisation).
#pragma once
#include <cstddef>
#include <cstdint>

#include "roundpipe/buffers.hpp"

namespace roundpipe {

/// Elements per int8 block (one float absmax each): 4/256 bytes of scale per element.
constexpr std::size_t kQuantBlock = 256;

/// Tensors smaller than this keep float32 state under roundpipe.optim's int8 option and the
/// C++ Optimizer's (as bitsandbytes' min_8bit_size): their state costs little memory, and a
/// block over a small tensor is where quantisation hurts most.
constexpr std::size_t kInt8MinNumel = 4096;

/// Number of int8 blocks (absmax values) of an array of `numel` elements.
constexpr std::size_t quant_blocks(std::size_t numel) {
  return (numel + kQuantBlock - 1) / kQuantBlock;
}

/// The dynamic map's 256 values in ascending order (code k means map[k]): signed for state of
/// either sign, unsigned for non-negative state.
const float* dynamic_map(bool is_signed);

/// A seed for ParamBuffers::rounding_seed: a 64-bit hash of an optimizer's `seed` and the
/// tensor's `index` in it (distinct tensors get unrelated streams).
std::uint64_t rounding_seed(std::uint64_t seed, std::uint64_t index);

/// Quantises `n` float32 values to int8 codes (`codes`, n bytes) and per-block absolute maxima
/// (`absmax`, quant_blocks(n) floats), with the signed or unsigned dynamic map, as the step
/// functions store int8 state. Values of the wrong sign for the unsigned map become 0. Throws
/// roundpipe::Error if a pointer is null while n > 0.
void quantize_blockwise(const float* src, std::size_t n, bool is_signed, std::uint8_t* codes,
                        float* absmax);

/// The inverse: dst[i] = map[codes[i]] * absmax[i / kQuantBlock] in float32. Throws
/// roundpipe::Error if a pointer is null while n > 0.
void dequantize_blockwise(const std::uint8_t* codes, const float* absmax, std::size_t n,
                          bool is_signed, float* dst);

/// Rounds `n` float32 values to bfloat16 (bit patterns) stochastically, with the bits of stream
/// `seed` (as a step stores a bfloat16 parameter whose effective seed is `seed`). Throws
/// roundpipe::Error if a pointer is null while n > 0.
void round_bf16_stochastic(const float* src, std::size_t n, std::uint64_t seed,
                           std::uint16_t* dst);

}  // namespace roundpipe
