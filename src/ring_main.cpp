// fastload/src/ring_main.cpp — the main process's side of the ring: the free
// slots, assigning tasks, taking completions and waiting for them, leases,
// reclaims, shutdown and the death watch. The segment (create, attach, the
// layout checked) is in ring_segment.cpp, the worker's side in
// ring_worker.cpp; the protocol is described in ring.h.

#include "ring_main.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "ring_detail.h"

namespace fastload {

using namespace detail;  // NOLINT: the helpers shared with ring_worker.cpp

// ---- construction ---------------------------------------------------------

MainRing::MainRing(std::shared_ptr<RingSegment> seg)
    : seg_(std::move(seg)),
      hdr_(&seg_->header()),
      cq_taken_(new bool[kCompletionCapacity]()),
      ready_lap_(new uint64_t[seg_->num_slots()]) {
  for (uint32_t s = 0; s < seg_->num_slots(); ++s) ready_lap_[s] = kNoLap;
  {
    std::lock_guard<std::mutex> g(free_mu_);
    for (uint32_t s = 0; s < seg_->num_slots(); ++s) set_free_bit(s);
  }
  watch_ = std::make_unique<DeathWatch>([this] { wake_main(); });
}

MainRing::~MainRing() = default;

std::shared_ptr<MainRing> MainRing::create(uint32_t num_slots, uint32_t num_workers,
                                           uint64_t slot_bytes, bool force_shm) {
  return std::shared_ptr<MainRing>(
      new MainRing(RingSegment::create(num_slots, num_workers, slot_bytes, force_shm)));
}

// ---- the free bitmap ------------------------------------------------------

void MainRing::set_free_bit(uint32_t s) {
  free_bits_[s / 64] |= uint64_t{1} << (s % 64);
  ++free_count_;
}

bool MainRing::pop_free_slot(uint32_t* s, bool highest) {
  std::lock_guard<std::mutex> g(free_mu_);
  if (free_count_ == 0) return false;
  // Batches take the lowest free slot, always: a slot's pages stay committed
  // once a batch was written there, so batches keep to the fewest distinct
  // slots the pipeline needs at once. Tasks that write no batch (sessions)
  // take the highest, out of the batches' way.
  constexpr uint32_t kWords = kMaxSlots / 64;
  const uint32_t words = (hdr_->num_slots + 63) / 64;
  uint32_t found = kMaxSlots;
  for (uint32_t k = 0; k < words && found == kMaxSlots; ++k) {
    const uint32_t i = highest ? words - 1 - k : k;
    const uint64_t bits = free_bits_[i];
    if (bits == 0) continue;
    found = i * 64 + (highest ? 63 - static_cast<uint32_t>(__builtin_clzll(bits))
                              : static_cast<uint32_t>(__builtin_ctzll(bits)));
  }
  static_assert(kWords * 64 == kMaxSlots, "bitmap size");
  if (found == kMaxSlots) throw std::logic_error("fastload: free bitmap count is wrong");
  if (word_state(load_acquire(seg_->slot(found).state)) != SlotState::Free)
    throw std::logic_error("fastload: slot " + str(found) + " is on the free bitmap but not FREE");
  free_bits_[found / 64] &= ~(uint64_t{1} << (found % 64));
  --free_count_;
  *s = found;
  return true;
}

void MainRing::push_free_slot(uint32_t s) {
  seg_->check_slot(s);
  if (word_state(load_acquire(seg_->slot(s).state)) != SlotState::Free)
    throw std::logic_error("fastload: push_free_slot() of a slot that is not FREE");
  std::lock_guard<std::mutex> g(free_mu_);
  if (free_bits_[s / 64] & (uint64_t{1} << (s % 64)))
    throw std::logic_error("fastload: push_free_slot() of slot " + str(s) +
                           ", which is already free");
  set_free_bit(s);
}

size_t MainRing::trim_free_slot(uint32_t s, size_t keep) {
  seg_->check_slot(s);
  if (seg_->backend() != SegmentBackend::Memfd) return 0;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t slot_bytes = static_cast<size_t>(hdr_->slot_bytes);
  keep = (keep + page - 1) / page * page;
  if (keep >= slot_bytes) return 0;
  // Under the bitmap's lock: the slot stays free (and so untouched by any
  // worker) while its pages go.
  std::lock_guard<std::mutex> g(free_mu_);
  if (!(free_bits_[s / 64] & (uint64_t{1} << (s % 64)))) return 0;
  char* start = seg_->payload(s) + keep;
  const size_t len = slot_bytes - keep;
  if (madvise(start, len, MADV_REMOVE) != 0) return 0;
  return len;
}

size_t MainRing::free_slot_count() const {
  std::lock_guard<std::mutex> g(free_mu_);
  return free_count_;
}

// ---- tasks ----------------------------------------------------------------

void MainRing::assign(uint32_t s, uint64_t seq, uint32_t w, const void* task, size_t task_len) {
  seg_->check_slot(s);
  seg_->check_worker(w);
  ShmSlot& sl = seg_->slot(s);
  // Only main moves a slot out of FREE, so this read cannot go stale before
  // the CAS below.
  uint64_t word = load_acquire(sl.state);
  if (word_state(word) != SlotState::Free)
    throw std::logic_error("fastload: assign() on a slot that is not FREE");
  {
    std::lock_guard<std::mutex> g(free_mu_);
    if (free_bits_[s / 64] & (uint64_t{1} << (s % 64)))
      throw std::logic_error("fastload: assign() of slot " + str(s) +
                             " while it is on the free bitmap (take it with pop_free_slot())");
  }
  if (task_len > hdr_->slot_bytes)
    throw std::length_error("fastload: task of " + str(task_len) +
                            " bytes does not fit a slot of " + str(hdr_->slot_bytes) +
                            " bytes (raise slot_bytes)");
  ShmWorker& q = seg_->worker(w);
  const uint32_t tail = load_relaxed(q.tail);  // only main writes tail
  if (tail - load_acquire(q.head) >= kMaxSlots)
    throw std::logic_error("fastload: the queue of worker " + str(w) + " is full");
  if (task_len > 0) std::memcpy(seg_->payload(s), task, task_len);
  store_relaxed(sl.worker, w);
  store_relaxed(sl.seq, seq);
  store_relaxed(sl.task_len, static_cast<uint64_t>(task_len));
  const uint64_t lap = word_lap(word) + 1;
  // Release: the fields and task bytes above reach the worker whose claim
  // (cas_acq_rel from ASSIGNED) reads this word.
  if (!cas_acq_rel(sl.state, word, slot_word(lap, SlotState::Assigned)))
    throw std::logic_error("fastload: slot " + str(s) + " changed state under assign()");

  store_relaxed(q.entries[tail & (kMaxSlots - 1)], queue_entry(lap, s));
  // The worker sees the entry once it sees tail+1 (its load_acquire of tail).
  store_release(q.tail, tail + 1);
  bump_release(q.doorbell);
  // Dekker with next_task(): tail/doorbell stores before the `sleeping` load.
  full_fence();
  if (load_relaxed(q.sleeping) != 0) sync::futex_wake_all(&q.doorbell);
}

// ---- results --------------------------------------------------------------

bool MainRing::is_ready(uint32_t s, uint64_t seq) const {
  seg_->check_slot(s);
  const ShmSlot& sl = seg_->slot(s);
  // Acquire pairs with commit()'s release of READY: result fields and
  // payload are visible once this returns true. `seq` is main's own write
  // (assign), and READY can only come from the lap that assign() started.
  return word_state(load_acquire(sl.state)) == SlotState::Ready && load_relaxed(sl.seq) == seq;
}

// ---- completions ----------------------------------------------------------

void MainRing::take_completions() {
  ShmCompletions& cq = seg_->completions();
  // Acquire: positions below `tail` were taken by producers; their cells are
  // read (acquire) one by one below.
  const uint32_t tail = load_acquire(cq.tail);
  if (tail - cq_head_ > kCompletionCapacity) {
    // Producers ran a whole queue past our head: the cells of [head,
    // tail - capacity) were written over (or never written: holes). Give
    // those positions up and rescan the slots instead.
    const uint32_t give_up = tail - kCompletionCapacity - cq_head_;
    for (uint32_t k = 0; k < give_up && k < kCompletionCapacity; ++k)
      cq_taken_[(cq_head_ + k) & kCqMask] = false;
    cq_head_ = tail - kCompletionCapacity;
    rescan_due_ = true;
  }
  for (uint32_t pos = cq_head_; pos != tail; ++pos) {
    const uint32_t i = pos & kCqMask;
    if (cq_taken_[i]) continue;
    // Acquire pairs with commit()'s store_release of the entry, which
    // follows its READY: once the entry is seen, so is the READY (or a
    // later state of the slot).
    const uint64_t e = load_acquire(cq.cells[i]);
    if (completion_pos(e) != pos) continue;  // not written yet (or a hole)
    cq_taken_[i] = true;
    const uint32_t s = completion_slot(e);
    if (s >= hdr_->num_slots) continue;  // cannot happen: a worker wrote it
    const uint64_t word = load_acquire(seg_->slot(s).state);
    // Dropped unless the slot is still READY on the lap that pushed it: a
    // slot main already released, reclaimed or assigned again (its state
    // word says so) has nothing to say.
    if (word_state(word) == SlotState::Ready && (word_lap(word) & 0xffff) == completion_lap16(e))
      ready_lap_[s] = word_lap(word);
  }
  while (cq_head_ != tail && cq_taken_[cq_head_ & kCqMask]) {
    cq_taken_[cq_head_ & kCqMask] = false;
    ++cq_head_;
  }
}

void MainRing::rescan_slots() {
  rescan_due_ = false;
  ++rescans_;
  rescanned_deaths_ = watch_->events();
  for (uint32_t s = 0; s < hdr_->num_slots; ++s) {
    const uint64_t word = load_acquire(seg_->slot(s).state);
    if (word_state(word) == SlotState::Ready) ready_lap_[s] = word_lap(word);
  }
}

bool MainRing::find_ready(const uint32_t* slots, const uint64_t* seqs, size_t n, size_t* which) {
  take_completions();
  if (!rescan_due_ && watch_->events() != rescanned_deaths_)
    rescan_due_ = true;  // a worker died, maybe between its READY and its push
  if (rescan_due_) rescan_slots();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t s = slots[i];
    const uint64_t lap = ready_lap_[s];
    if (lap == kNoLap) continue;
    // Acquire pairs with commit()'s release of READY: result fields and
    // payload are visible. The table is only a hint: the word decides.
    if (load_acquire(seg_->slot(s).state) != slot_word(lap, SlotState::Ready)) {
      ready_lap_[s] = kNoLap;  // released, reclaimed or reassigned since
      continue;
    }
    // `seq` is main's own write (assign), made before the lap began. A READY
    // slot with another stamp stays in the table for whoever wants that one.
    if (load_relaxed(seg_->slot(s).seq) == seqs[i]) {
      *which = i;
      return true;
    }
  }
  return false;
}

bool MainRing::any_dead() const { return watch_->dead_count() != 0; }

void MainRing::wake_main() {
  // Bump the word before waking, as commit() does, so a waiter between its
  // look and its futex_wait does not sleep through this.
  bump_release(hdr_->completions);
  sync::futex_wake_all(&hdr_->completions);
}

WaitResult MainRing::wait_ready(uint32_t s, uint64_t seq, int64_t timeout_ns) {
  size_t which = 0;
  return wait_any(&s, &seq, 1, timeout_ns, &which);
}

WaitResult MainRing::wait_any(const uint32_t* slots, const uint64_t* seqs, size_t n,
                          int64_t timeout_ns, size_t* which) {
  for (size_t i = 0; i < n; ++i) seg_->check_slot(slots[i]);
  std::unique_lock<std::mutex> lock(cq_mu_, std::defer_lock);
  auto look = [&] {
    lock.lock();
    const bool found = find_ready(slots, seqs, n, which);
    lock.unlock();
    return found;
  };
  for (int i = 0; i < kSpinChecks; ++i) {
    if (look()) return WaitResult::Ready;
    sync::cpu_relax();
  }
  const sync::Deadline deadline = sync::Deadline::after_ns(timeout_ns);
  for (;;) {
    // Acquire: what a worker pushed before its bump is seen by the look
    // below; a bump after this read makes futex_wait return at once.
    const uint32_t seen = load_acquire(hdr_->completions);
    if (look()) return WaitResult::Ready;
    if (load_acquire(hdr_->shutdown) != 0) return WaitResult::Shutdown;
    if (any_dead()) return WaitResult::WorkerDied;
    store_release(hdr_->main_waiting, 1u);
    // Dekker with commit(): our flag store before taking entries again.
    full_fence();
    if (look()) {
      store_release(hdr_->main_waiting, 0u);
      return WaitResult::Ready;
    }
    const int64_t left = deadline.left_ns();
    if (left <= 0) {
      store_release(hdr_->main_waiting, 0u);
      // Rescan before answering TimedOut: the answer is a scan's.
      lock.lock();
      rescan_due_ = true;
      const bool found = find_ready(slots, seqs, n, which);
      lock.unlock();
      return found ? WaitResult::Ready : WaitResult::TimedOut;
    }
    auto r = sync::futex_wait(&hdr_->completions, seen, std::min(left, kRescanEveryNs));
    store_release(hdr_->main_waiting, 0u);
    if (r == sync::FutexResult::Interrupted) {
      // A signal (Ctrl-C) must reach Python now: report a timeout, the
      // caller loops and checks signals and worker liveness.
      return look() ? WaitResult::Ready : WaitResult::TimedOut;
    }
    if (r == sync::FutexResult::TimedOut && !deadline.passed()) {
      lock.lock();
      rescan_due_ = true;  // asleep a whole rescan period: the safety net
      lock.unlock();
    }
  }
}

void MainRing::watch_worker(uint32_t w, int fd) {
  seg_->check_worker(w);
  watch_->watch(w, fd);
}

void MainRing::unwatch_worker(uint32_t w) {
  seg_->check_worker(w);
  watch_->unwatch(w);
}

uint64_t MainRing::rescan_count() const {
  std::lock_guard<std::mutex> g(cq_mu_);
  return rescans_;
}

std::vector<uint32_t> MainRing::dead_workers() const {
  return watch_->dead();
}

SlotResult MainRing::result(uint32_t s) const {
  seg_->check_slot(s);
  const ShmSlot& sl = seg_->slot(s);
  const SlotState st = word_state(load_acquire(sl.state));
  if (st != SlotState::Ready && st != SlotState::Leased)
    throw std::logic_error("fastload: result() of a slot that is not READY");
  return SlotResult{load_relaxed(sl.result_kind), load_relaxed(sl.data_len),
                    load_relaxed(sl.meta_offset), load_relaxed(sl.meta_len),
                    load_relaxed(sl.make_ns)};
}

void MainRing::lease(uint32_t s) {
  seg_->check_slot(s);
  ShmSlot& sl = seg_->slot(s);
  uint64_t word = load_acquire(sl.state);
  // Only main leaves READY, so the CAS fails only on misuse.
  if (word_state(word) != SlotState::Ready ||
      !cas_acq_rel(sl.state, word, slot_word(word_lap(word), SlotState::Leased)))
    throw std::logic_error("fastload: lease() of a slot that is not READY");
}

void MainRing::release(uint32_t s) {
  seg_->check_slot(s);
  ShmSlot& sl = seg_->slot(s);
  uint64_t word = load_acquire(sl.state);
  const SlotState st = word_state(word);
  // Main read the payload before this (views are dead); the next assign()
  // by main itself follows in program order.
  if ((st != SlotState::Ready && st != SlotState::Leased) ||
      !cas_acq_rel(sl.state, word, slot_word(word_lap(word), SlotState::Free)))
    throw std::logic_error("fastload: release() of a slot that is neither READY nor LEASED");
  std::lock_guard<std::mutex> g(free_mu_);
  set_free_bit(s);
}

void MainRing::shutdown() {
  store_release(hdr_->shutdown, 1u);
  watch_->stop();
  for (uint32_t w = 0; w < hdr_->num_workers; ++w) {
    ShmWorker& q = seg_->worker(w);
    bump_release(q.doorbell);
    sync::futex_wake_all(&q.doorbell);
  }
  // Bump the word before waking, as commit() does: a waiter in wait_any() or wait_ready()
  // on another thread that checked `shutdown` just before the store above
  // then fails its futex_wait(completions, seen) instead of sleeping through
  // this wake-up until its timeout.
  bump_release(hdr_->completions);
  sync::futex_wake_all(&hdr_->completions);
}

void MainRing::reset_worker(uint32_t w) {
  seg_->check_worker(w);
  ShmWorker& q = seg_->worker(w);
  // Retire first: a worker still running under the old generation sees it
  // before its next claim, and a claim it has under way fails against the
  // moved head below.
  bump_release(q.generation);
  // The head catches up with main's tail: the replacement sees an empty
  // queue, and entries left in it (reclaimed or not) are dropped.
  store_release(q.head, load_relaxed(q.tail));
  store_release(q.sleeping, 0u);
  store_release(q.pid, 0u);
  store_release(q.current_seq, kNoSeq);
  // Wake a retired worker that sleeps, so it leaves now.
  bump_release(q.doorbell);
  sync::futex_wake_all(&q.doorbell);
}

ReclaimResult MainRing::reclaim(uint32_t s) {
  seg_->check_slot(s);
  ShmSlot& sl = seg_->slot(s);
  uint64_t word = load_acquire(sl.state);
  // Retried only while a worker moves the same lap along (ASSIGNED ->
  // WRITING -> COMMITTING): either main frees it, or the worker reaches
  // READY first and nothing is reclaimed.
  while (in_flight(word_state(word))) {
    const SlotState was = word_state(word);
    if (cas_acq_rel(sl.state, word, slot_word(word_lap(word), SlotState::Free)))
      return was == SlotState::Assigned ? ReclaimResult::WasQueued : ReclaimResult::WasTaken;
  }
  return ReclaimResult::NotInFlight;
}

uint32_t MainRing::worker_pid(uint32_t w) const {
  seg_->check_worker(w);
  return load_acquire(seg_->worker(w).pid);
}

uint64_t MainRing::worker_progress(uint32_t w) const {
  seg_->check_worker(w);
  return load_acquire(seg_->worker(w).progress);
}

uint64_t MainRing::worker_current_seq(uint32_t w) const {
  seg_->check_worker(w);
  return load_acquire(seg_->worker(w).current_seq);
}

}  // namespace fastload
