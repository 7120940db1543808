// fastload/src/ring_worker.h — one worker's side of the ring: its cursor on
// the submission queue main fills for it (next_task), and its commits into
// the slots and onto the completion queue. A worker process builds one; the
// main process uses MainRing (ring_main.h). The protocol is described in
// ring.h.
#pragma once

#include <cstdint>
#include <memory>

#include "ring.h"
#include "ring_segment.h"

namespace fastload {

// One object serves one worker, driven by one thread at a time (a worker's
// task loop): its state is plain, unsynchronised memory. Its life:
// worker_started() once, then next_task() and, for each task taken,
// commit(slot) of its result.
class WorkerRing {
 public:
  // A worker process: maps the segment behind `fd` (takes ownership) and
  // validates the whole header (RingSegment::attach).
  static std::shared_ptr<WorkerRing> attach(int fd);
  // A worker side over a mapping this process already has: the tests' worker
  // threads, which share main's mapping so that ThreadSanitizer sees both
  // sides of every hand-over (it cannot relate two mappings of one page).
  explicit WorkerRing(std::shared_ptr<RingSegment> seg);

  WorkerRing(const WorkerRing&) = delete;
  WorkerRing& operator=(const WorkerRing&) = delete;

  // The mapping: geometry, payloads, debug views.
  const std::shared_ptr<RingSegment>& segment() const { return seg_; }

  // Announces worker `worker` (its pid, for main's watchdog) and binds this
  // object to it under the queue's current generation: once main resets the
  // worker (reset_worker), this object is retired. Throws std::logic_error
  // when called twice (one worker per object).
  void worker_started(uint32_t worker, uint32_t pid);
  // Takes the next task off this worker's queue (ASSIGNED -> WRITING, by CAS
  // on its lap: a stale entry of a reclaimed slot is skipped), spinning
  // briefly, then sleeping on the queue's doorbell. Shutdown on the ring's
  // shutdown and also when main retired this worker (reset_worker) since
  // worker_started(). Throws std::logic_error before worker_started().
  WaitResult next_task(int64_t timeout_ns, TaskRef* out);
  // WRITING -> COMMITTING -> READY with the result fields, if `slot` is still
  // on the lap this object took it under; then pushes it on the completion
  // queue and wakes main if it sleeps. Reclaimed: main took the slot back
  // first (it believed this worker dead); nothing was written to the slot's
  // header. Throws std::logic_error for a slot this object did not take with
  // next_task(), or took and committed already.
  CommitResult commit(uint32_t slot, const SlotResult& r);

 private:
  enum class PopResult { Popped, Empty, Retired };
  PopResult try_pop(TaskRef* out);

  std::shared_ptr<RingSegment> seg_;
  ShmHeader* const hdr_;  // seg_'s header, named for brevity
  // Set by worker_started(): the worker this object serves (kNoWorker
  // before) and the queue generation it started under.
  uint32_t worker_;
  uint32_t generation_ = 0;
  // taken_lap_[slot]: the lap under which this object took `slot` and has
  // not committed it yet (kNoLap: none), so that commit(slot) names its lap.
  std::unique_ptr<uint64_t[]> taken_lap_;
};

}  // namespace fastload
