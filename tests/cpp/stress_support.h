// fastload/tests/cpp/stress_support.h — what the C++ stress tests share:
// counting checks, naming wait results, and the worker threads a test
// starts, retires and always joins, whatever way the test ends.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ring.h"
#include "ring_main.h"
#include "sync.h"

namespace fastload_stress {

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Counts checks. check() records and goes on (a worker: main must still get
// every item); require() throws (the run is over). The counts are atomic, so
// one Checker may serve several threads.
class Checker {
 public:
  explicit Checker(std::string who = "main") : who_(std::move(who)) {}
  uint64_t passed() const { return passed_.load(); }
  uint64_t failed() const { return failed_.load(); }
  void set_who(std::string who) { who_ = std::move(who); }

  __attribute__((format(printf, 3, 4))) bool check(bool ok, const char* fmt, ...) {
    if (ok) {
      passed_.fetch_add(1);
      return true;
    }
    va_list ap;
    va_start(ap, fmt);
    report(fmt, ap);
    va_end(ap);
    return false;
  }

  __attribute__((format(printf, 3, 4))) void require(bool ok, const char* fmt, ...) {
    if (ok) {
      passed_.fetch_add(1);
      return;
    }
    va_list ap;
    va_start(ap, fmt);
    std::string msg = report(fmt, ap, /*always=*/true);
    va_end(ap);
    throw Failure(msg);
  }

 private:
  // Prints the first 20 failures, and always the fatal one.
  std::string report(const char* fmt, va_list ap, bool always = false) {
    const uint64_t n = failed_.fetch_add(1) + 1;
    char buf[1024];
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    if (n <= 20 || always) std::fprintf(stderr, "FAIL [%s] %s\n", who_.c_str(), buf);
    return buf;
  }

  std::string who_;
  std::atomic<uint64_t> passed_{0};
  std::atomic<uint64_t> failed_{0};
};

inline const char* wait_name(fastload::WaitResult r) {
  switch (r) {
    case fastload::WaitResult::Ready: return "Ready";
    case fastload::WaitResult::TimedOut: return "TimedOut";
    case fastload::WaitResult::Shutdown: return "Shutdown";
    case fastload::WaitResult::WorkerDied: return "WorkerDied";
  }
  return "?";
}

inline void sleep_us(uint64_t us) { std::this_thread::sleep_for(std::chrono::microseconds(us)); }
inline uint32_t current_tid() { return static_cast<uint32_t>(::syscall(SYS_gettid)); }

// A worker thread of a test that replaces workers: `ended` is what the
// thread says of its own end (the test defines the codes; 0 = running).
struct WorkerThread {
  std::thread th;
  std::shared_ptr<std::atomic<int>> ended;
};

// On any exit from the test, an exception included: shut the ring down
// (every worker's next_task() answers Shutdown), then join every thread,
// the live ones and those already retired.
struct WorkerJoiner {
  fastload::MainRing& ring;
  std::vector<WorkerThread>& live;
  std::vector<WorkerThread>& retired;
  ~WorkerJoiner() {
    ring.shutdown();
    for (auto* v : {&live, &retired})
      for (WorkerThread& t : *v)
        if (t.th.joinable()) t.th.join();
  }
};

// Slots a test reclaimed from a worker that may still write them, as (slot,
// lap at the reclaim). release_handed_back() puts each back on the free list
// once the test's worker has handed it back: done_lap[slot] == that lap.
using Quarantine = std::vector<std::pair<uint32_t, uint64_t>>;

inline void release_handed_back(fastload::MainRing& ring, Quarantine& q,
                                const std::atomic<uint64_t>* done_lap) {
  for (size_t i = 0; i < q.size();) {
    // Acquire: pairs with the worker's store_release of done_lap after its
    // last touch of the slot, so the slot is not reused under that write.
    if (fastload::sync::load_acquire(done_lap[q[i].first]) == q[i].second) {
      ring.push_free_slot(q[i].first);
      q[i] = q.back();
      q.pop_back();
    } else {
      ++i;
    }
  }
}

}  // namespace fastload_stress
