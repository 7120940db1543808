// fastload/src/ring_main.h — the main process's side of the ring: the free
// slots, assigning tasks, the completion queue's reader and the waits on it,
// leases, reclaims, shutdown and the death watch. Only the process that
// created the ring builds one; workers use WorkerRing (ring_worker.h). The
// protocol is described in ring.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ring.h"
#include "ring_segment.h"
#include "watch.h"

namespace fastload {

class MainRing {
 public:
  // A new segment and the main side over it. Throws std::invalid_argument on
  // bad geometry, std::runtime_error when the memory cannot be had.
  static std::shared_ptr<MainRing> create(uint32_t num_slots, uint32_t num_workers,
                                          uint64_t slot_bytes, bool force_shm = false);

  MainRing(const MainRing&) = delete;
  MainRing& operator=(const MainRing&) = delete;
  ~MainRing();

  // The mapping: geometry, payloads, the fd to hand to workers, debug views.
  const std::shared_ptr<RingSegment>& segment() const { return seg_; }

  // Free slots are a bitmap (process-local) indexing the slots whose state
  // is FREE and that main has not taken: release() sets a bit as it frees a
  // slot, pop_free_slot() clears one, push_free_slot() puts back one that
  // pop_free_slot() gave and that was never assigned. The state word stays
  // the truth: a bit is only ever set for a FREE slot.
  //
  // Takes the lowest free slot (for batches: they keep to the fewest slots)
  // or the highest (`highest`: for tasks that write no batch); false when
  // none is.
  bool pop_free_slot(uint32_t* slot, bool highest = false);
  size_t free_slot_count() const;
  // Puts back a FREE slot taken by pop_free_slot() (or reclaim()) and never
  // assigned. Throws std::logic_error if it is not FREE or already free.
  void push_free_slot(uint32_t slot);
  // Gives the pages of free slot `slot` past its first `keep` bytes (rounded
  // up to a page) back to the kernel, so a slot that once held an outlier
  // batch does not keep its memory. Memfd segments only (the shm fallback
  // reserved its pages on purpose); a slot not on the free bitmap is left
  // alone. Returns the bytes of the range released, 0 when nothing was done.
  size_t trim_free_slot(uint32_t slot, size_t keep);
  // FREE -> ASSIGNED under the next lap, task bytes copied to the payload
  // start, queued for `worker`. The slot must have been taken off the free
  // bitmap (pop_free_slot() or reclaim()).
  void assign(uint32_t slot, uint64_t seq, uint32_t worker, const void* task, size_t task_len);
  // Waits until `slot` is READY with stamp `seq` (wait_any of one).
  WaitResult wait_ready(uint32_t slot, uint64_t seq, int64_t timeout_ns);
  // Waits until any of slots[i] is READY with stamp seqs[i]; *which = i.
  // What completed is learnt from the completion queue, not by reading every
  // slot: entries are taken into a process-local table of slots known READY
  // (checked against the state word, so a stale entry is dropped), and the
  // wanted slots are looked up there. All slots are read again (a rescan)
  // when an entry may be missing: after each new death of a watched worker
  // (it may have died between its READY and its push), when the queue lost
  // entries, once a second while asleep, and before answering TimedOut. So
  // the answer is the one a scan would give. Ready comes before WorkerDied
  // (a dead worker's committed batch is still good), WorkerDied before
  // sleeping. Safe to call from several threads of the main process.
  WaitResult wait_any(const uint32_t* slots, const uint64_t* seqs, size_t n, int64_t timeout_ns,
                      size_t* which);
  // Watches the life of worker `worker` through `fd` (a pidfd, or any fd
  // that becomes readable when the process is gone; duplicated here): its
  // death wakes the waits above, which answer WorkerDied until the worker is
  // unwatched or watched again (a replacement).
  void watch_worker(uint32_t worker, int fd);
  void unwatch_worker(uint32_t worker);
  // Watched workers that died (see DeathWatch::dead()).
  std::vector<uint32_t> dead_workers() const;
  // How many times main read every slot instead of the queue (a debug view:
  // a healthy ring with no deaths and no timed-out waits rescans never).
  uint64_t rescan_count() const;
  bool is_ready(uint32_t slot, uint64_t seq) const;
  SlotResult result(uint32_t slot) const;
  void lease(uint32_t slot);    // READY -> LEASED
  void release(uint32_t slot);  // READY/LEASED -> FREE, back on the free bitmap
  // Sets the shutdown flag, wakes every waiter, stops watching workers.
  void shutdown();
  bool is_shutdown() const { return seg_->is_shutdown(); }
  // After a worker died (or was given up on): empties its queue, bumps its
  // generation so the old worker, should it still run, is retired (its
  // next_task() answers Shutdown and its claims fail), and wakes it.
  void reset_worker(uint32_t worker);
  // ASSIGNED/WRITING/COMMITTING (a dead worker's unfinished task) -> FREE,
  // by CAS, off the free bitmap: main assigns it again at once. A late
  // commit() of the old lap is refused. NotInFlight: the slot was FREE,
  // READY or LEASED (the worker's commit won the race), nothing changed.
  ReclaimResult reclaim(uint32_t slot);
  // What the watchdog reads of a worker: the pid it announced (0 before it
  // joined or after reset_worker()), its progress counter (bumped at every
  // task it takes and every commit), the batch in hand (kNoSeq: none).
  uint32_t worker_pid(uint32_t worker) const;
  uint64_t worker_progress(uint32_t worker) const;
  uint64_t worker_current_seq(uint32_t worker) const;

 private:
  explicit MainRing(std::shared_ptr<RingSegment> seg);
  // wait_any's look: takes new completion entries, rescans if due, and
  // looks the wanted slots up. cq_mu_ held.
  bool find_ready(const uint32_t* slots, const uint64_t* seqs, size_t n, size_t* which);
  void take_completions();  // cq_mu_ held
  void rescan_slots();      // cq_mu_ held
  bool any_dead() const;
  void wake_main();
  void set_free_bit(uint32_t s);  // free_mu_ held

  std::shared_ptr<RingSegment> seg_;
  ShmHeader* const hdr_;  // seg_'s header, named for brevity
  // The free bitmap, bit s of word s/64. Guarded by a mutex because a slot's
  // last view may die on any thread.
  mutable std::mutex free_mu_;
  uint64_t free_bits_[kMaxSlots / 64] = {};
  size_t free_count_ = 0;
  // The consumer side of the completion queue. cq_head_: the oldest
  // position not yet taken; cq_taken_[pos % capacity]: taken out of order
  // while an older position is still unwritten; ready_lap_[slot]: the lap
  // under which the slot was seen READY (kNoLap: none), re-checked against
  // the state word at every use; rescan_due_: an entry may be missing;
  // rescanned_deaths_: deaths counted at the last rescan; rescans_:
  // rescan_count(). All guarded by cq_mu_.
  mutable std::mutex cq_mu_;
  uint32_t cq_head_ = 0;
  std::unique_ptr<bool[]> cq_taken_;
  std::unique_ptr<uint64_t[]> ready_lap_;
  bool rescan_due_ = false;
  uint64_t rescanned_deaths_ = 0;
  uint64_t rescans_ = 0;
  // Declared last: destroyed (its thread joined) before anything its
  // wake-ups (wake_main) touch.
  std::unique_ptr<DeathWatch> watch_;
};

}  // namespace fastload
