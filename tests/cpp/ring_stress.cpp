// fastload/tests/cpp/ring_stress.cpp — multi-process (and multi-thread)
// stress test of the shared-memory ring (MainRing and WorkerRing), with no
// Python involved.
//
// main plays the loader: item n goes to worker n % N through pop_free_slot +
// assign, at most num_slots are in flight, results are awaited in order
// (wait_ready, first half of the items) then out of order (wait_any, second
// half), each payload is checked against a pattern derived from (seq, seed)
// and each item must be seen exactly once. Workers loop on next_task, sleep
// at random, write the payload and commit(). At the end main calls
// shutdown() and every worker must return from next_task with Shutdown.
//
// Modes:
//   process  workers are fork()ed and map the ring again with
//            WorkerRing::attach(dup(fd)), as the real workers do;
//   thread   workers are threads, each with a WorkerRing over main's mapping
//            (one mapping), the only mode in which ThreadSanitizer sees both
//            sides of every atomic and so can check the release/acquire
//            hand-overs (--thread-attach maps the ring once per thread
//            instead: more realistic, but TSan cannot relate two mappings of
//            one page).
// Before the modes: late commits after reclaim() one case at a time, then
// reclaim() and reset_worker() racing running workers (--reclaim-items).
// Also checked: idle workers sleep in the kernel (CPU time over an idle
// window), timeouts of next_task/wait_ready/wait_any are neither early nor
// late, "infinite" (INT64_MAX) timeouts, shutdown wake-ups, no lost wake-ups
// (workers with a long timeout must pick a task up and main must wake up
// within --stall-ms).
//
// Last line: "<passed> passed, <failed> failed" (counts of checks, workers'
// included); exit status 0 only when nothing failed.
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ring.h"
#include "ring_main.h"
#include "ring_segment.h"
#include "ring_worker.h"
#include "stress_support.h"

namespace {

using fastload::MainRing;
using fastload::Mapping;
using fastload::RingSegment;
using fastload::SlotResult;
using fastload::SlotState;
using fastload::TaskRef;
using fastload::WaitResult;
using fastload::WorkerRing;
using fastload::sync::monotonic_ns;
using fastload_stress::Checker;
using fastload_stress::current_tid;
using fastload_stress::Failure;
using fastload_stress::sleep_us;
using fastload_stress::wait_name;

constexpr int64_t kMs = 1000000;
constexpr uint64_t kTaskMagic = 0x4b534154534c4646ULL;    // "FFLSTASK"
constexpr uint64_t kResultMagic = 0x544c5352534c4646ULL;  // "FFLSRSLT"

// ---- options ----------------------------------------------------------------

struct Options {
  uint64_t items = 20000;
  uint32_t workers = 4;
  uint32_t slots = 16;
  uint64_t slot_bytes = 64 * 1024;
  uint64_t seed = 1;
  std::string mode = "both";  // process | thread | both
  bool thread_attach = false;
  uint32_t delay_pct = 10;      // % of tasks (and of main's waits) preceded by a random sleep
  uint32_t max_delay_us = 300;  // upper bound of those sleeps
  int64_t idle_ms = 500;        // idle window of the busy-loop check (0: skip it)
  double idle_cpu_pct = 5.0;    // max CPU an idle worker may burn in that window
  int64_t long_timeout_ms = 3000;  // main's waits and even workers' next_task
  int64_t short_timeout_ms = 150;  // odd workers' next_task: exercises TimedOut
  int64_t stall_ms = 1000;         // a pick-up or wake-up slower than this is a lost wake-up
  int64_t timing_slack_ms = 50;    // how late a timeout may return in the timing test
  bool timing = true;
  uint32_t shutdown_trials = 2000;  // shutdown() racing a wait_ready and a next_task
  uint64_t reclaim_items = 4000;    // items of the reclaim/reset race (0: skip it)
  uint32_t reclaim_pct = 5;         // % of main's loop turns that reclaim a task in flight
  uint32_t replacements = 12;       // workers given up on (reset_worker) while still running
  bool verbose = false;
};

[[noreturn]] void usage(const char* argv0, const char* msg) {
  if (msg != nullptr) std::fprintf(stderr, "ring_stress: %s\n", msg);
  std::fprintf(stderr,
               "usage: %s [--items N] [--workers N] [--slots N] [--slot-bytes N] [--seed N]\n"
               "          [--mode process|thread|both] [--thread-attach]\n"
               "          [--delay-pct P] [--max-delay-us US] [--idle-ms MS] [--idle-cpu-pct P]\n"
               "          [--long-timeout-ms MS] [--short-timeout-ms MS] [--stall-ms MS]\n"
               "          [--timing-slack-ms MS] [--no-timing] [--shutdown-trials N]\n"
               "          [--reclaim-items N] [--reclaim-pct P] [--replacements N]\n"
               "          [--verbose]\n",
               argv0);
  std::exit(2);
}

uint64_t parse_u64(const char* argv0, const std::string& name, const char* v) {
  if (v == nullptr) usage(argv0, ("missing value for " + name).c_str());
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(v, &end, 0);
  if (errno != 0 || end == v || *end != '\0' || v[0] == '-')
    usage(argv0, ("bad value for " + name + ": " + v).c_str());
  return x;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const char* inline_v = nullptr;
    std::string::size_type eq = a.find('=');
    std::string inline_s;
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_s = a.substr(eq + 1);
      inline_v = inline_s.c_str();
      a = a.substr(0, eq);
    }
    auto value = [&]() -> const char* {
      if (inline_v != nullptr) return inline_v;
      return i + 1 < argc ? argv[++i] : nullptr;
    };
    auto u64 = [&]() { return parse_u64(argv[0], a, value()); };
    if (a == "--items") o.items = u64();
    else if (a == "--workers") o.workers = static_cast<uint32_t>(u64());
    else if (a == "--slots") o.slots = static_cast<uint32_t>(u64());
    else if (a == "--slot-bytes") o.slot_bytes = u64();
    else if (a == "--seed") o.seed = u64();
    else if (a == "--mode") {
      const char* v = value();
      if (v == nullptr) usage(argv[0], "missing value for --mode");
      o.mode = v;
      if (o.mode != "process" && o.mode != "thread" && o.mode != "both")
        usage(argv[0], "--mode must be process, thread or both");
    } else if (a == "--thread-attach") o.thread_attach = true;
    else if (a == "--delay-pct") o.delay_pct = static_cast<uint32_t>(std::min<uint64_t>(u64(), 100));
    else if (a == "--max-delay-us") o.max_delay_us = static_cast<uint32_t>(u64());
    else if (a == "--idle-ms") o.idle_ms = static_cast<int64_t>(u64());
    else if (a == "--idle-cpu-pct") o.idle_cpu_pct = static_cast<double>(u64());
    else if (a == "--long-timeout-ms") o.long_timeout_ms = static_cast<int64_t>(u64());
    else if (a == "--short-timeout-ms") o.short_timeout_ms = static_cast<int64_t>(u64());
    else if (a == "--stall-ms") o.stall_ms = static_cast<int64_t>(u64());
    else if (a == "--timing-slack-ms") o.timing_slack_ms = static_cast<int64_t>(u64());
    else if (a == "--no-timing") o.timing = false;
    else if (a == "--shutdown-trials") o.shutdown_trials = static_cast<uint32_t>(u64());
    else if (a == "--reclaim-items") o.reclaim_items = u64();
    else if (a == "--reclaim-pct") o.reclaim_pct = static_cast<uint32_t>(std::min<uint64_t>(u64(), 100));
    else if (a == "--replacements") o.replacements = static_cast<uint32_t>(u64());
    else if (a == "--verbose" || a == "-v") o.verbose = true;
    else if (a == "--help" || a == "-h") usage(argv[0], nullptr);
    else usage(argv[0], ("unknown argument " + a).c_str());
  }
  if (o.workers == 0 || o.workers > fastload::kMaxWorkers) usage(argv[0], "bad --workers");
  if (o.slots == 0 || o.slots > fastload::kMaxSlots) usage(argv[0], "bad --slots");
  if (o.slot_bytes == 0) usage(argv[0], "bad --slot-bytes");
  if (o.long_timeout_ms <= o.stall_ms)
    usage(argv[0], "--long-timeout-ms must exceed --stall-ms (or lost wake-ups go unnoticed)");
  return o;
}

// ---- the data that goes through the ring ------------------------------------

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// What main writes at the payload start (the task bytes).
struct Task {
  uint64_t magic;
  uint64_t seq;
  uint64_t seed;
  uint64_t size;  // payload bytes the worker must write
  uint32_t worker;
  uint32_t kind;
  uint64_t check;
};

uint64_t task_check(const Task& t) {
  return mix64(t.magic ^ mix64(t.seq ^ mix64(t.seed ^ mix64(t.size ^ (uint64_t{t.worker} << 32 | t.kind)))));
}

// What the worker writes after the data, at meta_offset.
struct ResultMeta {
  uint64_t magic;
  uint64_t seq;
  uint64_t seed;
  uint64_t size;
  uint32_t worker;
  uint32_t pad;
  int64_t commit_ns;  // monotonic time just before commit(): main's wake-up latency
  uint64_t check;
};

uint64_t meta_check(const ResultMeta& m) {
  return mix64(m.magic ^ mix64(m.seq ^ mix64(m.seed ^ mix64(m.size ^ m.worker))));
}

uint32_t result_kind(uint64_t seq, uint32_t worker) {
  return static_cast<uint32_t>(mix64(seq * 31 + worker)) | 1u;
}

uint64_t meta_offset_for(uint64_t size) { return (size + 63) / 64 * 64; }
uint64_t pattern_seed(uint64_t seq, uint64_t seed) { return mix64(seq ^ mix64(seed)); }

void fill_pattern(char* p, uint64_t size, uint64_t pseed) {
  const uint64_t words = size / 8;
  for (uint64_t i = 0; i < words; ++i) {
    const uint64_t v = mix64(pseed + i);
    std::memcpy(p + 8 * i, &v, 8);
  }
  if (size % 8 != 0) {
    const uint64_t v = mix64(pseed + words);
    std::memcpy(p + 8 * words, &v, size % 8);
  }
}

// A worker's result for task `seq`: `size` bytes of its pattern, then its
// meta (stamped with the time just before commit()) after them.
void write_result(char* p, uint64_t size, uint64_t seq, uint64_t seed, uint32_t worker) {
  fill_pattern(p, size, pattern_seed(seq, seed));
  ResultMeta m{};
  m.magic = kResultMagic;
  m.seq = seq;
  m.seed = seed;
  m.size = size;
  m.worker = worker;
  m.check = meta_check(m);
  m.commit_ns = monotonic_ns();
  std::memcpy(p + meta_offset_for(size), &m, sizeof m);
}

// Returns the first bad byte offset, or size when the whole pattern matches.
uint64_t find_pattern_mismatch(const char* p, uint64_t size, uint64_t pseed) {
  const uint64_t words = size / 8;
  for (uint64_t i = 0; i < words; ++i) {
    const uint64_t v = mix64(pseed + i);
    if (std::memcmp(p + 8 * i, &v, 8) != 0) return 8 * i;
  }
  if (size % 8 != 0) {
    const uint64_t v = mix64(pseed + words);
    if (std::memcmp(p + 8 * words, &v, size % 8) != 0) return 8 * words;
  }
  return size;
}

const char* state_name(SlotState s) {
  switch (s) {
    case SlotState::Free: return "FREE";
    case SlotState::Assigned: return "ASSIGNED";
    case SlotState::Writing: return "WRITING";
    case SlotState::Ready: return "READY";
    case SlotState::Leased: return "LEASED";
    case SlotState::Committing: return "COMMITTING";
  }
  return "?";
}

double ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }



// ---- memory shared between main and its workers (outside the ring) -----------

// One per worker. Written only by that worker; main reads it after
// join()/waitpid(), never while the worker runs.
struct alignas(64) WorkerStats {
  uint64_t tasks;
  uint64_t timeouts;
  uint64_t passed;
  uint64_t failed;
  int64_t max_pickup_ns;       // assign() -> next_task() returned it
  int64_t max_timeout_late_ns; // how late a TimedOut came back
  int64_t shutdown_seen_ns;    // when next_task returned Shutdown
  int32_t exit_code;
  uint32_t saw_shutdown;
};

// An anonymous MAP_SHARED mapping (it survives fork() shared, unlike the
// heap): per-worker stats, then main's assign() timestamp of every item.
class TestArea {
 public:
  TestArea(uint32_t workers, uint64_t items)
      : workers_(workers), bytes_(sizeof(WorkerStats) * workers + sizeof(int64_t) * (items + 1)) {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
    map_ = Mapping(p, bytes_);
  }
  WorkerStats& stats(uint32_t w) { return static_cast<WorkerStats*>(map_.data())[w]; }
  // Written by main before assign(seq) (so the ring's release/acquire
  // publishes it), read by the worker that gets seq.
  int64_t* assign_ns() {
    return reinterpret_cast<int64_t*>(static_cast<char*>(map_.data()) +
                                      sizeof(WorkerStats) * workers_);
  }

 private:
  uint32_t workers_;
  size_t bytes_;
  Mapping map_;
};

// ---- the worker -------------------------------------------------------------------

int64_t worker_timeout_ms(const Options& o, uint32_t w) {
  // Even workers: long timeout, so that only a futex wake can make them pick
  // up a task in time (a lost wake-up shows as a pick-up >= stall_ms).
  // Odd workers: short timeout, so TimedOut happens often and is checked.
  return w % 2 == 0 ? o.long_timeout_ms : o.short_timeout_ms;
}

int worker_loop(WorkerRing& ring, uint32_t w, const Options& o, TestArea& area) {
  Checker ck("worker " + std::to_string(w) + " tid " + std::to_string(current_tid()));
  WorkerStats& st = area.stats(w);
  const RingSegment& seg = *ring.segment();
  ring.worker_started(w, current_tid());
  std::mt19937_64 rng(mix64(o.seed * 1000003 + w));
  const int64_t timeout_ns = worker_timeout_ms(o, w) * kMs;
  const bool lost_wakeup_detectable = timeout_ns > o.stall_ms * kMs;
  uint64_t last_seq = fastload::kNoSeq;
  int64_t* assign_ns = area.assign_ns();

  for (;;) {
    if (o.delay_pct > 0 && rng() % 100 < o.delay_pct / 2) sleep_us(rng() % (o.max_delay_us + 1));
    TaskRef t{};
    const int64_t t0 = monotonic_ns();
    const WaitResult r = ring.next_task(timeout_ns, &t);
    const int64_t t1 = monotonic_ns();
    if (r == WaitResult::Shutdown) {
      st.saw_shutdown = 1;
      st.shutdown_seen_ns = t1;
      ck.check(seg.is_shutdown(), "next_task returned Shutdown but is_shutdown() is false");
      break;
    }
    if (r == WaitResult::TimedOut) {
      ++st.timeouts;
      // No signal is ever sent to a worker here, so TimedOut may not be early.
      ck.check(t1 - t0 >= timeout_ns, "next_task(timeout %.1f ms) returned TimedOut after %.3f ms",
               ms(timeout_ns), ms(t1 - t0));
      st.max_timeout_late_ns = std::max(st.max_timeout_late_ns, t1 - t0 - timeout_ns);
      ck.check(t1 - t0 - timeout_ns < o.stall_ms * kMs,
               "next_task(timeout %.1f ms) returned TimedOut %.3f ms late", ms(timeout_ns),
               ms(t1 - t0 - timeout_ns));
      continue;
    }
    if (!ck.check(r == WaitResult::Ready, "next_task returned %d", static_cast<int>(r))) break;
    ++st.tasks;
    if (!ck.check(t.slot < seg.num_slots(), "next_task gave slot %u of %u", t.slot,
                  seg.num_slots()))
      break;  // nothing sane to commit
    char* p = seg.payload(t.slot);
    Task task{};
    if (ck.check(t.task_len == sizeof(Task), "task_len %" PRIu64 " != %zu", t.task_len,
                 sizeof(Task)))
      std::memcpy(&task, p, sizeof task);
    ck.check(task.magic == kTaskMagic && task.check == task_check(task),
             "seq %" PRIu64 ": task bytes in slot %u are corrupt (torn or stale task)", t.seq,
             t.slot);
    ck.check(task.seq == t.seq, "TaskRef.seq %" PRIu64 " but task bytes say %" PRIu64, t.seq,
             task.seq);
    ck.check(task.worker == w && t.seq % o.workers == w,
             "seq %" PRIu64 " (for worker %u) reached worker %u", t.seq, task.worker, w);
    ck.check(t.seq < o.items, "seq %" PRIu64 " out of range", t.seq);
    // Main assigns increasing seqs and each queue is FIFO.
    ck.check(last_seq == fastload::kNoSeq || t.seq > last_seq,
             "seq %" PRIu64 " after %" PRIu64 ": queue not FIFO", t.seq, last_seq);
    last_seq = t.seq;
    ck.check(seg.state(t.slot) == SlotState::Writing, "slot %u is %s after next_task, not WRITING",
             t.slot, state_name(seg.state(t.slot)));
    // What main's watchdog reads (MainRing::worker_current_seq), read here
    // from the worker's own mapping.
    const uint64_t current_seq = fastload::sync::load_acquire(seg.worker(w).current_seq);
    ck.check(current_seq == t.seq, "worker_current_seq %" PRIu64 " != %" PRIu64, current_seq,
             t.seq);
    if (t.seq < o.items) {
      const int64_t pickup = t1 - assign_ns[t.seq];
      st.max_pickup_ns = std::max(st.max_pickup_ns, pickup);
      if (lost_wakeup_detectable)
        ck.check(pickup < o.stall_ms * kMs,
                 "seq %" PRIu64 " picked up %.1f ms after assign() (lost wake-up?)", t.seq,
                 ms(pickup));
    }

    if (o.delay_pct > 0 && rng() % 100 < o.delay_pct) sleep_us(rng() % (o.max_delay_us + 1));
    uint64_t size = task.size;
    if (!ck.check(meta_offset_for(size) + sizeof(ResultMeta) <= seg.slot_bytes(),
                  "task size %" PRIu64 " does not fit", size))
      size = 0;
    write_result(p, size, task.seq, task.seed, w);
    const fastload::CommitResult cr = ring.commit(
        t.slot, SlotResult{result_kind(t.seq, w), size, meta_offset_for(size), sizeof(ResultMeta)});
    ck.check(cr == fastload::CommitResult::Committed, "seq %" PRIu64 ": commit refused", t.seq);
  }
  st.passed = ck.passed();
  st.failed = ck.failed();
  const int rc = (ck.failed() == 0 && st.saw_shutdown != 0) ? 0 : 1;
  st.exit_code = rc;
  return rc;
}

// ---- RAII for the workers -----------------------------------------------------

volatile sig_atomic_t g_sigchld = 0;
void on_sigchld(int) { g_sigchld = 1; }

// A SIGCHLD handler without SA_RESTART while process workers run: a dying
// worker interrupts main's futex wait (the Interrupted path of wait_any).
class SigchldScope {
 public:
  SigchldScope() {
    struct sigaction sa {};
    sa.sa_handler = on_sigchld;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;
    ::sigaction(SIGCHLD, &sa, &old_);
  }
  ~SigchldScope() { ::sigaction(SIGCHLD, &old_, nullptr); }
  SigchldScope(const SigchldScope&) = delete;
  SigchldScope& operator=(const SigchldScope&) = delete;

 private:
  struct sigaction old_ {};
};

std::string describe_status(int status) {
  char buf[64];
  if (WIFEXITED(status))
    std::snprintf(buf, sizeof buf, "exit status %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    std::snprintf(buf, sizeof buf, "killed by signal %d (%s)", WTERMSIG(status),
                  strsignal(WTERMSIG(status)));
  else
    std::snprintf(buf, sizeof buf, "status 0x%x", status);
  return buf;
}

// Forked workers: killed and reaped on any early exit from the test.
class ChildGroup {
 public:
  ChildGroup() = default;
  ChildGroup(const ChildGroup&) = delete;
  ChildGroup& operator=(const ChildGroup&) = delete;
  ~ChildGroup() {
    for (Child& c : kids_) {
      if (c.reaped) continue;
      ::kill(c.pid, SIGKILL);
      int status = 0;
      while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
  }
  void add(uint32_t worker, pid_t pid) { kids_.push_back(Child{worker, pid, false, 0}); }
  size_t size() const { return kids_.size(); }
  pid_t pid(uint32_t worker) const { return kids_.at(worker).pid; }

  // Before shutdown no worker may have exited.
  void require_alive(Checker& ck) {
    for (Child& c : kids_) {
      if (c.reaped) continue;
      int status = 0;
      pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.reaped = true;
        c.status = status;
        ck.require(false, "worker %u (pid %d) exited before shutdown: %s", c.worker,
                   static_cast<int>(c.pid), describe_status(status).c_str());
      }
    }
  }

  // Reaps every worker; each must exit 0 within timeout_ns.
  void reap_all(int64_t timeout_ns, Checker& ck) {
    const int64_t deadline = monotonic_ns() + timeout_ns;
    for (;;) {
      size_t left = 0;
      for (Child& c : kids_) {
        if (c.reaped) continue;
        int status = 0;
        pid_t r = ::waitpid(c.pid, &status, WNOHANG);
        if (r == c.pid) {
          c.reaped = true;
          c.status = status;
          ck.check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker %u (pid %d): %s",
                   c.worker, static_cast<int>(c.pid), describe_status(status).c_str());
        } else {
          ++left;
        }
      }
      if (left == 0) return;
      ck.require(monotonic_ns() < deadline, "%zu worker(s) still running %.0f ms after shutdown",
                 left, ms(timeout_ns));
      sleep_us(1000);
    }
  }

 private:
  struct Child {
    uint32_t worker;
    pid_t pid;
    bool reaped;
    int status;
  };
  std::vector<Child> kids_;
};

// Worker threads: on an early exit the ring is shut down so they return,
// then joined.
class ThreadGroup {
 public:
  explicit ThreadGroup(MainRing& ring) : ring_(ring) {}
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;
  ~ThreadGroup() {
    if (threads_.empty()) return;
    ring_.shutdown();
    join_all();
  }
  template <class F>
  void spawn(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }
  void join_all() {
    for (std::thread& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

 private:
  MainRing& ring_;
  std::vector<std::thread> threads_;
};

// CPU time (ns) a thread has used, from /proc; -1 when unreadable.
int64_t thread_cpu_ns(pid_t pid, uint32_t tid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/";
  {
    std::ifstream f(dir + "schedstat");  // "<ns on cpu> <ns waiting> <slices>"
    long long v = 0;
    if (f >> v) return v;
  }
  std::ifstream f(dir + "stat");
  std::string line;
  if (!std::getline(f, line)) return -1;
  const std::string::size_type rp = line.rfind(')');
  if (rp == std::string::npos) return -1;
  std::istringstream rest(line.substr(rp + 2));
  std::vector<std::string> fields;
  for (std::string s; rest >> s;) fields.push_back(s);
  if (fields.size() < 13) return -1;  // fields[11] = utime, fields[12] = stime (ticks)
  const long long ticks = std::stoll(fields[11]) + std::stoll(fields[12]);
  return ticks * (1000000000LL / ::sysconf(_SC_CLK_TCK));
}

// ---- main, the loader --------------------------------------------------------

struct InFlight {
  uint64_t seq;
  uint32_t slot;
  Task task;
};

struct RunStats {
  uint64_t out_of_order = 0;
  uint64_t leased = 0;
  uint64_t interrupted_waits = 0;
  int64_t max_wake_ns = 0;
};

class Loader {
 public:
  Loader(MainRing& ring, const Options& o, TestArea& area, Checker& ck, ChildGroup* kids)
      : ring_(ring),
        seg_(*ring.segment()),
        o_(o),
        area_(area),
        ck_(ck),
        kids_(kids),
        rng_(mix64(o.seed)),
        seen_(o.items, 0),
        max_size_(seg_.slot_bytes() - 128) {}

  const RunStats& stats() const { return stats_; }

  // Items [next, end), results taken in order with wait_ready.
  void run_in_order(uint64_t end) {
    std::deque<InFlight> q;
    while (next_seq_ < end || !q.empty()) {
      fill(end, [&](const InFlight& f) { q.push_back(f); }, q.size());
      ck_.require(!q.empty(), "nothing in flight and no free slot (%zu free)",
                  ring_.free_slot_count());
      const InFlight f = q.front();
      q.pop_front();
      maybe_delay();
      const int64_t t0 = monotonic_ns();
      const WaitResult r = wait_with_watchdog(
          [&](int64_t left) { return ring_.wait_ready(f.slot, f.seq, left); }, f.seq);
      const int64_t t1 = monotonic_ns();
      ck_.require(r == WaitResult::Ready, "wait_ready(slot %u, seq %" PRIu64 ") returned %s", f.slot,
                  f.seq, wait_name(r));
      verify(f, t0, t1);
      finish(f, /*may_hold=*/false);
    }
  }

  // Items [next, end), results taken as they come with wait_any; some are
  // leased and held for a while (their slots must stay untouched).
  void run_any_order(uint64_t end) {
    std::vector<InFlight> live;
    std::vector<uint32_t> slots;
    std::vector<uint64_t> seqs;
    while (next_seq_ < end || !live.empty() || !held_.empty()) {
      fill(end, [&](const InFlight& f) { live.push_back(f); }, live.size());
      if (live.empty()) {  // every slot is held: give some back
        ck_.require(!held_.empty(), "nothing in flight, nothing held, no free slot");
        release_held(held_.size());
        continue;
      }
      if (rng_() % 4 == 0) std::shuffle(live.begin(), live.end(), rng_);
      slots.clear();
      seqs.clear();
      uint64_t min_seq = fastload::kNoSeq;
      for (const InFlight& f : live) {
        slots.push_back(f.slot);
        seqs.push_back(f.seq);
        min_seq = std::min(min_seq, f.seq);
      }
      maybe_delay();
      size_t which = ~size_t{0};
      const int64_t t0 = monotonic_ns();
      const WaitResult r = wait_with_watchdog(
          [&](int64_t left) {
            return ring_.wait_any(slots.data(), seqs.data(), slots.size(), left, &which);
          },
          min_seq);
      const int64_t t1 = monotonic_ns();
      ck_.require(r == WaitResult::Ready, "wait_any over %zu slots returned %s", slots.size(),
                  wait_name(r));
      ck_.require(which < live.size(), "wait_any returned index %zu of %zu", which, live.size());
      const InFlight f = live[which];
      if (f.seq != min_seq) ++stats_.out_of_order;
      verify(f, t0, t1);
      live[which] = live.back();
      live.pop_back();
      finish(f, /*may_hold=*/true);
      if (!held_.empty() && (held_.size() > o_.slots / 2 || rng_() % 8 == 0))
        release_held(1 + rng_() % held_.size());
    }
  }

  // Every item seen exactly once.
  void require_all_seen() {
    uint64_t n = 0;
    for (uint8_t s : seen_) n += s;
    ck_.require(n == o_.items, "%" PRIu64 " of %" PRIu64 " items seen", n, o_.items);
    ck_.require(ring_.free_slot_count() == o_.slots, "%zu of %u slots free at the end",
                ring_.free_slot_count(), o_.slots);
    for (uint32_t s = 0; s < o_.slots; ++s)
      ck_.require(seg_.state(s) == SlotState::Free, "slot %u is %s at the end", s,
                  state_name(seg_.state(s)));
  }

 private:
  template <class Push>
  void fill(uint64_t end, Push push, size_t live_before) {
    size_t live = live_before;
    while (next_seq_ < end) {
      uint32_t s = 0;
      if (!ring_.pop_free_slot(&s)) break;
      ck_.require(s < o_.slots, "pop_free_slot gave slot %u", s);
      InFlight f{next_seq_++, s, make_task(next_seq_ - 1)};
      area_.assign_ns()[f.seq] = monotonic_ns();
      ring_.assign(s, f.seq, f.task.worker, &f.task, sizeof f.task);
      const SlotState st = seg_.state(s);
      ck_.require(st == SlotState::Assigned || st == SlotState::Writing ||
                      st == SlotState::Committing || st == SlotState::Ready,
                  "slot %u is %s right after assign()", s, state_name(st));
      push(f);
      ++live;
    }
    // At most num_slots in flight: every slot is free, in flight or held.
    ck_.require(live + held_.size() + ring_.free_slot_count() == o_.slots,
                "%zu in flight + %zu held + %zu free != %u slots", live, held_.size(),
                ring_.free_slot_count(), o_.slots);
  }

  Task make_task(uint64_t seq) {
    Task t{};
    t.magic = kTaskMagic;
    t.seq = seq;
    t.seed = rng_();
    switch (rng_() % 16) {
      case 0: t.size = 0; break;
      case 1: t.size = max_size_; break;
      case 2:
      case 3: t.size = rng_() % (max_size_ + 1); break;
      default: t.size = rng_() % (std::min<uint64_t>(4096, max_size_) + 1); break;
    }
    t.worker = static_cast<uint32_t>(seq % o_.workers);
    t.kind = 0;
    t.check = task_check(t);
    return t;
  }

  void maybe_delay() {
    if (o_.delay_pct > 0 && rng_() % 100 < o_.delay_pct / 2) sleep_us(rng_() % (o_.max_delay_us + 1));
  }

  // Waits like the Python loader: a signal (SIGCHLD of a dead worker) cuts
  // the wait short, main looks at its workers and waits again.
  template <class Wait>
  WaitResult wait_with_watchdog(Wait wait, uint64_t seq) {
    const int64_t deadline = monotonic_ns() + o_.long_timeout_ms * kMs;
    for (;;) {
      const WaitResult r = wait(std::max<int64_t>(deadline - monotonic_ns(), 0));
      if (r != WaitResult::TimedOut) return r;
      if (kids_ != nullptr) kids_->require_alive(ck_);
      if (monotonic_ns() >= deadline) {
        const uint32_t w = static_cast<uint32_t>(seq % o_.workers);
        std::fprintf(stderr,
                     "  no result for seq %" PRIu64 " within %" PRId64
                     " ms; worker %u: progress %" PRIu64 ", current seq %" PRIu64 "\n",
                     seq, o_.long_timeout_ms, w, ring_.worker_progress(w),
                     ring_.worker_current_seq(w));
        return r;
      }
      ++stats_.interrupted_waits;
    }
  }

  void verify(const InFlight& f, int64_t wait_start, int64_t woke) {
    const uint32_t s = f.slot;
    const uint64_t seq = f.seq;
    ck_.require(ring_.is_ready(s, seq), "seq %" PRIu64 ": is_ready false after Ready", seq);
    ck_.require(!ring_.is_ready(s, seq + 1) && !ring_.is_ready(s, seq ^ (1ULL << 63)),
                "seq %" PRIu64 ": is_ready true for another seq stamp", seq);
    ck_.require(seg_.state(s) == SlotState::Ready, "seq %" PRIu64 ": slot %u is %s, not READY",
                seq, s, state_name(seg_.state(s)));
    const SlotResult res = ring_.result(s);
    const uint64_t size = f.task.size;
    ck_.require(res.kind == result_kind(seq, f.task.worker) && res.data_len == size &&
                    res.meta_offset == meta_offset_for(size) && res.meta_len == sizeof(ResultMeta),
                "seq %" PRIu64 ": result() {kind %u, data_len %" PRIu64 ", meta %" PRIu64 "+%" PRIu64
                "} != expected {%u, %" PRIu64 ", %" PRIu64 "+%zu}",
                seq, res.kind, res.data_len, res.meta_offset, res.meta_len,
                result_kind(seq, f.task.worker), size, meta_offset_for(size), sizeof(ResultMeta));
    const char* p = seg_.payload(s);
    ResultMeta m{};
    std::memcpy(&m, p + meta_offset_for(size), sizeof m);
    ck_.require(m.magic == kResultMagic && m.check == meta_check(m) && m.seq == seq &&
                    m.seed == f.task.seed && m.size == size && m.worker == f.task.worker,
                "seq %" PRIu64 ": result meta is wrong (seq %" PRIu64 ", worker %u): stale or torn",
                seq, m.seq, m.worker);
    const uint64_t bad = find_pattern_mismatch(p, size, pattern_seed(seq, f.task.seed));
    ck_.require(bad == size, "seq %" PRIu64 ": payload byte %" PRIu64 " of %" PRIu64 " is wrong",
                seq, bad, size);
    // Lost wake-up check on main's side: once the result was committed main
    // must be awake within stall_ms.
    const int64_t wake = woke - std::max(wait_start, m.commit_ns);
    stats_.max_wake_ns = std::max(stats_.max_wake_ns, wake);
    ck_.require(wake < o_.stall_ms * kMs,
                "seq %" PRIu64 ": main woke %.1f ms after the commit (lost wake-up?)", seq, ms(wake));
    ck_.require(seq < o_.items && seen_[seq] == 0, "seq %" PRIu64 " seen twice", seq);
    seen_[seq] = 1;
  }

  void finish(const InFlight& f, bool may_hold) {
    if (may_hold && rng_() % 4 == 0) {
      ring_.lease(f.slot);
      ck_.require(seg_.state(f.slot) == SlotState::Leased, "slot %u not LEASED after lease()",
                  f.slot);
      ++stats_.leased;
      held_.push_back(f);
      return;
    }
    if (rng_() % 8 == 0) {
      ring_.lease(f.slot);
      ++stats_.leased;
    }
    ring_.release(f.slot);
    ck_.require(seg_.state(f.slot) == SlotState::Free, "slot %u not FREE after release()", f.slot);
  }

  // A held (leased) slot must still hold its result: no worker and no
  // assign() may have touched it.
  void release_held(size_t n) {
    for (size_t i = 0; i < n && !held_.empty(); ++i) {
      const size_t k = rng_() % held_.size();
      const InFlight f = held_[k];
      held_[k] = held_.back();
      held_.pop_back();
      ck_.require(seg_.state(f.slot) == SlotState::Leased, "held slot %u is %s", f.slot,
                  state_name(seg_.state(f.slot)));
      const char* p = seg_.payload(f.slot);
      const uint64_t size = f.task.size;
      ResultMeta m{};
      std::memcpy(&m, p + meta_offset_for(size), sizeof m);
      ck_.require(m.seq == f.seq &&
                      find_pattern_mismatch(p, size, pattern_seed(f.seq, f.task.seed)) == size,
                  "seq %" PRIu64 ": leased slot %u changed while held", f.seq, f.slot);
      ring_.release(f.slot);
    }
  }

  MainRing& ring_;
  const RingSegment& seg_;
  const Options& o_;
  TestArea& area_;
  Checker& ck_;
  ChildGroup* kids_;
  std::mt19937_64 rng_;
  std::vector<uint8_t> seen_;
  uint64_t max_size_;
  uint64_t next_seq_ = 0;
  std::vector<InFlight> held_;
  RunStats stats_;
};

// Workers must burn (almost) no CPU while idle: they sleep in futex_wait.
void check_idle_cpu(MainRing& ring, const Options& o, Checker& ck, pid_t pid_of_threads,
                    const ChildGroup* kids) {
  if (o.idle_ms <= 0) return;
  sleep_us(50 * 1000);  // let every worker finish its spin and go to sleep
  std::vector<int64_t> before(o.workers, -1);
  std::vector<pid_t> pids(o.workers);
  for (uint32_t w = 0; w < o.workers; ++w) {
    pids[w] = kids != nullptr ? kids->pid(w) : pid_of_threads;
    before[w] = thread_cpu_ns(pids[w], ring.worker_pid(w));
  }
  const int64_t t0 = monotonic_ns();
  sleep_us(static_cast<uint64_t>(o.idle_ms) * 1000);
  const int64_t window = monotonic_ns() - t0;
  const int64_t limit = static_cast<int64_t>(static_cast<double>(window) * o.idle_cpu_pct / 100.0);
  int64_t worst = 0;
  for (uint32_t w = 0; w < o.workers; ++w) {
    const int64_t after = thread_cpu_ns(pids[w], ring.worker_pid(w));
    if (!ck.check(before[w] >= 0 && after >= 0, "cannot read the CPU time of worker %u (tid %u)",
                  w, ring.worker_pid(w)))
      continue;
    worst = std::max(worst, after - before[w]);
    ck.check(after - before[w] <= limit,
             "idle worker %u used %.1f ms of CPU in %.0f ms (limit %.1f ms): busy loop?", w,
             ms(after - before[w]), ms(window), ms(limit));
  }
  std::printf("  idle: worst worker used %.2f ms CPU in %.0f ms idle (limit %.1f ms)\n", ms(worst),
              ms(window), ms(limit));
}

// Sums the workers' checks and checks their stats after they are gone.
void check_worker_stats(const Options& o, TestArea& area, Checker& ck, int64_t shutdown_ns,
                        uint64_t* worker_passed, uint64_t* worker_failed) {
  int64_t max_pickup = 0;
  int64_t max_late = 0;
  int64_t max_shutdown = 0;
  uint64_t total = 0;
  for (uint32_t w = 0; w < o.workers; ++w) {
    const WorkerStats& st = area.stats(w);
    *worker_passed += st.passed;
    *worker_failed += st.failed;
    const uint64_t expected = o.items / o.workers + (w < o.items % o.workers ? 1 : 0);
    ck.check(st.tasks == expected, "worker %u made %" PRIu64 " tasks, expected %" PRIu64, w,
             st.tasks, expected);
    total += st.tasks;
    ck.check(st.saw_shutdown == 1, "worker %u did not see Shutdown", w);
    if (st.saw_shutdown == 1) {
      const int64_t lat = st.shutdown_seen_ns - shutdown_ns;
      max_shutdown = std::max(max_shutdown, lat);
      ck.check(lat < o.stall_ms * kMs,
               "worker %u saw Shutdown %.1f ms after shutdown() (lost wake-up?)", w, ms(lat));
    }
    if (o.idle_ms >= 2 * o.short_timeout_ms && w % 2 == 1)
      ck.check(st.timeouts > 0, "short-timeout worker %u never timed out while idle", w);
    max_pickup = std::max(max_pickup, st.max_pickup_ns);
    max_late = std::max(max_late, st.max_timeout_late_ns);
  }
  ck.check(total == o.items, "workers made %" PRIu64 " tasks for %" PRIu64 " items", total,
           o.items);
  std::printf("  workers: max pick-up %.2f ms, max TimedOut lateness %.2f ms, "
              "max shutdown latency %.2f ms\n",
              ms(max_pickup), ms(max_late), ms(max_shutdown));
}

struct ModeResult {
  uint64_t worker_passed = 0;
  uint64_t worker_failed = 0;
};

void run_loader_phases(Loader& loader, MainRing& ring, const Options& o, Checker& ck,
                       pid_t pid_of_threads, const ChildGroup* kids) {
  const int64_t t0 = monotonic_ns();
  loader.run_in_order(o.items / 2);
  const int64_t t1 = monotonic_ns();
  std::printf("  in order (wait_ready): %" PRIu64 " items in %.0f ms\n", o.items / 2, ms(t1 - t0));
  check_idle_cpu(ring, o, ck, pid_of_threads, kids);
  const int64_t t2 = monotonic_ns();
  loader.run_any_order(o.items);
  const int64_t t3 = monotonic_ns();
  const RunStats& rs = loader.stats();
  std::printf("  any order (wait_any): %" PRIu64 " items in %.0f ms, %" PRIu64
              " out of order, %" PRIu64 " leased\n",
              o.items - o.items / 2, ms(t3 - t2), rs.out_of_order, rs.leased);
  std::printf("  main: max wake-up latency %.2f ms, %" PRIu64 " interrupted waits\n",
              ms(rs.max_wake_ns), rs.interrupted_waits);
  loader.require_all_seen();
}

ModeResult run_process_mode(const Options& o, Checker& ck) {
  ModeResult res;
  std::shared_ptr<MainRing> ring = MainRing::create(o.slots, o.workers, o.slot_bytes);
  TestArea area(o.workers, o.items);
  SigchldScope sigchld;
  ChildGroup kids;
  const pid_t parent = ::getpid();
  for (uint32_t w = 0; w < o.workers; ++w) {
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    ck.require(pid >= 0, "fork: %s", std::strerror(errno));
    if (pid == 0) {
      int rc = 2;
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(3);
      try {
        // The realistic path: map the ring again from its fd.
        const int fd = ::dup(ring->segment()->fd());
        if (fd < 0) throw std::runtime_error(std::string("dup: ") + std::strerror(errno));
        std::shared_ptr<WorkerRing> mine = WorkerRing::attach(fd);
        rc = worker_loop(*mine, w, o, area);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "FAIL [worker %u] exception: %s\n", w, e.what());
        rc = 2;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(rc);
    }
    kids.add(w, pid);
  }
  Loader loader(*ring, o, area, ck, &kids);
  // Workers announce themselves; their pid must be the forked one.
  const int64_t deadline = monotonic_ns() + o.long_timeout_ms * kMs;
  for (uint32_t w = 0; w < o.workers; ++w) {
    while (ring->worker_pid(w) == 0 && monotonic_ns() < deadline) sleep_us(200);
    ck.require(ring->worker_pid(w) == static_cast<uint32_t>(kids.pid(w)),
               "worker_pid(%u) = %u, forked pid %d", w, ring->worker_pid(w),
               static_cast<int>(kids.pid(w)));
  }
  run_loader_phases(loader, *ring, o, ck, 0, &kids);
  const int64_t shutdown_ns = monotonic_ns();
  ring->shutdown();
  kids.reap_all(10000 * kMs, ck);
  check_worker_stats(o, area, ck, shutdown_ns, &res.worker_passed, &res.worker_failed);
  return res;
}

ModeResult run_thread_mode(const Options& o, Checker& ck) {
  ModeResult res;
  std::shared_ptr<MainRing> ring = MainRing::create(o.slots, o.workers, o.slot_bytes);
  TestArea area(o.workers, o.items);
  ThreadGroup threads(*ring);
  for (uint32_t w = 0; w < o.workers; ++w) {
    std::shared_ptr<WorkerRing> mine;
    if (o.thread_attach) {
      const int fd = ::dup(ring->segment()->fd());
      ck.require(fd >= 0, "dup: %s", std::strerror(errno));
      mine = WorkerRing::attach(fd);
    } else {
      mine = std::make_shared<WorkerRing>(ring->segment());
    }
    threads.spawn([mine, w, &o, &area] {
      try {
        worker_loop(*mine, w, o, area);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "FAIL [worker %u] exception: %s\n", w, e.what());
        area.stats(w).exit_code = 2;
        area.stats(w).failed += 1;
      }
    });
  }
  const int64_t deadline = monotonic_ns() + o.long_timeout_ms * kMs;
  for (uint32_t w = 0; w < o.workers; ++w) {
    while (ring->worker_pid(w) == 0 && monotonic_ns() < deadline) sleep_us(200);
    ck.require(ring->worker_pid(w) != 0, "worker thread %u never started", w);
  }
  Loader loader(*ring, o, area, ck, nullptr);
  run_loader_phases(loader, *ring, o, ck, ::getpid(), nullptr);
  const int64_t shutdown_ns = monotonic_ns();
  ring->shutdown();
  threads.join_all();
  for (uint32_t w = 0; w < o.workers; ++w)
    ck.check(area.stats(w).exit_code == 0, "worker thread %u ended with code %d", w,
             area.stats(w).exit_code);
  check_worker_stats(o, area, ck, shutdown_ns, &res.worker_passed, &res.worker_failed);
  return res;
}

// ---- timeouts, "infinite" timeouts and shutdown, on a quiet ring ------------

void timing_test(const Options& o, Checker& ck) {
  const int64_t slack = o.timing_slack_ms * kMs;
  std::shared_ptr<MainRing> ring = MainRing::create(2, 1, 4096);
  // The worker's side, on this thread and (one at a time) on the threads below.
  WorkerRing worker(ring->segment());
  worker.worker_started(0, current_tid());
  auto timed = [&](const char* what, int64_t timeout, WaitResult want, WaitResult got,
                   int64_t el) {
    ck.require(got == want, "%s(timeout %.1f ms) returned %s, expected %s", what, ms(timeout),
               wait_name(got), wait_name(want));
    if (want == WaitResult::TimedOut)
      ck.require(el >= std::max<int64_t>(timeout, 0), "%s(timeout %.1f ms) timed out early: %.3f ms",
                 what, ms(timeout), ms(el));
    ck.require(el <= std::max<int64_t>(timeout, 0) + slack,
               "%s(timeout %.1f ms) returned after %.3f ms (slack %.0f ms)", what, ms(timeout),
               ms(el), ms(slack));
  };
  TaskRef t{};
  for (int64_t timeout : {int64_t{-5} * kMs, int64_t{0}, 1 * kMs, 20 * kMs, 100 * kMs}) {
    const int64_t t0 = monotonic_ns();
    const WaitResult r = worker.next_task(timeout, &t);
    timed("next_task", timeout, WaitResult::TimedOut, r, monotonic_ns() - t0);
  }
  uint32_t s = 0;
  ck.require(ring->pop_free_slot(&s), "pop_free_slot on a fresh ring");
  Task task{};
  task.magic = kTaskMagic;
  task.seq = 7;
  task.check = task_check(task);
  ring->assign(s, 7, 0, &task, sizeof task);
  const uint64_t seq7 = 7;
  for (int64_t timeout : {int64_t{0}, 30 * kMs}) {
    int64_t t0 = monotonic_ns();
    WaitResult r = ring->wait_ready(s, 7, timeout);
    timed("wait_ready", timeout, WaitResult::TimedOut, r, monotonic_ns() - t0);
    size_t which = 0;
    t0 = monotonic_ns();
    r = ring->wait_any(&s, &seq7, 1, timeout, &which);
    timed("wait_any", timeout, WaitResult::TimedOut, r, monotonic_ns() - t0);
  }
  // A queued task comes back at once, whatever the timeout.
  int64_t t0 = monotonic_ns();
  WaitResult r = worker.next_task(INT64_MAX, &t);
  timed("next_task(queued)", 0, WaitResult::Ready, r, monotonic_ns() - t0);
  ck.require(t.slot == s && t.seq == 7 && t.task_len == sizeof task, "next_task gave the wrong task");
  ck.require(ring->segment()->state(s) == SlotState::Writing, "slot not WRITING after next_task");

  // main waiting with an "infinite" timeout is woken by a commit.
  {
    std::thread committer([&] {
      sleep_us(30 * 1000);
      worker.commit(s, SlotResult{5, 0, 0, 0});
    });
    t0 = monotonic_ns();
    r = ring->wait_ready(s, 7, INT64_MAX);
    const int64_t el = monotonic_ns() - t0;
    committer.join();
    ck.require(r == WaitResult::Ready, "wait_ready(INT64_MAX) returned %s", wait_name(r));
    ck.require(el >= 25 * kMs && el <= 30 * kMs + slack,
               "wait_ready(INT64_MAX) woke after %.1f ms for a commit at 30 ms", ms(el));
    ck.require(ring->result(s).kind == 5, "result().kind after commit");
    ring->release(s);
  }
  // A worker waiting with an "infinite" timeout is woken by an assign.
  {
    TaskRef t2{};
    WaitResult r2 = WaitResult::Shutdown;
    int64_t el2 = 0;
    std::thread worker_thread([&] {
      const int64_t a = monotonic_ns();
      r2 = worker.next_task(INT64_MAX, &t2);
      el2 = monotonic_ns() - a;
    });
    sleep_us(30 * 1000);
    ck.require(ring->pop_free_slot(&s), "pop_free_slot");
    task.seq = 8;
    task.check = task_check(task);
    ring->assign(s, 8, 0, &task, sizeof task);
    worker_thread.join();
    ck.require(r2 == WaitResult::Ready && t2.seq == 8 && t2.slot == s,
               "next_task(INT64_MAX) returned %s (seq %" PRIu64 ")", wait_name(r2), t2.seq);
    ck.require(el2 <= 30 * kMs + slack, "next_task(INT64_MAX) woke after %.1f ms for an assign at 30 ms",
               ms(el2));
    worker.commit(s, SlotResult{6, 0, 0, 0});
    ck.require(ring->wait_ready(s, 8, 0) == WaitResult::Ready, "wait_ready after commit");
    ring->release(s);
  }
  // shutdown() wakes a worker sleeping with an "infinite" timeout, and a
  // main-side waiter on another thread (a slot nobody will fill).
  {
    ck.require(ring->pop_free_slot(&s), "pop_free_slot");
    task.seq = 9;
    task.check = task_check(task);
    ring->assign(s, 9, 0, &task, sizeof task);  // queued, never popped: stays ASSIGNED
    WaitResult r3 = WaitResult::Ready;
    WaitResult r4 = WaitResult::Ready;
    int64_t el3 = 0;
    int64_t el4 = 0;
    TaskRef t3{};
    std::thread waiter([&] {
      const int64_t a = monotonic_ns();
      r4 = ring->wait_ready(s, 9, INT64_MAX);
      el4 = monotonic_ns() - a;
    });
    sleep_us(30 * 1000);
    // Pop the task first so the worker below finds an empty queue and sleeps.
    ck.require(worker.next_task(0, &t3) == WaitResult::Ready && t3.seq == 9, "next_task(seq 9)");
    std::thread worker_thread([&] {
      const int64_t a = monotonic_ns();
      r3 = worker.next_task(INT64_MAX, &t3);
      el3 = monotonic_ns() - a;
    });
    sleep_us(30 * 1000);
    ring->shutdown();
    worker_thread.join();
    waiter.join();
    ck.require(r3 == WaitResult::Shutdown, "next_task during shutdown() returned %s",
               wait_name(r3));
    ck.require(el3 <= 30 * kMs + slack, "shutdown() woke next_task after %.1f ms", ms(el3));
    ck.require(r4 == WaitResult::Shutdown, "wait_ready during shutdown() returned %s",
               wait_name(r4));
    ck.require(el4 <= 60 * kMs + slack, "shutdown() woke wait_ready after %.1f ms", ms(el4));
  }
  ck.require(ring->is_shutdown(), "is_shutdown() after shutdown()");
  t0 = monotonic_ns();
  r = worker.next_task(1000 * kMs, &t);
  timed("next_task(after shutdown)", 0, WaitResult::Shutdown, r, monotonic_ns() - t0);
  t0 = monotonic_ns();
  r = ring->wait_ready(1, 99, 1000 * kMs);
  timed("wait_ready(after shutdown)", 0, WaitResult::Shutdown, r, monotonic_ns() - t0);
  std::printf("  timing: next_task/wait_ready/wait_any timeouts, INT64_MAX waits, shutdown: ok\n");
}

// shutdown() from one thread while another thread of main is about to sleep
// in wait_ready(), or a worker in next_task(): the waiter must return
// Shutdown at once, whatever the interleaving. Each trial starts the waiter,
// lets it run a random few microseconds into its wait, then shuts down. (A
// wake-up lost here costs the waiter its whole timeout.)
void shutdown_race_test(const Options& o, Checker& ck) {
  if (o.shutdown_trials == 0) return;
  const int64_t timeout = 200 * kMs;
  std::mt19937_64 rng(mix64(o.seed ^ 0x5d));
  // How long a wait takes to get from its call to its futex_wait (a wait
  // with timeout 0 runs the whole path but the sleep): shutdown() is fired
  // at a random instant between half and one and a half times that, around
  // the moment the waiter goes to sleep, whatever the build (sanitizers are
  // slower).
  int64_t reach_ns[2] = {0, 0};
  {
    std::shared_ptr<MainRing> ring = MainRing::create(1, 1, 4096);
    WorkerRing worker(ring->segment());
    worker.worker_started(0, current_tid());
    std::vector<int64_t> d;
    for (int side = 0; side < 2; ++side) {
      d.clear();
      for (int k = 0; k < 51; ++k) {
        TaskRef t{};
        const int64_t a = monotonic_ns();
        if (side == 1) ring->wait_ready(0, 1, 0); else worker.next_task(0, &t);
        d.push_back(monotonic_ns() - a);
      }
      std::nth_element(d.begin(), d.begin() + 25, d.end());
      reach_ns[side] = std::max<int64_t>(d[25], 1000);
    }
  }
  int64_t worst = 0;
  uint32_t lost = 0;
  const int64_t t_start = monotonic_ns();
  for (uint32_t i = 0; i < o.shutdown_trials; ++i) {
    // Odd trials: a thread of main in wait_ready; even: a worker in next_task.
    const bool main_side = i % 2 == 1;
    std::shared_ptr<MainRing> ring = MainRing::create(1, 1, 4096);
    // Used here, then (after the thread starts) only by the waiter.
    WorkerRing worker(ring->segment());
    worker.worker_started(0, current_tid());
    uint32_t s = 0;
    ck.require(ring->pop_free_slot(&s), "pop_free_slot");
    const char task[8] = {};
    ring->assign(s, 1, 0, task, sizeof task);
    TaskRef t{};
    // Taken off the queue (WRITING, never committed): the worker finds an
    // empty queue and main's slot never becomes READY.
    ck.require(worker.next_task(0, &t) == WaitResult::Ready, "next_task(queued)");
    std::atomic<int64_t> started{0};
    WaitResult r = WaitResult::Ready;
    int64_t el = 0;
    std::thread waiter([&] {
      const int64_t a = monotonic_ns();
      started.store(a);
      r = main_side ? ring->wait_ready(s, 1, timeout) : worker.next_task(timeout, &t);
      el = monotonic_ns() - a;
    });
    int64_t a = 0;
    while ((a = started.load()) == 0) std::this_thread::yield();  // don't hold the waiter's CPU
    const int64_t reach = reach_ns[main_side ? 1 : 0];
    const int64_t shoot = a + reach / 2 + static_cast<int64_t>(rng() % static_cast<uint64_t>(reach));
    while (monotonic_ns() < shoot) {
    }
    ring->shutdown();
    waiter.join();
    worst = std::max(worst, el);
    if (!ck.check(r == WaitResult::Shutdown && el < timeout / 2,
                  "trial %u: %s returned %s %.1f ms after it started, though shutdown() came "
                  "within microseconds (lost wake-up)",
                  i, main_side ? "wait_ready" : "next_task", wait_name(r), ms(el)))
      ++lost;
  }
  ck.require(lost == 0, "%u of %u shutdown() races lost a wake-up", lost, o.shutdown_trials);
  std::printf("  shutdown race: %u trials in %.0f ms (waits reach futex_wait in ~%.1f/%.1f us), "
              "slowest wake-up %.2f ms\n",
              o.shutdown_trials, ms(monotonic_ns() - t_start), reach_ns[0] / 1e3,
              reach_ns[1] / 1e3, ms(worst));
}

// ---- reclaim, reset_worker and late commits ---------------------------------

// The cases one by one, on a quiet ring: a commit of a lap main reclaimed is
// refused whatever the slot became since (queued again, taken again under a
// new lap, READY under a new lap); a stale queue entry of a reclaimed task is
// skipped; reset_worker() retires a worker still running (its next_task
// answers Shutdown, even from a sleep) while a replacement serves the queue;
// a second commit is a logic error. Each WorkerRing plays one worker process
// of worker 0: those main gave up on hold the laps it took back from them.
void late_commit_test(const Options& o, Checker& ck) {
  using fastload::CommitResult;
  using fastload::ReclaimResult;
  const int64_t slack = o.timing_slack_ms * kMs;
  std::shared_ptr<MainRing> ring = MainRing::create(2, 1, 4096);
  const RingSegment& seg = *ring->segment();
  const char task[8] = {'t', 'a', 's', 'k', 0, 0, 0, 0};
  auto started = [&](uint32_t pid) {
    auto w = std::make_unique<WorkerRing>(ring->segment());
    w->worker_started(0, pid);
    return w;
  };
  uint32_t s = 0;
  TaskRef t{};
  ck.require(ring->pop_free_slot(&s), "pop_free_slot");

  // Three workers each take the slot's task and lose it to reclaim(): each
  // holds an older lap of the slot than the next.
  std::unique_ptr<WorkerRing> stale_queued = started(1);
  ring->assign(s, 10, 0, task, sizeof task);
  ck.require(stale_queued->next_task(0, &t) == WaitResult::Ready && t.seq == 10,
             "next_task(seq 10)");
  const uint64_t lap10 = t.lap;
  ck.require(ring->reclaim(s) == ReclaimResult::WasTaken, "reclaim of a WRITING slot");
  ck.require(seg.state(s) == SlotState::Free && ring->free_slot_count() == 1,
             "a reclaimed slot is FREE and off the free bitmap");
  ck.require(ring->reclaim(s) == ReclaimResult::NotInFlight, "reclaim of a FREE slot");
  ring->assign(s, 11, 0, task, sizeof task);
  ck.require(seg.lap(s) == lap10 + 1, "assign() bumps the lap");
  std::unique_ptr<WorkerRing> stale_writing = started(2);
  ck.require(stale_writing->next_task(0, &t) == WaitResult::Ready && t.seq == 11 && t.slot == s,
             "next_task(seq 11)");
  ck.require(ring->reclaim(s) == ReclaimResult::WasTaken, "reclaim(seq 11)");
  ring->assign(s, 12, 0, task, sizeof task);
  std::unique_ptr<WorkerRing> stale_ready = started(3);
  ck.require(stale_ready->next_task(0, &t) == WaitResult::Ready && t.seq == 12 && t.slot == s,
             "next_task(seq 12)");
  ck.require(ring->reclaim(s) == ReclaimResult::WasTaken, "reclaim(seq 12)");
  // Reassigned (a new lap) but not taken yet: the late commit is refused.
  ring->assign(s, 13, 0, task, sizeof task);
  ck.require(stale_queued->commit(s, SlotResult{1, 0, 0, 0}) == CommitResult::Reclaimed,
             "late commit into a reassigned, queued slot was accepted");
  ck.require(seg.state(s) == SlotState::Assigned, "a refused commit changed the slot");
  // Taken by a worker under the new lap: still refused.
  std::unique_ptr<WorkerRing> current = started(4);
  ck.require(current->next_task(0, &t) == WaitResult::Ready && t.seq == 13 && t.slot == s,
             "next_task(seq 13)");
  ck.require(stale_writing->commit(s, SlotResult{1, 0, 0, 0}) == CommitResult::Reclaimed,
             "late commit into a reassigned WRITING slot was accepted");
  ck.require(seg.state(s) == SlotState::Writing && !ring->is_ready(s, 11) && !ring->is_ready(s, 13),
             "a refused commit made the slot look ready");
  ck.require(current->commit(s, SlotResult{2, 0, 0, 0}) == CommitResult::Committed,
             "commit(seq 13)");
  ck.require(ring->wait_ready(s, 13, 0) == WaitResult::Ready && ring->result(s).kind == 2,
             "the new lap's result");
  bool threw = false;
  try {
    current->commit(s, SlotResult{3, 0, 0, 0});
  } catch (const std::logic_error&) {
    threw = true;
  }
  ck.require(threw && ring->result(s).kind == 2, "a second commit() is a logic error");
  ck.require(stale_ready->commit(s, SlotResult{1, 0, 0, 0}) == CommitResult::Reclaimed &&
                 ring->result(s).kind == 2,
             "late commit into a READY slot of a later lap");
  ring->release(s);

  // A queued task reclaimed: its entry stays in the queue and is skipped.
  ck.require(ring->pop_free_slot(&s), "pop_free_slot");
  ring->assign(s, 20, 0, task, sizeof task);
  ck.require(ring->reclaim(s) == ReclaimResult::WasQueued, "reclaim of an ASSIGNED slot");
  ring->assign(s, 21, 0, task, sizeof task);
  ck.require(current->next_task(0, &t) == WaitResult::Ready && t.seq == 21,
             "the stale entry of seq 20 was not skipped (got seq %" PRIu64 ")", t.seq);
  TaskRef none{};
  ck.require(current->next_task(0, &none) == WaitResult::TimedOut, "queue not empty");
  ck.require(current->commit(s, SlotResult{4, 0, 0, 0}) == CommitResult::Committed, "commit(21)");
  ck.require(ring->is_ready(s, 21), "seq 21 ready");
  ring->release(s);

  // reset_worker() while the worker holds a task and later sleeps.
  ck.require(ring->pop_free_slot(&s), "pop_free_slot");
  ring->assign(s, 22, 0, task, sizeof task);
  ck.require(current->next_task(0, &t) == WaitResult::Ready && t.seq == 22, "next_task(seq 22)");
  ck.require(ring->reclaim(s) == ReclaimResult::WasTaken, "reclaim(seq 22)");
  ring->reset_worker(0);
  ck.require(ring->worker_pid(0) == 0 && ring->worker_current_seq(0) == fastload::kNoSeq,
             "reset_worker() clears pid and current seq");
  int64_t t0 = monotonic_ns();
  ck.require(current->next_task(1000 * kMs, &none) == WaitResult::Shutdown &&
                 monotonic_ns() - t0 < slack && !ring->is_shutdown(),
             "a retired worker's next_task does not answer Shutdown at once");
  ck.require(current->commit(s, SlotResult{5, 0, 0, 0}) == CommitResult::Reclaimed,
             "a retired worker's commit was accepted");
  // A replacement asleep with an "infinite" timeout: reset_worker wakes it.
  std::unique_ptr<WorkerRing> replacement = started(5);
  WaitResult r_old = WaitResult::Ready;
  int64_t el_old = 0;
  std::thread sleeper([&] {
    const int64_t a = monotonic_ns();
    TaskRef tt{};
    r_old = replacement->next_task(INT64_MAX, &tt);
    el_old = monotonic_ns() - a;
  });
  sleep_us(30 * 1000);
  ring->reset_worker(0);
  sleeper.join();
  ck.require(r_old == WaitResult::Shutdown && el_old <= 30 * kMs + slack,
             "reset_worker() woke a sleeping worker after %.1f ms with %s", ms(el_old),
             wait_name(r_old));
  std::unique_ptr<WorkerRing> third = started(6);
  ring->assign(s, 23, 0, task, sizeof task);
  ck.require(current->next_task(0, &none) == WaitResult::Shutdown, "old worker still retired");
  ck.require(third->next_task(0, &t) == WaitResult::Ready && t.seq == 23,
             "the replacement gets the next task");
  ck.require(third->commit(s, SlotResult{6, 0, 0, 0}) == CommitResult::Committed, "commit(23)");
  ck.require(ring->wait_ready(s, 23, 0) == WaitResult::Ready, "seq 23 ready");
  ring->release(s);
  ck.require(ring->free_slot_count() == 2, "every slot free at the end");
  std::printf("  late commit: refused after reclaim (queued, reassigned, taken, ready), stale "
              "entries skipped, reset_worker retires: ok\n");
}

// reclaim() and reset_worker() racing with running workers. Worker threads
// (one shared mapping, so TSan sees both sides) make tasks with random
// delays; main keeps every slot busy, reclaims random tasks in flight and
// now and then gives up on a whole worker (reclaims its tasks, resets its
// queue and starts a replacement) while the old thread still runs: it must
// retire, and each of its late commits must be refused. As Python does
// with a real corpse, a slot taken back from a worker is reused only once
// that worker is done with it (here: it says so; there: it is dead). Every
// item must be delivered exactly once with its own payload, and every
// reclaimed-from-a-worker lap must show one refused commit.
void reclaim_race_test(const Options& o, Checker& ck) {
  using fastload::CommitResult;
  using fastload::ReclaimResult;
  const uint32_t W = o.workers;
  const uint32_t S = std::max<uint32_t>(o.slots, 2);
  const uint64_t N = o.reclaim_items;
  const uint64_t slot_bytes = std::min<uint64_t>(o.slot_bytes, 16384);
  std::shared_ptr<MainRing> ring = MainRing::create(S, W, slot_bytes);
  const RingSegment& seg = *ring->segment();
  const uint64_t max_size = seg.slot_bytes() - 128;
  std::unique_ptr<std::atomic<uint64_t>[]> done_lap(new std::atomic<uint64_t>[S]);
  for (uint32_t i = 0; i < S; ++i) done_lap[i].store(~0ULL);
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> worker_failures{0};

  using Thread = fastload_stress::WorkerThread;  // ended: 0 running, 1 retired, 2 shutdown, 3 failed
  auto worker_fn = [&](uint32_t w, uint64_t wseed, std::shared_ptr<std::atomic<int>> ended) {
    Checker wk("reclaim worker " + std::to_string(w));
    std::mt19937_64 rng(wseed);
    WorkerRing me(ring->segment());
    me.worker_started(w, current_tid());
    for (;;) {
      TaskRef t{};
      const WaitResult r = me.next_task(50 * kMs, &t);
      if (r == WaitResult::Shutdown) {
        ended->store(seg.is_shutdown() ? 2 : 1);
        break;
      }
      if (r == WaitResult::TimedOut) continue;
      char* p = seg.payload(t.slot);
      Task task{};
      std::memcpy(&task, p, sizeof task);
      if (!wk.check(t.task_len == sizeof task && task.magic == kTaskMagic &&
                        task.check == task_check(task) && task.seq == t.seq && task.worker == w,
                    "seq %" PRIu64 ": corrupt task in slot %u", t.seq, t.slot))
        worker_failures.fetch_add(1);
      if (rng() % 100 < 30) sleep_us(rng() % 200);
      const uint64_t size = std::min<uint64_t>(task.size, max_size);
      write_result(p, size, t.seq, task.seed, w);
      if (rng() % 100 < 10) sleep_us(rng() % 100);
      const CommitResult cr = me.commit(
          t.slot, SlotResult{result_kind(t.seq, w), size, meta_offset_for(size), sizeof(ResultMeta)});
      if (cr == CommitResult::Reclaimed) {
        refused.fetch_add(1);
        fastload::sync::store_release(done_lap[t.slot], t.lap);  // test-side hand-back
      }
    }
  };
  std::vector<Thread> live(W);
  std::vector<Thread> retired;
  auto start = [&](uint32_t w, uint64_t k) {
    live[w].ended = std::make_shared<std::atomic<int>>(0);
    live[w].th = std::thread(worker_fn, w, mix64(o.seed ^ (k * 977 + w)), live[w].ended);
    const int64_t deadline = monotonic_ns() + o.long_timeout_ms * kMs;
    while (ring->worker_pid(w) == 0 && monotonic_ns() < deadline) sleep_us(100);
  };
  fastload_stress::WorkerJoiner joiner{*ring, live, retired};
  for (uint32_t w = 0; w < W; ++w) start(w, 0);

  struct Flight {
    uint32_t slot;
    uint64_t item;
    uint32_t worker;
    Task task;
  };
  std::mt19937_64 rng(mix64(o.seed ^ 0xc1a1));
  std::deque<uint64_t> pending;
  for (uint64_t i = 0; i < N; ++i) pending.push_back(i);
  std::vector<uint8_t> delivered(N, 0);
  std::vector<std::pair<uint64_t, Flight>> flight;  // (seq, task)
  fastload_stress::Quarantine quarantine;  // (slot, lap) a worker may still touch
  uint64_t next_seq = 0, got = 0, reclaimed_queued = 0, reclaimed_taken = 0, lost_race = 0;
  uint64_t replaced = 0;
  const uint64_t replace_every = o.replacements > 0 ? std::max<uint64_t>(N / (o.replacements + 1), 1) : 0;
  uint64_t next_replace = replace_every;
  const int64_t t_start = monotonic_ns();

  auto reclaim_one = [&](size_t k) {
    const Flight f = flight[k].second;
    const uint64_t lap = seg.lap(f.slot);
    const ReclaimResult r = ring->reclaim(f.slot);
    if (r == ReclaimResult::NotInFlight) {  // the commit won: it stays in flight, READY
      ++lost_race;
      ck.require(seg.state(f.slot) == SlotState::Ready, "reclaim refused but slot %u is %s",
                 f.slot, state_name(seg.state(f.slot)));
      return false;
    }
    ck.require(seg.state(f.slot) == SlotState::Free, "reclaimed slot %u is %s", f.slot,
               state_name(seg.state(f.slot)));
    if (r == ReclaimResult::WasQueued) {
      ++reclaimed_queued;
      ring->push_free_slot(f.slot);
    } else {
      ++reclaimed_taken;
      quarantine.emplace_back(f.slot, lap);
    }
    pending.push_front(f.item);
    flight[k] = flight.back();
    flight.pop_back();
    return true;
  };

  while (got < N) {
    ck.require(monotonic_ns() - t_start < 120000 * kMs, "reclaim race: no end after 120 s");
    fastload_stress::release_handed_back(*ring, quarantine, done_lap.get());
    uint32_t s = 0;
    while (!pending.empty() && ring->pop_free_slot(&s)) {
      const uint64_t item = pending.front();
      pending.pop_front();
      Flight f{s, item, static_cast<uint32_t>(item % W), Task{}};
      f.task.magic = kTaskMagic;
      f.task.seq = next_seq++;
      f.task.seed = rng();
      f.task.size = rng() % 4 == 0 ? max_size : rng() % 2048;
      f.task.worker = f.worker;
      f.task.check = task_check(f.task);
      ring->assign(s, f.task.seq, f.worker, &f.task, sizeof f.task);
      flight.emplace_back(f.task.seq, f);
    }
    if (!flight.empty() && rng() % 100 < o.reclaim_pct) {
      reclaim_one(rng() % flight.size());
      continue;
    }
    if (replace_every > 0 && got >= next_replace && replaced < o.replacements) {
      next_replace += replace_every;
      const uint32_t w = static_cast<uint32_t>(rng() % W);
      for (size_t k = flight.size(); k-- > 0;)
        if (flight[k].second.worker == w) reclaim_one(k);
      ring->reset_worker(w);
      retired.push_back(std::move(live[w]));  // still running: it must retire by itself
      start(w, ++replaced);
      continue;
    }
    if (flight.empty()) {
      sleep_us(100);  // every slot quarantined: wait for the workers to hand them back
      continue;
    }
    std::vector<uint32_t> slots;
    std::vector<uint64_t> seqs;
    for (const auto& e : flight) {
      slots.push_back(e.second.slot);
      seqs.push_back(e.first);
    }
    size_t which = 0;
    const WaitResult r = ring->wait_any(slots.data(), seqs.data(), slots.size(), 20 * kMs, &which);
    if (r == WaitResult::TimedOut) continue;
    ck.require(r == WaitResult::Ready, "wait_any returned %s", wait_name(r));
    const uint64_t seq = flight[which].first;
    const Flight f = flight[which].second;
    const SlotResult res = ring->result(f.slot);
    const uint64_t size = std::min<uint64_t>(f.task.size, max_size);
    ResultMeta m{};
    const char* p = seg.payload(f.slot);
    std::memcpy(&m, p + meta_offset_for(size), sizeof m);
    ck.require(res.kind == result_kind(seq, f.worker) && res.data_len == size && m.seq == seq &&
                   m.check == meta_check(m) &&
                   find_pattern_mismatch(p, size, pattern_seed(seq, f.task.seed)) == size,
               "seq %" PRIu64 " (item %" PRIu64 ", slot %u): wrong result: a late commit landed?",
               seq, f.item, f.slot);
    ck.require(delivered[f.item] == 0, "item %" PRIu64 " delivered twice", f.item);
    delivered[f.item] = 1;
    ++got;
    ring->release(f.slot);
    flight[which] = flight.back();
    flight.pop_back();
  }
  // Retired threads leave on their own (no shutdown yet).
  for (Thread& t : retired) {
    const int64_t deadline = monotonic_ns() + o.long_timeout_ms * kMs;
    while (t.ended->load() == 0 && monotonic_ns() < deadline) sleep_us(500);
    ck.require(t.ended->load() == 1, "a retired worker did not leave by itself (state %d)",
               t.ended->load());
    t.th.join();
  }
  const int64_t deadline = monotonic_ns() + o.long_timeout_ms * kMs;
  while (!quarantine.empty() && monotonic_ns() < deadline) {
    if (fastload::sync::load_acquire(done_lap[quarantine.back().first]) == quarantine.back().second) {
      ring->push_free_slot(quarantine.back().first);
      quarantine.pop_back();
    } else {
      sleep_us(200);
    }
  }
  ck.require(quarantine.empty(), "%zu reclaimed slots never handed back", quarantine.size());
  ring->shutdown();
  for (Thread& t : live) {
    t.th.join();
    ck.require(t.ended->load() == 2, "a live worker ended with state %d", t.ended->load());
  }
  ck.require(worker_failures.load() == 0, "%" PRIu64 " worker checks failed", worker_failures.load());
  ck.require(refused.load() == reclaimed_taken,
             "%" PRIu64 " commits refused for %" PRIu64 " tasks reclaimed from a worker",
             refused.load(), reclaimed_taken);
  ck.require(ring->free_slot_count() == S, "%zu of %u slots free at the end",
             ring->free_slot_count(), S);
  for (uint32_t i = 0; i < S; ++i)
    ck.require(seg.state(i) == SlotState::Free, "slot %u is %s at the end", i,
               state_name(seg.state(i)));
  std::printf("  reclaim race: %" PRIu64 " items in %.0f ms, reclaimed %" PRIu64 " queued + %" PRIu64
              " taken (%" PRIu64 " late commits refused), %" PRIu64 " lost to the commit, %" PRIu64
              " workers replaced while running\n",
              N, ms(monotonic_ns() - t_start), reclaimed_queued, reclaimed_taken, refused.load(),
              lost_race, replaced);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("ring_stress: items %" PRIu64 ", workers %u, slots %u, slot_bytes %" PRIu64
              ", seed %" PRIu64 ", mode %s\n",
              o.items, o.workers, o.slots, o.slot_bytes, o.seed, o.mode.c_str());
  Checker ck("main");
  uint64_t worker_passed = 0;
  uint64_t worker_failed = 0;
  const int64_t start = monotonic_ns();
  try {
    if (o.timing) {
      ck.set_who("main: timing");
      timing_test(o, ck);
    }
    if (o.shutdown_trials > 0) {
      ck.set_who("main: shutdown race");
      shutdown_race_test(o, ck);
    }
    ck.set_who("main: late commit");
    late_commit_test(o, ck);
    if (o.reclaim_items > 0) {
      ck.set_who("main: reclaim race");
      reclaim_race_test(o, ck);
    }
    // Threads first would leave a multi-threaded parent to fork(); they are
    // joined by then, but processes first keeps TSan's fork support simple.
    if (o.mode == "process" || o.mode == "both") {
      ck.set_who("main: process mode");
      std::printf("process mode (%u forked workers, WorkerRing::attach(dup(fd))):\n", o.workers);
      const int64_t t0 = monotonic_ns();
      ModeResult r = run_process_mode(o, ck);
      worker_passed += r.worker_passed;
      worker_failed += r.worker_failed;
      std::printf("  process mode: %.0f ms\n", ms(monotonic_ns() - t0));
    }
    if (o.mode == "thread" || o.mode == "both") {
      ck.set_who("main: thread mode");
      std::printf("thread mode (%u worker threads, %s):\n", o.workers,
                  o.thread_attach ? "one mapping each" : "one shared mapping");
      const int64_t t0 = monotonic_ns();
      ModeResult r = run_thread_mode(o, ck);
      worker_passed += r.worker_passed;
      worker_failed += r.worker_failed;
      std::printf("  thread mode: %.0f ms\n", ms(monotonic_ns() - t0));
    }
  } catch (const Failure&) {
    // Already reported; RAII has killed/joined the workers.
  } catch (const std::exception& e) {
    ck.check(false, "exception: %s", e.what());
  }
  const uint64_t passed = ck.passed() + worker_passed;
  const uint64_t failed = ck.failed() + worker_failed;
  std::printf("ring_stress: %s in %.1f s\n", failed == 0 ? "OK" : "FAILED",
              ms(monotonic_ns() - start) / 1000.0);
  std::printf("%" PRIu64 " passed, %" PRIu64 " failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
