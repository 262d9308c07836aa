// Compact storage (roundpipe/compact.hpp): the two dynamic maps, built at compile time, and the
// whole-array conversions, on the worker pool with the active ISA.
#include "roundpipe/compact.hpp"

#include <limits>
#include <string>

#include "kernel_table.hpp"
#include "parallel.hpp"
#include "roundpipe/error.hpp"

namespace roundpipe {
namespace detail {
namespace {

// 10^(i-6) as the float64 nearest to it, the top of decade i.
constexpr double kDecadeTop[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};

constexpr QuantMap make_map(bool is_signed) {
  QuantMap q{};
  double mags[254] = {};
  int n = 0;
  for (int i = 0; i < 7; ++i) {
    const int bins = is_signed ? 1 << i : 2 << i;
    for (int j = 0; j < bins; ++j) mags[n++] = kDecadeTop[i] * (0.1 + 0.9 * (j + 0.5) / bins);
  }
  if (is_signed) {  // 127 magnitudes: -mag[126] .. -mag[0], 0, mag[0] .. mag[126], 1
    for (int k = 0; k < 127; ++k) {
      q.value[k] = -static_cast<float>(mags[126 - k]);
      q.value[128 + k] = static_cast<float>(mags[k]);
    }
    q.value[127] = 0.0f;
  } else {          // 254 magnitudes: 0, mag[0] .. mag[253], 1
    q.value[0] = 0.0f;
    for (int k = 0; k < 254; ++k) q.value[1 + k] = static_cast<float>(mags[k]);
  }
  q.value[255] = 1.0f;
  q.bound[0] = -std::numeric_limits<float>::infinity();
  q.bound[256] = std::numeric_limits<float>::infinity();
  for (int k = 1; k < 256; ++k)
    q.bound[k] = static_cast<float>((static_cast<double>(q.value[k - 1]) + q.value[k]) / 2);
  q.is_signed = is_signed;
  // the cells (kernels/compact.hpp): per cell, the code of its lowest value (the number of
  // midpoints below it) and the midpoint inside it
  int below = 0;  // the midpoints bound[1 .. below] lie below the current cell
  q.cells_ok = true;
  for (std::size_t c = 0; c < QuantMap::kCells; ++c) {
    const std::uint32_t lowest = QuantMap::kCellBase + (static_cast<std::uint32_t>(c) << 16);
    while (below < 255 && q.bound[below + 1] < __builtin_bit_cast(float, lowest)) ++below;
    std::uint32_t midpoint = 0x10000u;
    int inside = 0;
    for (int k = below + 1; k < 256; ++k) {
      const std::uint32_t b = __builtin_bit_cast(std::uint32_t, q.bound[k]);
      if (b - lowest > 0xffffu) break;
      midpoint = b - lowest;
      ++inside;
    }
    q.cells_ok = q.cells_ok && inside <= 1;
    q.cells[c] = static_cast<std::uint32_t>(below) << 24 | midpoint;
  }
  return q;
}

constexpr QuantMap kSignedMap = make_map(true);
constexpr QuantMap kUnsignedMap = make_map(false);
static_assert(kSignedMap.cells_ok && kUnsignedMap.cells_ok,
              "a quantiser cell holds more than one midpoint");

void check_pointers(const char* fn, std::size_t n,
                    std::initializer_list<std::pair<const char*, const void*>> pointers) {
  if (n == 0) return;
  for (const auto& [name, p] : pointers)
    if (!p) throw Error(std::string(fn) + ": " + name + " is null (n " + std::to_string(n) + ")");
}

// Runs fn(begin, end) over [0, n) in chunks of kChunkElements (a multiple of kQuantBlock), in
// parallel.
template <class Fn>
void for_each_block_chunk(std::size_t n, Fn&& fn) {
  for_each_chunk(1, [n](std::size_t) { return n; },
                 [&](std::size_t, std::size_t begin, std::size_t end, std::size_t) { fn(begin, end); });
}

}  // namespace

const QuantMap& quant_map(bool is_signed) { return is_signed ? kSignedMap : kUnsignedMap; }

}  // namespace detail

static_assert(detail::kChunkElements % kQuantBlock == 0 &&
              detail::kStageElements % kQuantBlock == 0 &&
              detail::kCompactStageElements % kQuantBlock == 0);

const float* dynamic_map(bool is_signed) { return detail::quant_map(is_signed).value; }

std::uint64_t rounding_seed(std::uint64_t seed, std::uint64_t index) {
  return detail::splitmix64(detail::splitmix64(seed) ^ index);
}

void quantize_blockwise(const float* src, std::size_t n, bool is_signed, std::uint8_t* codes,
                        float* absmax) {
  detail::check_pointers("quantize_blockwise", n, {{"src", src}, {"codes", codes}, {"absmax", absmax}});
  const detail::KernelTable& isa = detail::active_kernels();
  const detail::QuantMap& q = detail::quant_map(is_signed);
  detail::for_each_block_chunk(n, [&](std::size_t b, std::size_t e) {
    isa.quantize_blocks(q, src + b, e - b, codes + b, absmax + b / kQuantBlock);
  });
}

void dequantize_blockwise(const std::uint8_t* codes, const float* absmax, std::size_t n,
                          bool is_signed, float* dst) {
  detail::check_pointers("dequantize_blockwise", n, {{"codes", codes}, {"absmax", absmax}, {"dst", dst}});
  const detail::KernelTable& isa = detail::active_kernels();
  const detail::QuantMap& q = detail::quant_map(is_signed);
  detail::for_each_block_chunk(n, [&](std::size_t b, std::size_t e) {
    isa.dequantize_blocks(q, codes + b, absmax + b / kQuantBlock, e - b, dst + b);
  });
}

void round_bf16_stochastic(const float* src, std::size_t n, std::uint64_t seed,
                           std::uint16_t* dst) {
  detail::check_pointers("round_bf16_stochastic", n, {{"src", src}, {"dst", dst}});
  const detail::KernelTable& isa = detail::active_kernels();
  detail::for_each_block_chunk(n, [&](std::size_t b, std::size_t e) {
    isa.round_bf16(src + b, e - b, detail::stream_key(seed, 0, b >> 32),
                   static_cast<std::uint32_t>(b), dst + b, nullptr);
  });
}

}  // namespace roundpipe
