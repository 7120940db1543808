// fastload/src/ring_worker.cpp — one worker's side of the ring: take a task
// from its submission queue (spinning briefly, then sleeping on its doorbell),
// and commit the result into the slot and onto the completion queue. The main
// process's side is in ring_main.cpp; the protocol is described in ring.h.

#include "ring_worker.h"

#include <stdexcept>
#include <string>
#include <utility>

#include "ring_detail.h"

namespace fastload {

using namespace detail;  // NOLINT: the helpers shared with ring_main.cpp

WorkerRing::WorkerRing(std::shared_ptr<RingSegment> seg)
    : seg_(std::move(seg)),
      hdr_(&seg_->header()),
      worker_(kNoWorker),
      taken_lap_(new uint64_t[seg_->num_slots()]) {
  for (uint32_t s = 0; s < seg_->num_slots(); ++s) taken_lap_[s] = kNoLap;
}

std::shared_ptr<WorkerRing> WorkerRing::attach(int fd) {
  return std::make_shared<WorkerRing>(RingSegment::attach(fd));
}

void WorkerRing::worker_started(uint32_t w, uint32_t pid) {
  seg_->check_worker(w);
  if (worker_ != kNoWorker)
    throw std::logic_error("fastload: worker_started() twice on one WorkerRing (it serves worker " +
                           str(worker_) + ")");
  ShmWorker& q = seg_->worker(w);
  worker_ = w;
  // The generation main's last reset_worker() left (it bumps it with a
  // release after retiring the queue's previous worker): this object serves
  // that generation until the next reset.
  generation_ = load_acquire(q.generation);
  // Release: main's watchdog reads the pid (acquire) as "this worker joined".
  store_release(q.pid, pid);
}

WorkerRing::PopResult WorkerRing::try_pop(TaskRef* out) {
  ShmWorker& q = seg_->worker(worker_);
  for (;;) {
    if (load_acquire(q.generation) != generation_) return PopResult::Retired;
    uint32_t head = load_acquire(q.head);
    // Acquire pairs with assign()'s tail release: the entry is visible.
    if (load_acquire(q.tail) == head) return PopResult::Empty;
    const uint64_t entry = load_relaxed(q.entries[head & (kMaxSlots - 1)]);
    // Claim the entry. Fails only when reset_worker() moved the head: then
    // the generation check above retires this worker.
    if (!cas_acq_rel(q.head, head, head + 1)) continue;
    const uint32_t s = static_cast<uint32_t>(entry & ((1u << kEntrySlotBits) - 1));
    const uint64_t lap = entry >> kEntrySlotBits;
    if (s >= hdr_->num_slots) continue;  // cannot happen: main wrote it
    ShmSlot& sl = seg_->slot(s);
    // Read before the claim, kept only if the claim succeeds (then main
    // wrote them before the ASSIGNED we replace, and cannot rewrite them
    // before it reclaims the slot from us).
    const uint64_t seq = load_relaxed(sl.seq);
    const uint64_t task_len = load_relaxed(sl.task_len);
    uint64_t word = slot_word(lap, SlotState::Assigned);
    // Acquire pairs with assign()'s CAS to ASSIGNED: task bytes and fields.
    // Fails when main reclaimed this lap: a stale entry, skipped.
    if (!cas_acq_rel(sl.state, word, slot_word(lap, SlotState::Writing))) continue;
    store_release(q.current_seq, seq);
    bump_release(q.progress);
    *out = TaskRef{s, seq, task_len, lap};
    return PopResult::Popped;
  }
}

WaitResult WorkerRing::next_task(int64_t timeout_ns, TaskRef* out) {
  if (worker_ == kNoWorker)
    throw std::logic_error("fastload: next_task() before worker_started()");
  ShmWorker& q = seg_->worker(worker_);
  // Ready: the slot is remembered under its lap, for commit(slot).
  auto outcome = [&](PopResult p) {
    if (p != PopResult::Popped) return WaitResult::Shutdown;
    taken_lap_[out->slot] = out->lap;
    return WaitResult::Ready;
  };
  for (int i = 0; i < kSpinChecks; ++i) {
    const PopResult p = try_pop(out);
    if (p != PopResult::Empty) return outcome(p);
    sync::cpu_relax();
  }
  const sync::Deadline deadline = sync::Deadline::after_ns(timeout_ns);
  for (;;) {
    if (load_acquire(hdr_->shutdown) != 0) return WaitResult::Shutdown;
    store_release(q.sleeping, 1u);
    // Dekker with assign()/shutdown()/reset_worker(): the flag before the
    // re-reads below.
    full_fence();
    const uint32_t bell = load_acquire(q.doorbell);
    const PopResult p = try_pop(out);
    if (p != PopResult::Empty) {
      store_release(q.sleeping, 0u);
      return outcome(p);
    }
    if (load_acquire(hdr_->shutdown) != 0) {
      store_release(q.sleeping, 0u);
      return WaitResult::Shutdown;
    }
    const int64_t left = deadline.left_ns();
    if (left <= 0) {
      store_release(q.sleeping, 0u);
      return WaitResult::TimedOut;
    }
    auto r = sync::futex_wait(&q.doorbell, bell, left);
    store_release(q.sleeping, 0u);
    if (r == sync::FutexResult::Interrupted) {
      const PopResult p2 = try_pop(out);
      return p2 == PopResult::Empty ? WaitResult::TimedOut : outcome(p2);
    }
  }
}

CommitResult WorkerRing::commit(uint32_t s, const SlotResult& r) {
  seg_->check_slot(s);
  const uint64_t lap = taken_lap_[s];
  if (lap == kNoLap)
    throw std::logic_error("fastload: commit() of slot " + str(s) +
                           ", which this process did not take with next_task()");
  taken_lap_[s] = kNoLap;
  ShmSlot& sl = seg_->slot(s);
  uint64_t word = slot_word(lap, SlotState::Writing);
  // Claim the result fields: from here main cannot reassign this lap
  // unless it reclaims it (then the final CAS below fails).
  if (!cas_acq_rel(sl.state, word, slot_word(lap, SlotState::Committing)))
    return CommitResult::Reclaimed;
  const uint32_t w = load_relaxed(sl.worker);
  store_relaxed(sl.result_kind, r.kind);
  store_relaxed(sl.data_len, r.data_len);
  store_relaxed(sl.meta_offset, r.meta_offset);
  store_relaxed(sl.meta_len, r.meta_len);
  store_relaxed(sl.make_ns, r.make_ns);
  word = slot_word(lap, SlotState::Committing);
  // Release: the payload and the fields above reach main's acquire in
  // is_ready(). Fails only when main reclaimed the slot while we wrote them.
  if (!cas_acq_rel(sl.state, word, slot_word(lap, SlotState::Ready)))
    return CommitResult::Reclaimed;
  // Tell main which slot, on the completion queue. Dying here leaves the
  // slot READY with no entry: main rescans the slots at each new death.
  ShmCompletions& cq = seg_->completions();
  const uint32_t pos = take_ticket(cq.tail);
  // Release: main's acquire of this cell sees the READY above (and so, as
  // with the state word itself, the payload and the result fields).
  store_release(cq.cells[pos & kCqMask], completion_entry(pos, lap, s));
  if (w < hdr_->num_workers) {
    store_release(seg_->worker(w).current_seq, kNoSeq);
    bump_release(seg_->worker(w).progress);
  }
  bump_release(hdr_->completions);
  // Dekker with wait_any() and wait_ready(): the completion before the `main_waiting` load.
  // Every commit wakes a sleeping main, even one waiting for another slot:
  // see "Orderings and waits" in docs/design.md for why (core balance).
  full_fence();
  if (load_relaxed(hdr_->main_waiting) != 0) sync::futex_wake_all(&hdr_->completions);
  return CommitResult::Committed;
}

}  // namespace fastload
