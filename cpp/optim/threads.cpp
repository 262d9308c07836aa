// The worker pool (roundpipe/threads.hpp, parallel.hpp).
//
// - A step with t threads runs on the caller and workers 0 .. t-2 (fewer when it has fewer
//   tasks, or fewer elements than t x kElementsPerThread: parallel.hpp), wakes only those and
//   waits only for them: a step costs what its own thread count needs, whatever larger counts
//   earlier steps used.
// - Workers are made on first need. Those below the process's thread count (num_threads())
//   stay; those above it, made for a larger per-call count (ThreadCountScope), exit once idle
//   for kIdleExit, highest first, so the process returns to its thread count.
// - Steps are serialised by g_call_mutex.
// - Nothing here is destroyed at process exit: the pool is a heap object that is never deleted
//   and its workers are detached, so no static destructor joins a thread (std::terminate) or
//   destroys a condition variable that workers sleep on (glibc's pthread_cond_destroy would wait
//   for them), even when exit() is called while a step runs in another thread.
// - fork(): the prepare handler takes g_call_mutex, so a fork waits for a running step to end
//   and the child's memory holds whole steps only; the child, which has none of the parent's
//   workers, abandons the parent's pool and makes a new one on demand.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "parallel.hpp"
#include "roundpipe/error.hpp"
#include "roundpipe/threads.hpp"

namespace roundpipe {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kIdleExit = std::chrono::seconds(1);  // idle time after which a surplus worker exits
constexpr int kMaxThreads = 1024;

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

class Pool {
 public:
  // Runs task(ctx, k) for every k in [0, ntasks) on the caller and up to `helpers` workers, and
  // returns when all are done. One call at a time (g_call_mutex).
  void run(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx, std::size_t helpers) {
    std::vector<Worker*> used;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      grow(helpers);
      used.reserve(helpers);
      for (std::size_t i = 0; i < helpers && i < workers_.size(); ++i)
        used.push_back(workers_[i].get());
      task_ = task;
      ctx_ = ctx;
      ntasks_ = ntasks;
      next_.store(0, std::memory_order_relaxed);
      pending_ = used.size();
      ++generation_;
      const Clock::time_point now = Clock::now();
      for (Worker* w : used) {
        w->job = generation_;
        w->last_used = now;
      }
    }
    for (Worker* w : used) w->wake.notify_one();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

  // Workers [0, keep) never exit; those above leave once idle for kIdleExit.
  void set_keep(std::size_t keep) {
    std::lock_guard<std::mutex> lock(mutex_);
    keep_ = keep;
    if (!workers_.empty()) workers_.back()->wake.notify_one();  // it may be surplus now
  }

 private:
  struct Worker {
    std::condition_variable wake;
    std::size_t job = 0;              // generation of the last run it was given
    Clock::time_point last_used{};
  };

  // Makes workers until there are `n` (mutex_ held). A thread that cannot be made leaves fewer
  // workers: the results do not depend on the thread count.
  void grow(std::size_t n) {
    while (workers_.size() < n) {
      workers_.push_back(std::make_unique<Worker>());
      const std::size_t index = workers_.size() - 1;
      Worker* w = workers_.back().get();
      try {
        std::thread([this, index, w] { work(index, w); }).detach();
      } catch (const std::system_error&) {
        workers_.pop_back();
        return;
      }
    }
  }

  void drain() {
    for (std::size_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < ntasks_;)
      task_(ctx_, k);
  }

  void work(std::size_t index, Worker* w) {
    std::unique_lock<std::mutex> lock(mutex_);
    std::size_t seen = 0;
    for (;;) {
      while (w->job == seen) {  // idle
        const bool top = index + 1 == workers_.size();
        if (index < keep_ || !top) {
          w->wake.wait(lock);  // the worker above, when it leaves, wakes this one
          continue;
        }
        const Clock::time_point deadline = w->last_used + kIdleExit;
        if (Clock::now() >= deadline) {
          workers_.pop_back();  // destroys *w, which no one else uses now
          if (!workers_.empty()) workers_.back()->wake.notify_one();
          return;
        }
        w->wake.wait_until(lock, deadline);
      }
      seen = w->job;
      lock.unlock();
      drain();
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable done_;
  std::vector<std::unique_ptr<Worker>> workers_;  // worker i is workers_[i]; only the last exits
  std::size_t keep_ = 0;
  std::size_t generation_ = 0, pending_ = 0, ntasks_ = 0;
  std::atomic<std::size_t> next_{0};
  void (*task_)(void*, std::size_t) = nullptr;
  void* ctx_ = nullptr;
};

std::mutex g_call_mutex;  // one step at a time; guards g_threads and g_pool
int g_threads = 0;        // 0: not yet read
Pool* g_pool = nullptr;   // made on the first parallel step; never deleted (see the top)
thread_local int t_threads = 0;  // ThreadCountScope of the calling thread (0: none)

int threads_locked() {
  if (g_threads == 0) g_threads = default_threads();
  return g_threads;
}

[[maybe_unused]] const bool g_atfork = [] {
  pthread_atfork([] { g_call_mutex.lock(); },
                 [] { g_call_mutex.unlock(); },
                 [] {
                   g_pool = nullptr;  // its threads do not exist here: abandon it
                   g_call_mutex.unlock();
                 });
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
  g_threads = n;
  if (g_pool) g_pool->set_keep(static_cast<std::size_t>(n - 1));
}

ThreadCountScope::ThreadCountScope(int n) : previous_(t_threads) {
  if (n < 0 || n > kMaxThreads)
    throw Error("ThreadCountScope: n must be in [0, " + std::to_string(kMaxThreads) + "], got " +
                std::to_string(n));
  if (n > 0) t_threads = n;
}

ThreadCountScope::~ThreadCountScope() { t_threads = previous_; }

namespace detail {

namespace {

// run_tasks' body; the caller holds g_call_mutex.
void run_tasks_locked(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx,
                      std::size_t max_threads, std::size_t prefetch_elements) {
  g_prefetch_elements = prefetch_elements;  // no task runs now; the pool's hand-off publishes it
  const int count = t_threads > 0 ? t_threads : threads_locked();
  const std::size_t threads =
      std::min({static_cast<std::size_t>(count), ntasks, max_threads});
  if (threads <= 1) {
    for (std::size_t k = 0; k < ntasks; ++k) task(ctx, k);
    return;
  }
  if (!g_pool) {
    g_pool = new Pool;
    g_pool->set_keep(static_cast<std::size_t>(threads_locked() - 1));
  }
  g_pool->run(ntasks, task, ctx, threads - 1);
}

}  // namespace

void run_tasks(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx,
               std::size_t max_threads) {
  run_tasks_prefetching(ntasks, task, ctx, max_threads, chosen_prefetch_elements());
}

void run_tasks_prefetching(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx,
                           std::size_t max_threads, std::size_t prefetch_elements) {
  std::lock_guard<std::mutex> lock(g_call_mutex);
  run_tasks_locked(ntasks, task, ctx, max_threads, prefetch_elements);
}

bool try_run_tasks(std::size_t ntasks, void (*task)(void*, std::size_t), void* ctx) {
  std::unique_lock<std::mutex> lock(g_call_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  run_tasks_locked(ntasks, task, ctx, ntasks, chosen_prefetch_elements());
  return true;
}

}  // namespace detail
}  // namespace roundpipe
