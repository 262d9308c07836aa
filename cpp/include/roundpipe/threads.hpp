// The worker pool that spreads one optimizer step over CPU cores.
//
// A step call splits the concatenated elements of all its tensors into cache-line aligned chunks
// and runs them on a pool (the calling thread takes part; workers sleep between steps). A step
// on t threads (at most one per 196,608 elements of the call, as waking a worker costs about as
// much as updating 80k elements: steps below 393,216 elements run on the calling thread alone;
// Adafactor's at most one per chunk) wakes and waits for t - 1 workers only; the results are
// the same on any thread count. Workers up to num_threads() stay; those made for a larger
// per-call count (ThreadCountScope) exit after one second idle. Steps from several threads run
// one after the other. fork() waits for a running step; the child gets a pool of its own. The
// pool is never torn down, so exit() while a step runs in another thread is safe.
#pragma once

namespace roundpipe {

/// Threads a step uses, counting the caller. Defaults to the CPUs this process may run on.
int num_threads();

/// Sets the threads a step uses, in [1, 1024] (waits for a running step). Throws
/// roundpipe::Error otherwise.
void set_num_threads(int n);

/// Within its lifetime, steps called from the constructing thread use `n` threads instead of
/// num_threads(): a thread count per optimizer. Scopes nest; the innermost with n > 0 wins
/// (n == 0 changes nothing). Throws roundpipe::Error unless n is in [0, 1024].
class ThreadCountScope {
 public:
  explicit ThreadCountScope(int n);
  ~ThreadCountScope();
  ThreadCountScope(const ThreadCountScope&) = delete;
  ThreadCountScope& operator=(const ThreadCountScope&) = delete;

 private:
  int previous_;
};

}  // namespace roundpipe
