// fastload/src/ring_detail.h — what the ring's files (ring_segment.cpp, the
// main process's side in ring_main.cpp, the worker's side in ring_worker.cpp)
// share beyond ring.h: the constants of the waits and the ledger words, and
// small helpers. Not part of the ring's interface; included by those files only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ring.h"
#include "sync.h"

namespace fastload {
namespace detail {

// The sync.h operations both sides use, by their short names.
using sync::bump_release;
using sync::cas_acq_rel;
using sync::full_fence;
using sync::load_acquire;
using sync::load_relaxed;
using sync::store_relaxed;
using sync::store_release;
using sync::take_ticket;

constexpr int kSpinChecks = 64;  // brief spin before sleeping (see sync::cpu_relax)
// The longest main sleeps before it rescans the slots, whatever its timeout:
// the safety net for an entry lost in a way no death announced (a worker
// stopped between its READY and its push, then lapped by a whole queue).
constexpr int64_t kRescanEveryNs = 1000000000LL;
constexpr uint32_t kCqMask = kCompletionCapacity - 1;
constexpr uint64_t kNoLap = ~0ULL;
constexpr uint32_t kNoWorker = ~0u;  // a WorkerRing before worker_started()

// The header's `main_waiting` word: (sleepers << 16) | wanted. `wanted` is
// the slot (+ 1) whose commit must wake the sleeper when there is exactly one
// sleeper and it waits for exactly one slot, else kWakeOnAny (every commit
// wakes). kMaxSlots < kWakeOnAny, so a slot + 1 never reads as "any".
constexpr uint32_t kWakeOnAny = 0xffffu;
static_assert(kMaxSlots < kWakeOnAny, "a slot + 1 must fit below kWakeOnAny");

// Whether a commit of slot `s` must wake main, given `main_waiting`.
inline bool main_wants(uint32_t waiting, uint32_t s) {
  const uint32_t wanted = waiting & 0xffffu;
  return (waiting >> 16) != 0 && (wanted == kWakeOnAny || wanted == s + 1);
}

// One sleeper's announcement in `main_waiting`, for the scope of one sleep
// (RAII: every return path withdraws it). Several threads of the main
// process may wait at once: the word then counts them and wakes on any
// commit, which is never wrong, only less frugal.
class MainWaiting {
 public:
  // `want`: the slot + 1 this sleeper waits for, or kWakeOnAny.
  MainWaiting(std::atomic<uint32_t>& word, uint32_t want) : word_(word) {
    uint32_t cur = sync::load_relaxed(word_);
    for (;;) {
      const uint32_t sleepers = cur >> 16;
      const uint32_t next = ((sleepers + 1) << 16) | (sleepers == 0 ? want : kWakeOnAny);
      // A read-modify-write, so concurrent sleepers count each other; the
      // Dekker fence that orders it before the sleeper's look is the caller's.
      if (sync::cas_acq_rel(word_, cur, next)) return;
    }
  }
  ~MainWaiting() {
    uint32_t cur = sync::load_relaxed(word_);
    for (;;) {
      const uint32_t sleepers = (cur >> 16) - 1;
      const uint32_t next = sleepers == 0 ? 0u : (sleepers << 16) | kWakeOnAny;
      if (sync::cas_acq_rel(word_, cur, next)) return;
    }
  }
  MainWaiting(const MainWaiting&) = delete;
  MainWaiting& operator=(const MainWaiting&) = delete;

 private:
  std::atomic<uint32_t>& word_;
};

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline std::string str(uint64_t v) { return std::to_string(v); }

inline bool in_flight(SlotState st) {
  return st == SlotState::Assigned || st == SlotState::Writing || st == SlotState::Committing;
}

}  // namespace detail
}  // namespace fastload
