// Dequantization of quantized weights (roundpipe/dequant.hpp): argument checks, then runs of
// whole blocks on the worker pool (the active ISA's kernels/dequant.hpp) when it is idle.
#include "roundpipe/dequant.hpp"

#include <string>

#include "kernel_table.hpp"
#include "parallel.hpp"
#include "roundpipe/error.hpp"

namespace roundpipe {

// bitsandbytes' get_4bit_type("nf4") values as float32 (QLoRA, Dettmers et al. 2023, appendix E).
const float kNf4Code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

namespace {

// Values per task: 1024 blocks (128 KiB of bfloat16 out), enough to amortise a task's start.
constexpr std::size_t kBlocksPerTask = 1024;
constexpr std::size_t kTaskValues = kBlocksPerTask * kWeightBlock;

void check(const char* fn, std::size_t n, const void* codes, const void* scale, const void* out,
           Dtype dtype) {
  if (dtype != Dtype::float32 && dtype != Dtype::bfloat16 && dtype != Dtype::float16)
    throw Error(std::string(fn) + ": out_dtype must be float32, bfloat16 or float16");
  if (n == 0) return;
  for (const auto& [name, p] : {std::pair<const char*, const void*>{"codes", codes},
                                {"scale", scale}, {"out", out}})
    if (!p) throw Error(std::string(fn) + ": " + name + " is null (n " + std::to_string(n) + ")");
}

std::size_t dtype_bytes(Dtype d) { return d == Dtype::float32 ? 4 : 2; }

// Runs fn(first value, values) over [0, n) in tasks of kTaskValues: on the pool when it is idle,
// else all on the calling thread.
template <class Fn>
void for_each_run(std::size_t n, Fn&& fn) {
  const std::size_t tasks = (n + kTaskValues - 1) / kTaskValues;
  auto task = [&](std::size_t k) {
    const std::size_t begin = k * kTaskValues;
    fn(begin, std::min(kTaskValues, n - begin));
  };
  struct Ctx {
    decltype(task)* f;
  } ctx{&task};
  auto run = [](void* c, std::size_t k) { (*static_cast<Ctx*>(c)->f)(k); };
  if (tasks > 1 && detail::try_run_tasks(tasks, run, &ctx)) return;
  for (std::size_t k = 0; k < tasks; ++k) task(k);
}

}  // namespace

void dequantize_nf4(const std::uint8_t* codes, const float* absmax, std::size_t n,
                    Dtype out_dtype, void* out) {
  check("dequantize_nf4", n, codes, absmax, out, out_dtype);
  const detail::KernelTable& isa = detail::active_kernels();
  auto* bytes = static_cast<unsigned char*>(out);
  for_each_run(n, [&](std::size_t begin, std::size_t count) {
    isa.dequantize_nf4_blocks(codes + begin / 2, absmax + begin / kWeightBlock, count, out_dtype,
                              bytes + begin * dtype_bytes(out_dtype));
  });
}

void dequantize_int8(const std::int8_t* codes, const float* scale, std::size_t n,
                     Dtype out_dtype, void* out) {
  check("dequantize_int8", n, codes, scale, out, out_dtype);
  const detail::KernelTable& isa = detail::active_kernels();
  auto* bytes = static_cast<unsigned char*>(out);
  for_each_run(n, [&](std::size_t begin, std::size_t count) {
    isa.dequantize_int8_blocks(codes + begin, scale + begin / kWeightBlock, count, out_dtype,
                               bytes + begin * dtype_bytes(out_dtype));
  });
}

}  // namespace roundpipe
