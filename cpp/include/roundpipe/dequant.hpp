// Dequantization of blockwise-quantized frozen weights (the base of QLoRA-style LoRA training,
// python/roundpipe/quant.py): the CPU side of "dequantize right before the layer runs".
//
// Both formats cut the row-major flattened weight into blocks of kWeightBlock consecutive
// values, each with one float32 scale:
// - NF4 (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023, section 3):
//   4-bit indices into the 16-value NormalFloat code book (kNf4Code, bitsandbytes'
//   get_4bit_type("nf4")), two per byte, the first value of a pair in the high nibble
//   (bitsandbytes' packing); value i = kNf4Code[index_i] * absmax[i / kWeightBlock].
// - int8: symmetric linear codes in [-127, 127]; value i = code_i * scale[i / kWeightBlock].
//
// Each value is the float32 product (one rounding; no fused multiply-add anywhere), then rounded
// to the output dtype to nearest even (as torch's .to(dtype): bfloat16 NaN -> 0x7fc0, float16
// overflow -> inf), so every ISA, the tail and the torch-op path in quant.py give the same bits.
// Runtime dispatch to the active ISA (roundpipe/isa.hpp): the NF4 lookup is a register permute
// of the 16-entry table (AVX-512: one vpermps; AVX2: two and a blend; NEON: a 64-byte tbl).
#pragma once
#include <cstddef>
#include <cstdint>

#include "roundpipe/buffers.hpp"

namespace roundpipe {

/// Values per block of a quantized weight (one float32 scale each).
constexpr std::size_t kWeightBlock = 64;

/// The NF4 code book (QLoRA; bitsandbytes' NF4 table), ascending, kNf4Code[7] == 0.
extern const float kNf4Code[16];

/// Blocks holding n values: ceil(n / kWeightBlock).
constexpr std::size_t weight_blocks(std::size_t n) { return (n + kWeightBlock - 1) / kWeightBlock; }

/// out[0, n) = kNf4Code[nibble i of `codes`] * absmax[i / kWeightBlock], rounded to `out_dtype`.
/// `codes`: (n + 1) / 2 bytes at least (the packed codes of weight_blocks(n) blocks, as
/// quantize stores them, are more); `absmax`: weight_blocks(n) floats; `out`: n values of
/// `out_dtype` (float32, or bfloat16 / float16 bit patterns as std::uint16_t). Big arrays run on
/// the worker pool (roundpipe/threads.hpp) when it is idle, else on the calling thread alone:
/// a call never waits for an optimizer step. Throws roundpipe::Error if a pointer is null
/// while n > 0.
void dequantize_nf4(const std::uint8_t* codes, const float* absmax, std::size_t n,
                    Dtype out_dtype, void* out);

/// out[0, n) = codes[i] * scale[i / kWeightBlock], rounded to `out_dtype`. `codes`: n int8
/// values at least; `scale`: weight_blocks(n) floats; `out` and errors as dequantize_nf4.
void dequantize_int8(const std::int8_t* codes, const float* scale, std::size_t n,
                     Dtype out_dtype, void* out);

}  // namespace roundpipe
