// The worker pool (roundpipe/threads.hpp) as the process sees it: threads made for a larger
// per-call count exit again, a small step wakes only its own threads, a fork() during a step
// leaves the child usable, and exit() during a step ends the process normally. Linux only (the
// tests read /proc/self/task); every wait is bounded.
#include <gtest/gtest.h>

#if defined(__linux__)
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "roundpipe/roundpipe.hpp"

namespace {

using namespace std::chrono_literals;

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

// An Adam step over `n` elements, on `threads` threads (0: the process count).
struct Model {
  explicit Model(std::size_t n) : p(n, 1.0f), g(n, 0.5f) { opt.add_param(p.data(), g.data(), n); }
  void step(int threads) {
    opt.set_num_threads(threads);
    opt.step();
  }
  std::vector<float> p, g;
  roundpipe::Adam opt;
};

// Enough 16384-element chunks for 40 threads.
constexpr std::size_t kElements = 40 * 16384;

TEST(Threads, ThreadsMadeForALargerCountExitAgain) {
  Model m(kElements);
  m.step(0);  // the process's own workers
  const std::size_t before = thread_ids().size();
  m.step(40);
  EXPECT_GT(thread_ids().size(), before);
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before; }))
      << thread_ids().size() << " threads, " << before << " before the 40-thread step";
  m.step(40);  // made again on demand
  EXPECT_GT(thread_ids().size(), before);
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before; }));
}

TEST(Threads, ASmallStepWakesOnlyItsOwnThreads) {
  Model m(kElements);
  const std::set<int> before = thread_ids();
  m.step(40);
  std::set<int> extra;
  for (int id : thread_ids())
    if (!before.count(id)) extra.insert(id);
  ASSERT_GE(extra.size(), 30u);
  const std::map<int, long> start = context_switches(extra);
  constexpr int kSteps = 20;
  for (int i = 0; i < kSteps; ++i) m.step(2);
  // A worker a step does not use stays asleep; it may wake once or twice to exit (idle timeout,
  // or the worker above it leaving). Before, every step woke every worker.
  long woken = 0;
  std::size_t alive = 0;
  for (const auto& [id, n] : context_switches(extra))
    if (start.count(id)) {
      woken += n - start.at(id);
      ++alive;
    }
  EXPECT_LE(woken, static_cast<long>(3 * alive)) << alive << " idle workers";
  EXPECT_TRUE(eventually([&] { return thread_ids().size() <= before.size(); }));
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
    Model m(kElements);
    while (!stop) {
      m.step(4);
      ++steps;
    }
  });
  ASSERT_TRUE(eventually([&] { return steps > 0; }));
  for (int i = 0; i < 8 && !HasFailure(); ++i) {
    expect_child_succeeds([] {
      Model m(8 * 16384);
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
        Model m(kElements);
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
