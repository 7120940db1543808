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

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline std::string str(uint64_t v) { return std::to_string(v); }

inline bool in_flight(SlotState st) {
  return st == SlotState::Assigned || st == SlotState::Writing || st == SlotState::Committing;
}

}  // namespace detail
}  // namespace fastload
