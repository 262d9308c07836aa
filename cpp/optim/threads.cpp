// The persistent worker pool (roundpipe/threads.hpp, parallel.hpp).
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/threads.hpp"

namespace roundpipe {
namespace {

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs the tasks on the caller and the first `threads - 1` workers (the others wake and go
  // back to sleep).
  void run(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx, int threads) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = task;
      ctx_ = ctx;
      ntasks_ = ntasks;
      active_ = threads;
      next_.store(0, std::memory_order_relaxed);
      pending_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void drain() {
    for (std::size_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < ntasks_;)
      task_(ctx_, k);
  }
  void work(int index) {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      if (index < active_) drain();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  std::size_t generation_ = 0, pending_ = 0, ntasks_ = 0;
  int active_ = 0;  // threads taking part in the current run, the caller included
  std::atomic<std::size_t> next_{0};
  void (*task_)(void*, std::size_t) = nullptr;
  void* ctx_ = nullptr;
};

constexpr int kMaxThreads = 1024;
std::mutex g_call_mutex;  // one step at a time; guards g_threads and g_pool
int g_threads = 0;        // 0: not yet read
Pool* g_pool = nullptr;   // created on the first parallel step; leaked in a forked child
thread_local int t_threads = 0;  // ThreadCountScope of the calling thread (0: none)

int threads_locked() {
  if (g_threads == 0) g_threads = default_threads();
  return g_threads;
}

// After fork() the child has none of the parent's worker threads: forget the pool (its threads
// are gone, so it must not be joined) and build a new one on demand.
[[maybe_unused]] const bool g_atfork = [] {
  pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; });
  return true;
}();

}  // namespace

int num_threads() {
  std::lock_guard<std::mutex> lock(g_call_mutex);
  return threads_locked();
}

void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads)
    throw Error("set_num_threads: n must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                std::to_string(n));
  std::lock_guard<std::mutex> lock(g_call_mutex);
  if (g_pool && g_pool->threads() != n) {
    delete g_pool;
    g_pool = nullptr;
  }
  g_threads = n;
}

ThreadCountScope::ThreadCountScope(int n) : previous_(t_threads) {
  if (n < 0 || n > kMaxThreads)
    throw Error("ThreadCountScope: n must be in [0, " + std::to_string(kMaxThreads) + "], got " +
                std::to_string(n));
  if (n > 0) t_threads = n;
}

ThreadCountScope::~ThreadCountScope() { t_threads = previous_; }

namespace detail {

void run_tasks(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx) {
  std::lock_guard<std::mutex> lock(g_call_mutex);
  const int threads = t_threads > 0 ? t_threads : threads_locked();
  if (ntasks <= 1 || threads == 1) {
    for (std::size_t k = 0; k < ntasks; ++k) task(ctx, k);
    return;
  }
  if (g_pool && g_pool->threads() < threads) {  // a scope asks for more than the pool has
    delete g_pool;
    g_pool = nullptr;
  }
  if (!g_pool) g_pool = new Pool(std::max(threads, threads_locked()));
  g_pool->run(ntasks, task, ctx, threads);
}

}  // namespace detail
}  // namespace roundpipe
