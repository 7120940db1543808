#include "ring.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace fastload {

using sync::full_fence;
using sync::load_acquire;
using sync::load_relaxed;
using sync::store_release;

namespace {

constexpr int kSpinChecks = 64;  // brief spin before sleeping (see sync::cpu_relax)

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

uint32_t u32(SlotState s) { return static_cast<uint32_t>(s); }

// now + timeout_ns, saturated: INT64_MAX ("wait forever") must not overflow.
int64_t deadline_after(int64_t timeout_ns) {
  const int64_t now = sync::monotonic_ns();
  return timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
}

}  // namespace

size_t ring_payload_offset(uint32_t num_slots, uint32_t num_workers) {
  size_t off = align_up(sizeof(ShmHeader), kCacheLine);
  off += sizeof(ShmWorker) * num_workers;
  off += sizeof(ShmSlot) * num_slots;
  return align_up(off, kPayloadAlign);
}

Ring::Ring(Segment seg, bool owner)
    : seg_(std::move(seg)),
      base_(static_cast<char*>(seg_.data())),
      hdr_(reinterpret_cast<ShmHeader*>(base_)) {
  if (owner) {
    free_slots_.reserve(hdr_->num_slots);
    for (uint32_t i = 0; i < hdr_->num_slots; ++i) free_slots_.push_back(i);
  }
}

std::shared_ptr<Ring> Ring::create(uint32_t num_slots, uint32_t num_workers, uint64_t slot_bytes,
                                   bool force_shm) {
  if (num_slots == 0 || num_slots > kMaxSlots)
    throw std::invalid_argument("fastload: num_slots must be in [1, " +
                                std::to_string(kMaxSlots) + "], got " +
                                std::to_string(num_slots));
  if (num_workers == 0 || num_workers > kMaxWorkers)
    throw std::invalid_argument("fastload: num_workers must be in [1, " +
                                std::to_string(kMaxWorkers) + "], got " +
                                std::to_string(num_workers));
  if (slot_bytes == 0) throw std::invalid_argument("fastload: slot_bytes must be positive");
  slot_bytes = align_up(slot_bytes, kPayloadAlign);
  const size_t payload_off = ring_payload_offset(num_slots, num_workers);
  const size_t total = payload_off + static_cast<size_t>(slot_bytes) * num_slots;

  Segment seg = Segment::create(total, force_shm);
  char* base = static_cast<char*>(seg.data());
  // The segment is fresh and zero-filled; construct the shared structs in it.
  auto* hdr = new (base) ShmHeader{};
  hdr->magic = kRingMagic;
  hdr->version = kRingVersion;
  hdr->header_bytes = sizeof(ShmHeader);
  hdr->num_slots = num_slots;
  hdr->num_workers = num_workers;
  hdr->slot_bytes = slot_bytes;
  hdr->total_bytes = total;
  hdr->workers_offset = align_up(sizeof(ShmHeader), kCacheLine);
  hdr->slots_offset = hdr->workers_offset + sizeof(ShmWorker) * num_workers;
  hdr->payload_offset = payload_off;
  auto* workers = reinterpret_cast<ShmWorker*>(base + hdr->workers_offset);
  for (uint32_t w = 0; w < num_workers; ++w) {
    new (&workers[w]) ShmWorker{};
    workers[w].current_seq.store(kNoSeq, std::memory_order_relaxed);
  }
  auto* slots = reinterpret_cast<ShmSlot*>(base + hdr->slots_offset);
  for (uint32_t s = 0; s < num_slots; ++s) {
    new (&slots[s]) ShmSlot{};
    slots[s].done_seq.store(kNoSeq, std::memory_order_relaxed);
  }
  // Publishing happens when the fd reaches a worker (a syscall, which orders
  // these plain writes before anything the worker reads).
  return std::shared_ptr<Ring>(new Ring(std::move(seg), /*owner=*/true));
}

std::shared_ptr<Ring> Ring::attach(int fd) {
  Segment seg = Segment::attach(fd);
  if (seg.size() < sizeof(ShmHeader))
    throw std::runtime_error("fastload: segment too small to hold a ring header");
  const auto* hdr = static_cast<const ShmHeader*>(seg.data());
  if (hdr->magic != kRingMagic)
    throw std::runtime_error("fastload: segment is not a fastload ring (bad magic)");
  if (hdr->version != kRingVersion || hdr->header_bytes != sizeof(ShmHeader))
    throw std::runtime_error(
        "fastload: ring layout version mismatch between processes (two fastload builds?)");
  if (hdr->total_bytes != seg.size() ||
      hdr->payload_offset != ring_payload_offset(hdr->num_slots, hdr->num_workers))
    throw std::runtime_error("fastload: ring header does not match the segment size");
  return std::shared_ptr<Ring>(new Ring(std::move(seg), /*owner=*/false));
}

ShmSlot& Ring::slot(uint32_t i) const {
  return reinterpret_cast<ShmSlot*>(base_ + hdr_->slots_offset)[i];
}

ShmWorker& Ring::worker(uint32_t i) const {
  return reinterpret_cast<ShmWorker*>(base_ + hdr_->workers_offset)[i];
}

void Ring::check_slot(uint32_t i) const {
  if (i >= hdr_->num_slots)
    throw std::out_of_range("fastload: slot " + std::to_string(i) + " out of range");
}

void Ring::check_worker(uint32_t i) const {
  if (i >= hdr_->num_workers)
    throw std::out_of_range("fastload: worker " + std::to_string(i) + " out of range");
}

char* Ring::payload(uint32_t s) const {
  check_slot(s);
  return payload_base() + static_cast<size_t>(hdr_->slot_bytes) * s;
}

SlotState Ring::state(uint32_t s) const {
  check_slot(s);
  return static_cast<SlotState>(load_acquire(slot(s).state));
}

// ---- main process ---------------------------------------------------------

bool Ring::pop_free_slot(uint32_t* s, bool highest) {
  std::lock_guard<std::mutex> g(free_mu_);
  if (free_slots_.empty()) return false;
  // Batches take the lowest free slot, always: a slot's pages stay committed
  // once a batch was written there, so batches keep to the fewest distinct
  // slots the pipeline needs at once (a stack drifts over one more as frees
  // and pops interleave). Tasks that write no batch (sessions) take the
  // highest, out of the batches' way. num_slots entries, tens: a scan is cheap.
  auto pick = highest ? std::max_element(free_slots_.begin(), free_slots_.end())
                      : std::min_element(free_slots_.begin(), free_slots_.end());
  *s = *pick;
  *pick = free_slots_.back();
  free_slots_.pop_back();
  return true;
}

void Ring::push_free_slot(uint32_t s) {
  check_slot(s);
  if (load_acquire(slot(s).state) != u32(SlotState::Free))
    throw std::logic_error("fastload: push_free_slot() of a slot that is not FREE");
  std::lock_guard<std::mutex> g(free_mu_);
  free_slots_.push_back(s);
}

size_t Ring::free_slot_count() const {
  std::lock_guard<std::mutex> g(free_mu_);
  return free_slots_.size();
}

void Ring::assign(uint32_t s, uint64_t seq, uint32_t w, const void* task, size_t task_len) {
  check_slot(s);
  check_worker(w);
  ShmSlot& sl = slot(s);
  if (load_acquire(sl.state) != u32(SlotState::Free))
    throw std::logic_error("fastload: assign() on a slot that is not FREE");
  if (task_len > hdr_->slot_bytes)
    throw std::length_error("fastload: task of " + std::to_string(task_len) +
                            " bytes does not fit a slot of " + std::to_string(hdr_->slot_bytes) +
                            " bytes (raise slot_bytes)");
  if (task_len > 0) std::memcpy(payload(s), task, task_len);
  sl.worker = w;
  sl.seq = seq;
  sl.task_len = task_len;
  // The worker reads worker/seq/task and the payload after its acquire of
  // the queue tail, which follows this release.
  store_release(sl.state, u32(SlotState::Assigned));

  ShmWorker& q = worker(w);
  const uint32_t tail = load_relaxed(q.tail);  // only main writes tail
  q.entries[tail & (kMaxSlots - 1)] = s;
  // The worker sees the entry (and the slot fields above) once it sees tail+1.
  store_release(q.tail, tail + 1);
  q.doorbell.fetch_add(1, std::memory_order_relaxed);
  // Dekker with next_task(): tail/doorbell stores before the `sleeping` load.
  full_fence();
  if (load_relaxed(q.sleeping) != 0) sync::futex_wake_all(&q.doorbell);
}

bool Ring::is_ready(uint32_t s, uint64_t seq) const {
  check_slot(s);
  const ShmSlot& sl = slot(s);
  // Acquire pairs with commit()'s release of READY: result fields and
  // payload are visible once this returns true.
  return load_acquire(sl.state) == u32(SlotState::Ready) && load_acquire(sl.done_seq) == seq;
}

template <class Pred>
WaitResult Ring::wait_main(Pred ready, int64_t timeout_ns) {
  for (int i = 0; i < kSpinChecks; ++i) {
    if (ready()) return WaitResult::Ready;
    sync::cpu_relax();
  }
  const int64_t deadline = deadline_after(timeout_ns);
  for (;;) {
    const uint32_t seen = load_acquire(hdr_->completions);
    if (ready()) return WaitResult::Ready;
    if (load_acquire(hdr_->shutdown) != 0) return WaitResult::Shutdown;
    store_release(hdr_->main_waiting, 1u);
    // Dekker with commit(): our flag store before re-reading the slots.
    full_fence();
    if (ready()) {
      store_release(hdr_->main_waiting, 0u);
      return WaitResult::Ready;
    }
    const int64_t left = deadline - sync::monotonic_ns();
    if (left <= 0) {
      store_release(hdr_->main_waiting, 0u);
      return WaitResult::TimedOut;
    }
    auto r = sync::futex_wait(&hdr_->completions, seen, left);
    store_release(hdr_->main_waiting, 0u);
    if (r == sync::FutexResult::Interrupted || r == sync::FutexResult::TimedOut) {
      // A signal (Ctrl-C) must reach Python now: report a timeout, the
      // caller loops and checks signals and worker liveness.
      return ready() ? WaitResult::Ready : WaitResult::TimedOut;
    }
  }
}

WaitResult Ring::wait_ready(uint32_t s, uint64_t seq, int64_t timeout_ns) {
  check_slot(s);
  return wait_main([&] { return is_ready(s, seq); }, timeout_ns);
}

WaitResult Ring::wait_any(const uint32_t* slots, const uint64_t* seqs, size_t n,
                          int64_t timeout_ns, size_t* which) {
  for (size_t i = 0; i < n; ++i) check_slot(slots[i]);
  return wait_main(
      [&] {
        for (size_t i = 0; i < n; ++i) {
          if (is_ready(slots[i], seqs[i])) {
            *which = i;
            return true;
          }
        }
        return false;
      },
      timeout_ns);
}

SlotResult Ring::result(uint32_t s) const {
  check_slot(s);
  const ShmSlot& sl = slot(s);
  if (load_acquire(sl.state) != u32(SlotState::Ready) &&
      load_acquire(sl.state) != u32(SlotState::Leased))
    throw std::logic_error("fastload: result() of a slot that is not READY");
  return SlotResult{sl.result_kind, sl.data_len, sl.meta_offset, sl.meta_len};
}

void Ring::lease(uint32_t s) {
  check_slot(s);
  ShmSlot& sl = slot(s);
  if (load_acquire(sl.state) != u32(SlotState::Ready))
    throw std::logic_error("fastload: lease() of a slot that is not READY");
  // Only main reads LEASED; relaxed would do, release keeps the state word's
  // stores uniformly release.
  store_release(sl.state, u32(SlotState::Leased));
}

void Ring::release(uint32_t s) {
  check_slot(s);
  ShmSlot& sl = slot(s);
  const uint32_t st = load_acquire(sl.state);
  if (st != u32(SlotState::Ready) && st != u32(SlotState::Leased))
    throw std::logic_error("fastload: release() of a slot that is neither READY nor LEASED");
  // Main read the payload before this (views are dead); the next assign()
  // by main itself follows in program order, so release is enough.
  store_release(sl.state, u32(SlotState::Free));
  std::lock_guard<std::mutex> g(free_mu_);
  free_slots_.push_back(s);
}

void Ring::shutdown() {
  store_release(hdr_->shutdown, 1u);
  for (uint32_t w = 0; w < hdr_->num_workers; ++w) {
    ShmWorker& q = worker(w);
    q.doorbell.fetch_add(1, std::memory_order_release);
    sync::futex_wake_all(&q.doorbell);
  }
  // Bump the word before waking, as commit() does: a waiter in wait_main()
  // on another thread that checked `shutdown` just before the store above
  // then fails its futex_wait(completions, seen) instead of sleeping through
  // this wake-up until its timeout.
  hdr_->completions.fetch_add(1, std::memory_order_release);
  sync::futex_wake_all(&hdr_->completions);
}

bool Ring::is_shutdown() const { return load_acquire(hdr_->shutdown) != 0; }

void Ring::reset_worker(uint32_t w) {
  check_worker(w);
  ShmWorker& q = worker(w);
  // The worker is dead: nobody else touches its fields. Its head catches up
  // with main's tail so a replacement sees an empty queue.
  store_release(q.head, load_relaxed(q.tail));
  store_release(q.sleeping, 0u);
  store_release(q.pid, 0u);
  store_release(q.current_seq, kNoSeq);
}

bool Ring::reclaim(uint32_t s) {
  check_slot(s);
  ShmSlot& sl = slot(s);
  const uint32_t st = load_acquire(sl.state);
  if (st != u32(SlotState::Assigned) && st != u32(SlotState::Writing)) return false;
  store_release(sl.state, u32(SlotState::Free));
  return true;
}

uint32_t Ring::worker_pid(uint32_t w) const {
  check_worker(w);
  return load_acquire(worker(w).pid);
}

uint64_t Ring::worker_progress(uint32_t w) const {
  check_worker(w);
  return load_acquire(worker(w).progress);
}

uint64_t Ring::worker_current_seq(uint32_t w) const {
  check_worker(w);
  return load_acquire(worker(w).current_seq);
}

// ---- worker process -------------------------------------------------------

void Ring::worker_started(uint32_t w, uint32_t pid) {
  check_worker(w);
  store_release(worker(w).pid, pid);
}

WaitResult Ring::next_task(uint32_t w, int64_t timeout_ns, TaskRef* out) {
  check_worker(w);
  ShmWorker& q = worker(w);
  const uint32_t head = load_relaxed(q.head);  // only this worker writes head
  auto pop = [&]() {
    const uint32_t s = q.entries[head & (kMaxSlots - 1)];
    // Release: main may reuse the entry once it sees head+1 (it never needs
    // to today: capacity >= num_slots), kept for the queue's own contract.
    store_release(q.head, head + 1);
    ShmSlot& sl = slot(s);
    store_release(sl.state, u32(SlotState::Writing));
    store_release(q.current_seq, sl.seq);
    q.progress.fetch_add(1, std::memory_order_release);
    *out = TaskRef{s, sl.seq, sl.task_len};
    return WaitResult::Ready;
  };
  for (int i = 0; i < kSpinChecks; ++i) {
    // Acquire pairs with assign()'s tail release: entry and slot fields.
    if (load_acquire(q.tail) != head) return pop();
    sync::cpu_relax();
  }
  const int64_t deadline = deadline_after(timeout_ns);
  for (;;) {
    if (load_acquire(hdr_->shutdown) != 0) return WaitResult::Shutdown;
    store_release(q.sleeping, 1u);
    // Dekker with assign()/shutdown(): the flag before the re-reads below.
    full_fence();
    const uint32_t bell = load_acquire(q.doorbell);
    if (load_acquire(q.tail) != head) {
      store_release(q.sleeping, 0u);
      return pop();
    }
    if (load_acquire(hdr_->shutdown) != 0) {
      store_release(q.sleeping, 0u);
      return WaitResult::Shutdown;
    }
    const int64_t left = deadline - sync::monotonic_ns();
    if (left <= 0) {
      store_release(q.sleeping, 0u);
      return WaitResult::TimedOut;
    }
    auto r = sync::futex_wait(&q.doorbell, bell, left);
    store_release(q.sleeping, 0u);
    if (r == sync::FutexResult::Interrupted) {
      if (load_acquire(q.tail) != head) return pop();
      return WaitResult::TimedOut;
    }
  }
}

void Ring::commit(uint32_t s, const SlotResult& r) {
  check_slot(s);
  ShmSlot& sl = slot(s);
  const uint32_t w = sl.worker;
  sl.result_kind = r.kind;
  sl.data_len = r.data_len;
  sl.meta_offset = r.meta_offset;
  sl.meta_len = r.meta_len;
  store_release(sl.done_seq, sl.seq);
  // Publishes the payload and the fields above to main's acquire in is_ready().
  store_release(sl.state, u32(SlotState::Ready));
  if (w < hdr_->num_workers) {
    store_release(worker(w).current_seq, kNoSeq);
    worker(w).progress.fetch_add(1, std::memory_order_release);
  }
  hdr_->completions.fetch_add(1, std::memory_order_release);
  // Dekker with wait_main(): the completion before the `main_waiting` load.
  full_fence();
  if (load_relaxed(hdr_->main_waiting) != 0) sync::futex_wake_all(&hdr_->completions);
}

}  // namespace fastload
