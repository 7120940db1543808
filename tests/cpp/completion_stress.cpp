// fastload/tests/cpp/completion_stress.cpp — the ring's completion queue and
// its death watch, with no Python involved.
//
//   many producers  worker threads commit into many slots while main takes
//                   results with wait_any() alone; with --reclaim-pct, main
//                   also reclaims tasks at random and replaces workers
//                   (reset_worker) under them, so entries of reclaimed and
//                   reassigned slots go stale in the queue. Every item must
//                   arrive exactly once, with its own payload. Without
//                   reclaims, main must never have had to rescan the slots:
//                   the queue alone told it of every completion.
//   faults          a producer that took a queue position and died before
//                   writing it (a hole), one that died between READY and its
//                   push (found by the rescan a death triggers, or by the
//                   periodic one), a main that did not look at the queue for
//                   more than its capacity (entries overwritten), a stale
//                   entry of a slot assigned again.
//   death watch     a watched child's SIGKILL wakes a wait with a long
//                   timeout, which answers WorkerDied until the worker is
//                   unwatched or replaced.
//
// Last line: "<passed> passed, <failed> failed"; exit status 0 only when
// nothing failed (.ci/sanitize runs it plain and under ASan and TSan).
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ring.h"
#include "ring_main.h"
#include "ring_segment.h"
#include "ring_worker.h"
#include "stress_support.h"

namespace {

using fastload::CommitResult;
using fastload::MainRing;
using fastload::ReclaimResult;
using fastload::RingSegment;
using fastload::ShmCompletions;
using fastload::ShmHeader;
using fastload::ShmSlot;
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
constexpr uint64_t kMagic = 0x51434c4446ULL;

struct Options {
  uint32_t workers = 16;
  uint32_t slots = 256;
  uint64_t items = 40000;
  uint32_t reclaim_pct = 0;
  uint32_t replacements = 0;
  uint64_t seed = 1;
  bool faults = true;
};

[[noreturn]] void usage(const char* argv0, const char* why) {
  if (why != nullptr) std::fprintf(stderr, "%s: %s\n", argv0, why);
  std::fprintf(stderr,
               "usage: %s [--workers N] [--slots N] [--items N] [--reclaim-pct P]\n"
               "          [--replacements N] [--seed N] [--no-faults]\n",
               argv0);
  std::exit(2);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto u64 = [&]() -> uint64_t {
      if (i + 1 >= argc) usage(argv[0], ("missing value for " + a).c_str());
      char* end = nullptr;
      const uint64_t v = std::strtoull(argv[++i], &end, 10);
      if (end == nullptr || *end != '\0') usage(argv[0], ("bad value for " + a).c_str());
      return v;
    };
    if (a == "--workers") o.workers = static_cast<uint32_t>(u64());
    else if (a == "--slots") o.slots = static_cast<uint32_t>(u64());
    else if (a == "--items") o.items = u64();
    else if (a == "--reclaim-pct") o.reclaim_pct = static_cast<uint32_t>(std::min<uint64_t>(u64(), 100));
    else if (a == "--replacements") o.replacements = static_cast<uint32_t>(u64());
    else if (a == "--seed") o.seed = u64();
    else if (a == "--no-faults") o.faults = false;
    else usage(argv[0], ("unknown argument " + a).c_str());
  }
  if (o.workers == 0 || o.workers > fastload::kMaxWorkers) usage(argv[0], "bad --workers");
  if (o.slots < 2 || o.slots > fastload::kMaxSlots) usage(argv[0], "bad --slots");
  return o;
}

uint32_t kind_of(uint64_t seq) { return static_cast<uint32_t>(seq & 0xffff); }

// The shared structs of `ring`, for the fault tests, which play a worker
// that dies at the worst moment by writing the shared memory by hand.
struct Raw {
  ShmHeader* hdr;
  ShmCompletions* cq;
  ShmSlot* slots;
};
Raw raw_of(const MainRing& ring) {
  const RingSegment& seg = *ring.segment();
  return Raw{&seg.header(), &seg.completions(), &seg.slot(0)};
}

// Task bytes: the seq; result: (seq, seq ^ magic) right after them.
void assign_item(MainRing& ring, uint32_t slot, uint64_t seq, uint32_t worker) {
  ring.assign(slot, seq, worker, &seq, sizeof seq);
}
SlotResult write_result(const RingSegment& seg, const TaskRef& t) {
  const uint64_t out[2] = {t.seq, t.seq ^ kMagic};
  std::memcpy(seg.payload(t.slot) + 16, out, sizeof out);
  return SlotResult{kind_of(t.seq), 32, 16, 16};
}
bool result_ok(MainRing& ring, uint32_t slot, uint64_t seq) {
  const RingSegment& seg = *ring.segment();
  uint64_t task = 0, out[2] = {0, 0};
  std::memcpy(&task, seg.payload(slot), sizeof task);
  std::memcpy(out, seg.payload(slot) + 16, sizeof out);
  const SlotResult r = ring.result(slot);
  return task == seq && out[0] == seq && out[1] == (seq ^ kMagic) && r.kind == kind_of(seq) &&
         r.data_len == 32;
}

// ---- many producers -------------------------------------------------------

void many_producers_test(const Options& o, Checker& ck) {
  const uint32_t W = o.workers, S = o.slots;
  const uint64_t N = o.items;
  std::shared_ptr<MainRing> ring = MainRing::create(S, W, 4096);
  const RingSegment& seg = *ring->segment();
  std::unique_ptr<std::atomic<uint64_t>[]> done_lap(new std::atomic<uint64_t>[S]);
  for (uint32_t i = 0; i < S; ++i) done_lap[i].store(~0ULL);
  std::atomic<uint64_t> refused{0};

  using Thread = fastload_stress::WorkerThread;  // ended: 0 running, 1 retired, 2 shutdown
  auto worker_fn = [&](uint32_t w, uint64_t wseed, std::shared_ptr<std::atomic<int>> ended) {
    std::mt19937_64 rng(wseed);
    WorkerRing me(ring->segment());
    me.worker_started(w, current_tid());
    for (;;) {
      TaskRef t{};
      const WaitResult r = me.next_task(50 * kMs, &t);
      if (r == WaitResult::Shutdown) {
        ended->store(seg.is_shutdown() ? 2 : 1);
        return;
      }
      if (r == WaitResult::TimedOut) continue;
      uint64_t task = 0;
      std::memcpy(&task, seg.payload(t.slot), sizeof task);
      ck.check(task == t.seq, "worker %u: slot %u holds task %" PRIu64 ", popped %" PRIu64, w,
               t.slot, task, t.seq);
      if (rng() % 100 < 5) sleep_us(rng() % 50);
      const SlotResult res = write_result(seg, t);
      if (me.commit(t.slot, res) == CommitResult::Reclaimed) {
        refused.fetch_add(1);
        fastload::sync::store_release(done_lap[t.slot], t.lap);  // the test's hand-back
      }
    }
  };
  std::vector<Thread> live(W), retired;
  auto start = [&](uint32_t w, uint64_t k) {
    live[w].ended = std::make_shared<std::atomic<int>>(0);
    live[w].th = std::thread(worker_fn, w, o.seed * 1000003 + k * 977 + w, live[w].ended);
    while (ring->worker_pid(w) == 0) sleep_us(100);
  };
  fastload_stress::WorkerJoiner joiner{*ring, live, retired};
  for (uint32_t w = 0; w < W; ++w) start(w, 0);

  struct Flight {
    uint64_t seq;
    uint32_t slot;
    uint64_t item;
    uint32_t worker;
  };
  std::mt19937_64 rng(o.seed ^ 0x5eed);
  std::deque<uint64_t> pending;
  for (uint64_t i = 0; i < N; ++i) pending.push_back(i);
  std::vector<uint8_t> delivered(N, 0);
  std::vector<Flight> flight;
  fastload_stress::Quarantine quarantine;  // (slot, lap) a worker may still write
  uint64_t next_seq = 0, got = 0, reclaimed = 0, replaced = 0, timeouts = 0;
  const uint64_t replace_every = o.replacements > 0 ? std::max<uint64_t>(N / (o.replacements + 1), 1) : 0;
  uint64_t next_replace = replace_every;
  const int64_t t0 = monotonic_ns();

  auto reclaim_at = [&](size_t k) {
    const Flight f = flight[k];
    const uint64_t lap = seg.lap(f.slot);
    const ReclaimResult r = ring->reclaim(f.slot);
    if (r == ReclaimResult::NotInFlight) return;  // its commit won: READY, still in flight
    ++reclaimed;
    if (r == ReclaimResult::WasQueued) ring->push_free_slot(f.slot);
    else quarantine.emplace_back(f.slot, lap);
    pending.push_front(f.item);
    flight[k] = flight.back();
    flight.pop_back();
  };

  while (got < N) {
    ck.require(monotonic_ns() - t0 < 120000 * kMs, "many producers: no end after 120 s");
    fastload_stress::release_handed_back(*ring, quarantine, done_lap.get());
    uint32_t s = 0;
    while (!pending.empty() && ring->pop_free_slot(&s)) {
      const uint64_t item = pending.front();
      pending.pop_front();
      const Flight f{next_seq++, s, item, static_cast<uint32_t>(item % W)};
      assign_item(*ring, s, f.seq, f.worker);
      flight.push_back(f);
    }
    if (o.reclaim_pct > 0 && !flight.empty() && rng() % 100 < o.reclaim_pct) {
      reclaim_at(rng() % flight.size());
      continue;
    }
    if (replace_every > 0 && got >= next_replace && replaced < o.replacements) {
      next_replace += replace_every;
      const uint32_t w = static_cast<uint32_t>(rng() % W);
      for (size_t k = flight.size(); k-- > 0;)
        if (flight[k].worker == w) reclaim_at(k);
      ring->reset_worker(w);
      retired.push_back(std::move(live[w]));  // may still run: it retires by itself
      start(w, ++replaced);
      continue;
    }
    if (flight.empty()) {
      sleep_us(100);  // every slot quarantined
      continue;
    }
    std::vector<uint32_t> slots;
    std::vector<uint64_t> seqs;
    for (const Flight& f : flight) {
      slots.push_back(f.slot);
      seqs.push_back(f.seq);
    }
    size_t which = 0;
    // Without reclaims every wait ends with a commit: a long timeout then
    // never expires unless an entry was lost (and found by a rescan).
    const int64_t timeout = o.reclaim_pct > 0 ? 20 * kMs : 30000 * kMs;
    const WaitResult r = ring->wait_any(slots.data(), seqs.data(), slots.size(), timeout, &which);
    if (r == WaitResult::TimedOut) {
      ++timeouts;
      continue;
    }
    ck.require(r == WaitResult::Ready, "wait_any returned %s", wait_name(r));
    const Flight f = flight[which];
    ck.require(seg.state(f.slot) == SlotState::Ready, "wait_any answered slot %u, which is not READY",
               f.slot);
    ck.require(result_ok(*ring, f.slot, f.seq), "seq %" PRIu64 " (slot %u): wrong result", f.seq,
               f.slot);
    ck.require(delivered[f.item] == 0, "item %" PRIu64 " delivered twice", f.item);
    delivered[f.item] = 1;
    ++got;
    ring->release(f.slot);
    flight[which] = flight.back();
    flight.pop_back();
  }
  for (Thread& t : retired) {
    while (t.ended->load() == 0) sleep_us(500);
    ck.require(t.ended->load() == 1, "a retired worker ended with state %d", t.ended->load());
    t.th.join();
  }
  while (!quarantine.empty()) {
    ck.require(monotonic_ns() - t0 < 120000 * kMs, "reclaimed slots never handed back");
    if (fastload::sync::load_acquire(done_lap[quarantine.back().first]) == quarantine.back().second) {
      ring->push_free_slot(quarantine.back().first);
      quarantine.pop_back();
    } else {
      sleep_us(200);
    }
  }
  const uint64_t rescans = ring->rescan_count();
  if (o.reclaim_pct == 0 && o.replacements == 0)
    ck.check(rescans == 0 && timeouts == 0,
             "no worker died and no wait timed out, yet main rescanned the slots %" PRIu64
             " times (%" PRIu64 " timeouts): the queue lost an entry",
             rescans, timeouts);
  ck.check(refused.load() <= reclaimed, "%" PRIu64 " commits refused for %" PRIu64 " reclaims",
           refused.load(), reclaimed);
  ck.check(ring->free_slot_count() == S, "%zu of %u slots free at the end", ring->free_slot_count(), S);
  std::printf("  many producers: %" PRIu64 " items, %u workers, %u slots in %.0f ms; %" PRIu64
              " reclaimed, %" PRIu64 " workers replaced, %" PRIu64 " rescans, %" PRIu64 " timeouts\n",
              N, W, S, static_cast<double>(monotonic_ns() - t0) / 1e6, reclaimed, replaced, rescans,
              timeouts);
}

// ---- faults ------------------------------------------------------------------

// Worker `w`'s side over main's mapping, started on this thread (the fault
// tests play main and its workers on one thread).
std::unique_ptr<WorkerRing> started_worker(const MainRing& ring, uint32_t w) {
  auto worker = std::make_unique<WorkerRing>(ring.segment());
  worker->worker_started(w, current_tid());
  return worker;
}

// One item through the ring on this thread (main and worker 0): assign, pop,
// commit, then wait for it. Returns what wait_any said.
WaitResult one_item(MainRing& ring, WorkerRing& worker, uint32_t slot, uint64_t seq,
                    int64_t timeout_ns) {
  assign_item(ring, slot, seq, 0);
  TaskRef t{};
  if (worker.next_task(0, &t) != WaitResult::Ready || t.slot != slot) return WaitResult::Shutdown;
  worker.commit(t.slot, write_result(*ring.segment(), t));
  return ring.wait_ready(slot, seq, timeout_ns);
}

// A producer took a position and died before writing it.
void hole_test(Checker& ck) {
  std::shared_ptr<MainRing> ring = MainRing::create(4, 1, 4096);
  std::unique_ptr<WorkerRing> worker = started_worker(*ring, 0);
  const Raw raw = raw_of(*ring);
  uint64_t seq = 0;
  uint32_t s = 0;
  ck.require(ring->pop_free_slot(&s), "no free slot");
  ck.require(one_item(*ring, *worker, s, seq++, 30000 * kMs) == WaitResult::Ready, "first item not ready");
  ring->release(s);
  fastload::sync::take_ticket(raw.cq->tail);  // the hole
  // Later entries are taken past the hole, without a rescan...
  for (int i = 0; i < 100; ++i) {
    ck.require(ring->pop_free_slot(&s), "no free slot");
    ck.require(one_item(*ring, *worker, s, seq++, 30000 * kMs) == WaitResult::Ready,
               "an item after a hole was not found");
    ring->release(s);
  }
  ck.check(ring->rescan_count() == 0, "a hole cost %" PRIu64 " rescans before the queue wrapped",
           ring->rescan_count());
  // ...and once the queue has wrapped past it, it is given up (one rescan).
  for (uint32_t i = 0; i < fastload::kCompletionCapacity + 100; ++i) {
    ck.require(ring->pop_free_slot(&s), "no free slot");
    const WaitResult r = one_item(*ring, *worker, s, seq, 30000 * kMs);
    ck.require(r == WaitResult::Ready, "item %" PRIu64 " (the queue wrapping past a hole): %s", seq,
               wait_name(r));
    ++seq;
    ring->release(s);
  }
  ck.check(ring->rescan_count() == 1, "giving up a hole took %" PRIu64 " rescans, not 1",
           ring->rescan_count());
  std::printf("  hole: %" PRIu64 " items past a never-written position, %" PRIu64 " rescan\n", seq,
              ring->rescan_count());
}

// A worker died between its READY and its push: the slot is READY, the queue
// says nothing. The death of a watched worker triggers a rescan.
void missing_push_test(Checker& ck) {
  std::shared_ptr<MainRing> ring = MainRing::create(4, 2, 4096);
  std::unique_ptr<WorkerRing> worker0 = started_worker(*ring, 0);
  std::unique_ptr<WorkerRing> worker1 = started_worker(*ring, 1);
  const Raw raw = raw_of(*ring);
  // Worker 1 takes the task, then plays its own commit by hand, leaving out
  // the push.
  auto commit_without_push = [&](uint32_t slot, uint64_t seq) {
    assign_item(*ring, slot, seq, 1);
    TaskRef t{};
    ck.require(worker1->next_task(0, &t) == WaitResult::Ready && t.slot == slot, "pop failed");
    const SlotResult r = write_result(*ring->segment(), t);
    ShmSlot& sl = raw.slots[slot];
    uint64_t word = fastload::slot_word(t.lap, SlotState::Writing);
    ck.require(fastload::sync::cas_acq_rel(sl.state, word, fastload::slot_word(t.lap, SlotState::Committing)),
               "WRITING -> COMMITTING failed");
    fastload::sync::store_relaxed(sl.result_kind, r.kind);
    fastload::sync::store_relaxed(sl.data_len, r.data_len);
    fastload::sync::store_relaxed(sl.meta_offset, r.meta_offset);
    fastload::sync::store_relaxed(sl.meta_len, r.meta_len);
    word = fastload::slot_word(t.lap, SlotState::Committing);
    ck.require(fastload::sync::cas_acq_rel(sl.state, word, fastload::slot_word(t.lap, SlotState::Ready)),
               "COMMITTING -> READY failed");
  };
  uint32_t a = 0, b = 0;
  ck.require(ring->pop_free_slot(&a) && ring->pop_free_slot(&b), "no free slots");

  // Watched through a pipe: closing its write end is the worker's death.
  int p[2];
  ck.require(::pipe(p) == 0, "pipe: %s", std::strerror(errno));
  ring->watch_worker(1, p[0]);
  ::close(p[0]);
  commit_without_push(a, 7);
  std::thread killer([w = p[1]] {
    sleep_us(50000);
    ::close(w);
  });
  const int64_t t0 = monotonic_ns();
  size_t which = 9;
  const WaitResult r1 = ring->wait_any(&a, std::vector<uint64_t>{7}.data(), 1, 60000 * kMs, &which);
  const int64_t waited = monotonic_ns() - t0;
  killer.join();
  ck.check(r1 == WaitResult::Ready && which == 0 && result_ok(*ring, a, 7),
           "a READY slot with no queue entry: wait_any answered %s after its worker died",
           wait_name(r1));
  // Well under the periodic rescan (1 s): the death, not the timer, found it.
  ck.check(waited < 900 * kMs, "found %.0f ms after the death: not woken by it",
           static_cast<double>(waited) / 1e6);
  const std::vector<uint32_t> dead = ring->dead_workers();
  ck.check(dead.size() == 1 && dead[0] == 1, "dead_workers() lists %zu workers", dead.size());
  // Level-triggered: the next wait for something else answers WorkerDied.
  assign_item(*ring, b, 8, 0);
  const uint64_t seq8 = 8;
  ck.check(ring->wait_any(&b, &seq8, 1, 60000 * kMs, &which) == WaitResult::WorkerDied,
           "a wait after a death did not answer WorkerDied");
  ring->unwatch_worker(1);
  ck.check(ring->wait_any(&b, &seq8, 1, 10 * kMs, &which) == WaitResult::TimedOut,
           "an unwatched dead worker still woke the wait");
  ring->release(a);
  TaskRef t{};
  ck.require(worker0->next_task(0, &t) == WaitResult::Ready, "pop failed");
  worker0->commit(t.slot, write_result(*ring->segment(), t));
  ck.check(ring->wait_any(&b, &seq8, 1, 60000 * kMs, &which) == WaitResult::Ready, "item 8 lost");
  ring->release(b);

  // Unwatched: the periodic rescan finds it, well before the timeout.
  ck.require(ring->pop_free_slot(&a), "no free slot");
  commit_without_push(a, 9);
  const uint64_t seq9 = 9;
  ck.check(ring->wait_any(&a, &seq9, 1, 60000 * kMs, &which) == WaitResult::Ready,
           "a READY slot with no entry and no death was not found by the periodic rescan");
  ring->release(a);
  std::printf("  missing push: found %.0f ms after the death\n", static_cast<double>(waited) / 1e6);
}

// Main did not look at the queue for more than its capacity (it took results
// with is_ready()); entries were overwritten, and the gap is noticed.
void overflow_test(Checker& ck) {
  std::shared_ptr<MainRing> ring = MainRing::create(8, 1, 4096);
  std::unique_ptr<WorkerRing> worker = started_worker(*ring, 0);
  uint32_t s = 0;
  uint64_t seq = 0;
  for (uint32_t i = 0; i < fastload::kCompletionCapacity + 500; ++i) {
    ck.require(ring->pop_free_slot(&s), "no free slot");
    assign_item(*ring, s, seq, 0);
    TaskRef t{};
    ck.require(worker->next_task(0, &t) == WaitResult::Ready, "pop failed");
    worker->commit(t.slot, write_result(*ring->segment(), t));
    ck.require(ring->is_ready(s, seq), "not ready after commit");
    ring->release(s);
    ++seq;
  }
  // A slot READY now, its entry among the ones main must not trust blindly.
  uint32_t keep = 0;
  ck.require(ring->pop_free_slot(&keep), "no free slot");
  assign_item(*ring, keep, seq, 0);
  TaskRef t{};
  ck.require(worker->next_task(0, &t) == WaitResult::Ready, "pop failed");
  worker->commit(t.slot, write_result(*ring->segment(), t));
  size_t which = 9;
  ck.check(ring->wait_any(&keep, &seq, 1, 30000 * kMs, &which) == WaitResult::Ready &&
               result_ok(*ring, keep, seq),
           "after the queue overflowed, a READY slot was not found");
  ck.check(ring->rescan_count() >= 1, "an overflowed queue was trusted without a rescan");
  ring->release(keep);
  std::printf("  overflow: %" PRIu64 " completions unread, then found (%" PRIu64 " rescans)\n", seq,
              ring->rescan_count());
}

// An entry whose slot was released and assigned again says nothing about
// the new lap.
void stale_entry_test(Checker& ck) {
  std::shared_ptr<MainRing> ring = MainRing::create(2, 1, 4096);
  std::unique_ptr<WorkerRing> worker = started_worker(*ring, 0);
  uint32_t s = 0;
  ck.require(ring->pop_free_slot(&s), "no free slot");
  assign_item(*ring, s, 1, 0);
  TaskRef t{};
  ck.require(worker->next_task(0, &t) == WaitResult::Ready, "pop failed");
  worker->commit(t.slot, write_result(*ring->segment(), t));
  ck.require(ring->is_ready(s, 1), "not ready");
  ring->release(s);  // its entry is still in the queue, unread
  uint32_t s2 = 0;
  ck.require(ring->pop_free_slot(&s2) && s2 == s, "the slot did not come back");
  assign_item(*ring, s, 2, 0);
  size_t which = 9;
  uint64_t seq = 2;
  ck.check(ring->wait_any(&s, &seq, 1, 0, &which) == WaitResult::TimedOut,
           "a stale entry made a reassigned slot look ready");
  // Same stamp, new lap: still not ready until its own commit.
  seq = 1;
  ck.check(ring->wait_any(&s, &seq, 1, 0, &which) == WaitResult::TimedOut,
           "a stale entry matched its old stamp");
  ck.require(worker->next_task(0, &t) == WaitResult::Ready, "pop failed");
  worker->commit(t.slot, write_result(*ring->segment(), t));
  seq = 2;
  ck.check(ring->wait_any(&s, &seq, 1, 30000 * kMs, &which) == WaitResult::Ready &&
               result_ok(*ring, s, 2),
           "the new lap's result was not found");
  // Asked again without release: still READY, still found at once.
  ck.check(ring->wait_any(&s, &seq, 1, 0, &which) == WaitResult::Ready, "a READY slot asked twice");
  ring->release(s);
}

// ---- death watch ---------------------------------------------------------------

int pidfd_open(pid_t pid) {
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

void death_watch_test(Checker& ck) {
  std::shared_ptr<MainRing> ring = MainRing::create(2, 3, 4096);
  std::vector<pid_t> kids;
  for (int i = 0; i < 2; ++i) {
    const pid_t pid = ::fork();
    ck.require(pid >= 0, "fork: %s", std::strerror(errno));
    if (pid == 0) {
      ::pause();
      ::_exit(0);
    }
    kids.push_back(pid);
  }
  struct Reaper {
    std::vector<pid_t>& kids;
    ~Reaper() {
      for (pid_t p : kids) {
        ::kill(p, SIGKILL);
        ::waitpid(p, nullptr, 0);
      }
    }
  } reaper{kids};
  const int fd0 = pidfd_open(kids[0]), fd1 = pidfd_open(kids[1]);
  if (fd0 < 0 || fd1 < 0) {
    std::printf("  death watch: skipped (pidfd_open: %s)\n", std::strerror(errno));
    return;
  }
  ring->watch_worker(0, fd0);
  ring->watch_worker(1, fd1);
  uint32_t s = 0;
  ck.require(ring->pop_free_slot(&s), "no free slot");
  assign_item(*ring, s, 5, 2);  // worker 2 never comes: nothing will be READY
  const uint64_t seq = 5;
  size_t which = 9;
  ck.check(ring->wait_any(&s, &seq, 1, 20 * kMs, &which) == WaitResult::TimedOut,
           "a wait with two live workers did not time out");
  std::thread killer([pid = kids[1]] {
    sleep_us(50000);
    ::kill(pid, SIGKILL);
  });
  const int64_t t0 = monotonic_ns();
  const WaitResult r = ring->wait_any(&s, &seq, 1, 60000 * kMs, &which);
  const int64_t waited = monotonic_ns() - t0;
  killer.join();
  ck.check(r == WaitResult::WorkerDied, "a SIGKILLed worker: wait_any answered %s", wait_name(r));
  ck.check(waited < 30000 * kMs, "woken only after %.0f ms", static_cast<double>(waited) / 1e6);
  const std::vector<uint32_t> dead = ring->dead_workers();
  ck.check(dead.size() == 1 && dead[0] == 1, "dead_workers() lists %zu workers", dead.size());
  ck.check(ring->wait_any(&s, &seq, 1, 60000 * kMs, &which) == WaitResult::WorkerDied,
           "the death was reported once only");
  ring->watch_worker(1, fd0);  // replaced by a live one
  ck.check(ring->wait_any(&s, &seq, 1, 20 * kMs, &which) == WaitResult::TimedOut,
           "a replaced worker's death still woke the wait");
  ring->unwatch_worker(0);
  ring->unwatch_worker(1);
  ::close(fd0);
  ::close(fd1);
  ring->shutdown();  // joins the watch thread
  ck.check(ring->wait_any(&s, &seq, 1, 60000 * kMs, &which) == WaitResult::Shutdown,
           "no Shutdown after shutdown()");
  std::printf("  death watch: woken %.1f ms after a SIGKILL\n", static_cast<double>(waited) / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_args(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("completion_stress: workers %u, slots %u, items %" PRIu64 ", reclaim %u%%, "
              "replacements %u, seed %" PRIu64 "\n",
              o.workers, o.slots, o.items, o.reclaim_pct, o.replacements, o.seed);
  Checker ck;
  try {
    if (o.faults) {
      // Forks first, while this process has no other thread.
      ck.set_who("death watch");
      death_watch_test(ck);
      ck.set_who("hole");
      hole_test(ck);
      ck.set_who("missing push");
      missing_push_test(ck);
      ck.set_who("overflow");
      overflow_test(ck);
      ck.set_who("stale entry");
      stale_entry_test(ck);
    }
    if (o.items > 0) {
      ck.set_who("many producers");
      many_producers_test(o, ck);
    }
  } catch (const Failure&) {
    // Reported; RAII has joined the threads.
  } catch (const std::exception& e) {
    ck.check(false, "exception: %s", e.what());
  }
  std::printf("%" PRIu64 " passed, %" PRIu64 " failed\n", ck.passed(), ck.failed());
  return ck.failed() == 0 ? 0 : 1;
}
