// fastload/src/ring_worker.cpp — the worker's side of the ring: take a task
// from its submission queue (spinning briefly, then sleeping on its doorbell),
// and commit the result into the slot and onto the completion queue. The main
// process's side is in ring.cpp; the protocol is described in ring.h.

#include <stdexcept>
#include <string>

#include "ring.h"
#include "ring_detail.h"

namespace fastload {

using namespace detail;  // NOLINT: the helpers shared with ring.cpp

// ---- worker process -------------------------------------------------------

WorkerTicket Ring::worker_started(uint32_t w, uint32_t pid) {
  check_worker(w);
  const WorkerTicket me{w, load_acquire(worker(w).generation)};
  store_relaxed(local_generation_[w], uint64_t{me.generation});
  store_release(worker(w).pid, pid);
  return me;
}

Ring::PopResult Ring::try_pop(const WorkerTicket& me, TaskRef* out) {
  ShmWorker& q = worker(me.worker);
  for (;;) {
    if (load_acquire(q.generation) != me.generation) return PopResult::Retired;
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
    ShmSlot& sl = slot(s);
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

WaitResult Ring::next_task(const WorkerTicket& me, int64_t timeout_ns, TaskRef* out) {
  check_worker(me.worker);
  ShmWorker& q = worker(me.worker);
  auto outcome = [](PopResult p) {
    return p == PopResult::Popped ? WaitResult::Ready : WaitResult::Shutdown;
  };
  for (int i = 0; i < kSpinChecks; ++i) {
    const PopResult p = try_pop(me, out);
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
    const PopResult p = try_pop(me, out);
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
      const PopResult p2 = try_pop(me, out);
      return p2 == PopResult::Empty ? WaitResult::TimedOut : outcome(p2);
    }
  }
}

CommitResult Ring::commit(const TaskRef& t, const SlotResult& r) {
  check_slot(t.slot);
  ShmSlot& sl = slot(t.slot);
  uint64_t word = slot_word(t.lap, SlotState::Writing);
  // Claim the result fields: from here main cannot reassign this lap
  // unless it reclaims it (then the final CAS below fails).
  if (!cas_acq_rel(sl.state, word, slot_word(t.lap, SlotState::Committing))) {
    if (word_lap(word) == t.lap && !in_flight(word_state(word)) &&
        word_state(word) != SlotState::Free)
      throw std::logic_error("fastload: commit() of slot " + str(t.slot) + " twice");
    return CommitResult::Reclaimed;
  }
  const uint32_t w = load_relaxed(sl.worker);
  store_relaxed(sl.result_kind, r.kind);
  store_relaxed(sl.data_len, r.data_len);
  store_relaxed(sl.meta_offset, r.meta_offset);
  store_relaxed(sl.meta_len, r.meta_len);
  store_relaxed(sl.make_ns, r.make_ns);
  word = slot_word(t.lap, SlotState::Committing);
  // Release: the payload and the fields above reach main's acquire in
  // is_ready(). Fails only when main reclaimed the slot while we wrote them.
  if (!cas_acq_rel(sl.state, word, slot_word(t.lap, SlotState::Ready)))
    return CommitResult::Reclaimed;
  // Tell main which slot, on the completion queue. Dying here leaves the
  // slot READY with no entry: main rescans the slots at each new death.
  ShmCompletions& cq = completions();
  const uint32_t pos = take_ticket(cq.tail);
  // Release: main's acquire of this cell sees the READY above (and so, as
  // with the state word itself, the payload and the result fields).
  store_release(cq.cells[pos & kCqMask], completion_entry(pos, t.lap, t.slot));
  if (w < hdr_->num_workers) {
    store_release(worker(w).current_seq, kNoSeq);
    bump_release(worker(w).progress);
  }
  bump_release(hdr_->completions);
  // Dekker with wait_any() and wait_ready(): the completion before the `main_waiting` load.
  full_fence();
  if (load_relaxed(hdr_->main_waiting) != 0) sync::futex_wake_all(&hdr_->completions);
  return CommitResult::Committed;
}

// ---- one worker per Ring object -------------------------------------------

WaitResult Ring::next_task(uint32_t w, int64_t timeout_ns, TaskRef* out) {
  check_worker(w);
  uint64_t gen = load_relaxed(local_generation_[w]);
  if (gen == kNoGeneration) {
    gen = load_acquire(worker(w).generation);
    store_relaxed(local_generation_[w], gen);
  }
  const WaitResult r = next_task(WorkerTicket{w, static_cast<uint32_t>(gen)}, timeout_ns, out);
  if (r == WaitResult::Ready) store_relaxed(local_lap_[out->slot], out->lap);
  return r;
}

CommitResult Ring::commit(uint32_t s, const SlotResult& r) {
  check_slot(s);
  const uint64_t lap = load_relaxed(local_lap_[s]);
  if (lap == kNoLap)
    throw std::logic_error("fastload: commit() of slot " + str(s) +
                           ", which this process did not take with next_task()");
  store_relaxed(local_lap_[s], kNoLap);
  return commit(TaskRef{s, 0, 0, lap}, r);
}

}  // namespace fastload
