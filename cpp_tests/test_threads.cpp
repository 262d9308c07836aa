// The worker pool (roundpipe/threads.hpp) as the process sees it: threads made for a larger
// per-call count exit again, a small step wakes only its own threads, a step runs on one thread
// per rptest::kElementsPerThread elements at most, a fork() during a step leaves the child
// usable, and exit() during a step ends the process normally. Linux only (the tests read
// /proc/self/task); every wait is bounded.
#include <gtest/gtest.h>

#if defined(__linux__)
#include <dirent.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "roundpipe/roundpipe.hpp"
#include "support.hpp"

namespace {

using namespace std::chrono_literals;
using rptest::kElementsPerThread;

std::set<int> thread_ids() {
  std::set<int> ids;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* e = readdir(dir))
      if (e->d_name[0] != '.') ids.insert(std::atoi(e->d_name));
    closedir(dir);
  }
  return ids;
}

// Context switches of each listed thread that is still alive (each wake-up of a sleeping
// thread is one).
std::map<int, long> context_switches(const std::set<int>& ids) {
  std::map<int, long> out;
  for (int id : ids) {
    std::ifstream status("/proc/self/task/" + std::to_string(id) + "/status");
    std::string line;
    long total = -1;
    while (std::getline(status, line))
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0 ||
          line.rfind("nonvoluntary_ctxt_switches:", 0) == 0)
        total = (total < 0 ? 0 : total) + std::atol(line.substr(line.find(':') + 1).c_str());
    if (total >= 0) out[id] = total;
  }
  return out;
}

// Waits (at most `limit`) until pred() holds; returns whether it did.
template <class Pred>
bool eventually(Pred pred, std::chrono::seconds limit = 60s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// A step of plain SGD (the cheapest: the pool is under test, and emulated runs pay for every
// element) over `n` elements (or tensors of `sizes` elements, held one after the other in p and
// g), on `threads` threads (0: the process count): on min(threads, n / kElementsPerThread) of
// them, so a test of t threads needs t * kElementsPerThread elements.
struct Model {
  explicit Model(std::size_t n) : Model(std::vector<std::size_t>{n}) {}
  explicit Model(const std::vector<std::size_t>& sizes)
      : p(std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}), 1.0f), g(p.size(), 0.5f) {
    std::size_t at = 0;
    for (std::size_t n : sizes) {
      opt.add_param(p.data() + at, g.data() + at, n);
      at += n;
    }
  }
  void step(int threads) {
    opt.set_num_threads(threads);
    opt.step();
  }
  std::vector<float> p, g;
  roundpipe::SGD opt;
};

// A per-call thread count above the process's (num_threads()) and above the 4 threads other
// tests use (the workers of their steps may not have exited yet): a step on it makes at least
// 6 workers.
int many_threads() { return std::max(roundpipe::num_threads(), 4) + 6; }

TEST(Threads, ThreadsMadeForALargerCountExitAgain) {
  const int many = many_threads();
  Model m(many * kElementsPerThread);
  m.step(0);  // the process's own workers
  const std::size_t before = thread_ids().size();
  m.step(many);
  EXPECT_GT(thread_ids().size(), before);
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before; }))
      << thread_ids().size() << " threads, " << before << " before the " << many
      << "-thread step";
  m.step(many);  // made again on demand
  EXPECT_GT(thread_ids().size(), before);
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before; }));
}

TEST(Threads, ASmallStepWakesOnlyItsOwnThreads) {
  const int many = many_threads();
  const std::set<int> before = thread_ids();
  Model(many * kElementsPerThread).step(many);
  std::set<int> extra;
  for (int id : thread_ids())
    if (!before.count(id)) extra.insert(id);
  ASSERT_GE(extra.size(), 6u);
  Model small(2 * kElementsPerThread);  // a 2-thread step
  const std::map<int, long> start = context_switches(extra);
  constexpr int kSteps = 20;
  for (int i = 0; i < kSteps; ++i) small.step(2);
  // The one worker the steps use (when it is one of the new ones) wakes for each; a worker a step
  // does not use stays asleep, or wakes once or twice to exit (idle timeout, or the worker above
  // it leaving). Before, every step woke every worker.
  int busy = 0;
  long woken = 0;
  std::size_t idle = 0;
  for (const auto& [id, n] : context_switches(extra))
    if (start.count(id)) {
      if (n - start.at(id) >= kSteps / 2) {
        ++busy;
      } else {
        woken += n - start.at(id);
        ++idle;
      }
    }
  EXPECT_LE(busy, 1);
  EXPECT_LE(woken, static_cast<long>(3 * idle)) << idle << " idle workers";
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before.size(); }));
}

// Steps `m` kSteps times on `threads` threads; returns how many other threads of the process
// woke for at least half of them: the pool workers the steps used (a worker a step uses wakes
// for it; an unused one sleeps, or wakes once to exit).
int workers_used(Model& m, int threads) {
  constexpr int kSteps = 10;
  std::set<int> others = thread_ids();
  others.erase(static_cast<int>(syscall(SYS_gettid)));
  const std::map<int, long> start = context_switches(others);
  for (int i = 0; i < kSteps; ++i) m.step(threads);
  int used = 0;
  for (const auto& [id, n] : context_switches(others))
    if (start.count(id) && n - start.at(id) >= kSteps / 2) ++used;
  return used;
}

// A step over n elements runs on at most max(1, n / kElementsPerThread) threads, whatever its
// thread count (waking a worker costs more than a small step's work: cpp/optim/parallel.hpp):
// on a pool of 4 threads, 4 x kElementsPerThread elements use 3 workers, one element fewer 2,
// fewer than 2 x kElementsPerThread (12 chunks, which 4 threads would share) none. Fails if
// rptest::kElementsPerThread differs from the library's.
TEST(Threads, AStepRunsOnOneThreadPerKElementsPerThread) {
  constexpr int kPool = 4;
  const int process = roundpipe::num_threads();
  roundpipe::set_num_threads(kPool);  // its workers stay between the steps
  Model all(kPool * kElementsPerThread), fewer(kPool * kElementsPerThread - 1),
      small(2 * kElementsPerThread - 1);
  all.step(kPool);  // makes the workers
  EXPECT_EQ(workers_used(all, kPool), kPool - 1);
  EXPECT_EQ(workers_used(fewer, kPool), kPool - 2);
  EXPECT_EQ(workers_used(small, kPool), 0);
  EXPECT_EQ(workers_used(small, 0), 0);  // the process count (kPool)
  // The elements of all the call's tensors count together.
  Model below({kElementsPerThread, kElementsPerThread - 1}),
      two({kElementsPerThread, kElementsPerThread});
  EXPECT_EQ(workers_used(below, kPool), 0);
  EXPECT_EQ(workers_used(two, kPool), 1);
  roundpipe::set_num_threads(process);
}

// Runs child() in a forked process; expects it to exit with 0 within the limit.
template <class Child>
void expect_child_succeeds(Child child, std::chrono::seconds limit = 60s) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) _exit(child() ? 0 : 1);
  int status = 0;
  const bool ended = eventually([&] { return waitpid(pid, &status, WNOHANG) == pid; }, limit);
  if (!ended) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  ASSERT_TRUE(ended) << "the child hung";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                              : "exit " + std::to_string(WEXITSTATUS(status)));
}

// Another thread steps without pause while this one forks: the child must be able to step.
TEST(Threads, ForkDuringAStepLeavesTheChildUsable) {
  std::atomic<bool> stop{false};
  std::atomic<int> steps{0};
  std::thread stepper([&] {
    Model m(4 * kElementsPerThread);
    while (!stop) {
      m.step(4);
      ++steps;
    }
  });
  ASSERT_TRUE(eventually([&] { return steps > 0; }));
  for (int i = 0; i < 8 && !HasFailure(); ++i) {
    expect_child_succeeds([] {
      Model m(3 * kElementsPerThread);  // its steps use workers of its own
      m.step(3);
      m.step(0);
      return m.p[0] < 1.0f && m.p.back() == m.p[0];
    });
  }
  stop = true;
  stepper.join();
}

// exit() while another thread is inside a step: nothing in the library may end the process
// abnormally (no static destructor joins or waits for the workers).
TEST(Threads, ExitDuringAStepEndsTheProcessNormally) {
  for (int i = 0; i < 3 && !HasFailure(); ++i) {
    expect_child_succeeds([] {
      std::atomic<int> steps{0};
      std::thread([&] {
        Model m(4 * kElementsPerThread);
        for (;;) {
          m.step(4);
          ++steps;
        }
      }).detach();
      while (steps == 0) std::this_thread::sleep_for(1ms);
      std::exit(0);
      return true;
    });
  }
}

}  // namespace
#endif  // __linux__
