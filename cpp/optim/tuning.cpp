// The prefetch distance (roundpipe/tuning.hpp): the environment, the setter, and the calibration
// that steps run in timed blocks of chunks (parallel.hpp: for_each_chunk).
#include "roundpipe/tuning.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>

#include <pthread.h>
#include <sys/resource.h>

#include "parallel.hpp"
#include "roundpipe/error.hpp"

namespace roundpipe {
namespace detail {

std::size_t g_prefetch_elements = kDefaultPrefetchBytes / sizeof(float);

}  // namespace detail

namespace {

constexpr std::size_t kCandidates = std::size(kPrefetchCandidates);
constexpr std::size_t kMaxBytes = 16384;
constexpr std::size_t kBlockChunks = 16;  // chunks per timed block

enum class Source { unread, environment, set, calibrated, calibrating };

struct Tuning {
  std::mutex mutex;
  Source source = Source::unread;
  std::size_t started = 0;  // rounds begun (their rotation)
  std::vector<std::array<double, kCandidates>> rounds;  // ns per element per candidate
  std::array<double, kCandidates> relative{}, ns{};
};

Tuning& tuning() {
  static Tuning* t = [] {
    Tuning* made = new Tuning;  // never destroyed: steps may run during exit
    // a fork() waits for the lock, so the child never inherits it held
    pthread_atfork([] { tuning().mutex.lock(); }, [] { tuning().mutex.unlock(); },
                   [] { tuning().mutex.unlock(); });
    return made;
  }();
  return *t;
}

std::atomic<std::size_t> g_bytes{kDefaultPrefetchBytes};  // the distance in use
std::atomic<bool> g_calibrating{false};  // calibration wanted and not finished
std::atomic<bool> g_read{false};         // the environment has been read

void check_bytes(const char* what, std::size_t bytes) {
  if (bytes % 64 != 0 || bytes > kMaxBytes)
    throw Error(std::string(what) + ": the prefetch distance must be a multiple of 64 bytes in [0, " +
                std::to_string(kMaxBytes) + "], got " + std::to_string(bytes));
}

// Reads ROUNDPIPE_PREFETCH once (t.mutex held).
void read_environment(Tuning& t) {
  if (t.source != Source::unread) return;
  const char* env = std::getenv("ROUNDPIPE_PREFETCH");
  const std::string value = env ? env : "";
  if (value.empty() || value == "auto") {
    t.source = Source::calibrating;
    g_calibrating.store(true);
  } else {
    std::size_t bytes = 0;
    bool digits = value.size() <= 6;
    for (char c : value) digits = digits && c >= '0' && c <= '9';
    if (digits) bytes = std::stoul(value);
    if (!digits || bytes % 64 != 0 || bytes > kMaxBytes)
      throw Error("ROUNDPIPE_PREFETCH: expected 'auto' or a multiple of 64 bytes in [0, " +
                  std::to_string(kMaxBytes) + "], got '" + value + "'");
    t.source = Source::environment;
    g_bytes.store(bytes);
  }
  g_read.store(true, std::memory_order_release);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Records one round (ns per element per candidate); chooses once enough rounds are in.
void record(const std::array<double, kCandidates>& round) {
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.source != Source::calibrating) return;  // chosen meanwhile
  t.rounds.push_back(round);
  if (t.rounds.size() < kPrefetchCalibrationRounds) return;
  std::size_t best = 0;
  for (std::size_t c = 0; c < kCandidates; ++c) {
    std::vector<double> rel, ns;
    for (const auto& r : t.rounds) {
      rel.push_back(r[c] / median(std::vector<double>(r.begin(), r.end())));
      ns.push_back(r[c]);
    }
    t.relative[c] = median(rel);
    t.ns[c] = median(ns);
    if (t.relative[c] < t.relative[best]) best = c;
  }
  g_bytes.store(kPrefetchCandidates[best]);
  t.source = Source::calibrated;
  g_calibrating.store(false);
}

// Page faults of the process so far (minor and major), or 0 where unknown.
long page_faults() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return u.ru_minflt + u.ru_majflt;
}

// Task [offset + k] of an outer task list.
struct Shifted {
  void (*task)(void*, std::size_t);
  void* ctx;
  std::size_t offset;
};

void run_block(const Shifted& s, std::size_t n, std::size_t max_threads, std::size_t prefetch) {
  detail::run_tasks_prefetching(
      n, [](void* p, std::size_t k) {
        const Shifted& b = *static_cast<const Shifted*>(p);
        b.task(b.ctx, b.offset + k);
      },
      const_cast<Shifted*>(&s), max_threads, prefetch);
}

}  // namespace

PrefetchChoice prefetch_choice() {
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mutex);
  read_environment(t);
  PrefetchChoice c;
  c.bytes = g_bytes.load();
  switch (t.source) {
    case Source::environment: c.source = "ROUNDPIPE_PREFETCH"; break;
    case Source::set: c.source = "set_prefetch_distance"; break;
    case Source::calibrated: c.source = "calibrated"; break;
    default: c.source = "default (calibrating)"; break;
  }
  c.candidates.assign(std::begin(kPrefetchCandidates), std::end(kPrefetchCandidates));
  if (t.source == Source::calibrated) {
    c.relative_time.assign(t.relative.begin(), t.relative.end());
    c.ns_per_element.assign(t.ns.begin(), t.ns.end());
  }
  c.rounds = t.rounds.size();
  return c;
}

void set_prefetch_distance(std::size_t bytes) {
  check_bytes("set_prefetch_distance", bytes);
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.source = Source::set;
  g_bytes.store(bytes);
  g_calibrating.store(false);
  g_read.store(true, std::memory_order_release);
}

void calibrate_prefetch() {
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.source = Source::calibrating;
  t.rounds.clear();
  t.started = 0;
  g_bytes.store(kDefaultPrefetchBytes);
  g_calibrating.store(true);
  g_read.store(true, std::memory_order_release);
}

namespace detail {

void check_tuning() {
  if (g_read.load(std::memory_order_acquire)) return;
  Tuning& t = tuning();
  std::lock_guard<std::mutex> lock(t.mutex);
  read_environment(t);
}

std::size_t chosen_prefetch_elements() { return g_bytes.load(std::memory_order_relaxed) / sizeof(float); }

bool prefetch_calibrates(std::size_t elements) {
  return elements >= kPrefetchCalibrationElements && g_calibrating.load(std::memory_order_relaxed);
}

void run_calibrating(std::size_t ntasks, const std::size_t* ends,
                     void (*task)(void*, std::size_t), void* ctx, std::size_t max_threads) {
  using Clock = std::chrono::steady_clock;
  constexpr std::size_t kRound = kCandidates * kBlockChunks;
  std::size_t k = 0;
  while (k + kRound <= ntasks && g_calibrating.load(std::memory_order_relaxed)) {
    std::size_t first;
    {
      Tuning& t = tuning();
      std::lock_guard<std::mutex> lock(t.mutex);
      first = t.started++;
    }
    std::array<double, kCandidates> round{};
    const long faults = page_faults();
    for (std::size_t j = 0; j < kCandidates; ++j) {
      const std::size_t c = (first + j) % kCandidates;
      const std::size_t b = k + j * kBlockChunks;
      const std::size_t elements = ends[b + kBlockChunks - 1] - (b ? ends[b - 1] : 0);
      const auto start = Clock::now();
      run_block({task, ctx, b}, kBlockChunks, max_threads,
                kPrefetchCandidates[c] / sizeof(float));
      const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
      round[c] = ns / static_cast<double>(elements);
    }
    // a round that faulted pages in (the first step over new state) measures the kernel's
    // page faults, not its memory traffic: not recorded
    if (page_faults() == faults) record(round);
    k += kRound;
  }
  if (k < ntasks) run_block({task, ctx, k}, ntasks - k, max_threads, chosen_prefetch_elements());
}

}  // namespace detail
}  // namespace roundpipe
