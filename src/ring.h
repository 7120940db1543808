// fastload/src/ring.h — the shared ring: one segment = ShmHeader, the
// per-worker submission queues, the per-slot headers, then the slot payloads.
//
//   [ShmHeader][ShmWorker x num_workers][ShmSlot x num_slots][pad][slot 0]...[slot S-1]
//
// Who does what (one writer per field, as in the Disruptor):
//   main    picks a FREE slot, writes the task into it, marks it ASSIGNED
//           and pushes its index on the submission queue of the worker that
//           must make it (round-robin is the caller's policy, not the ring's);
//   worker  pops the index, marks the slot WRITING, writes the batch into
//           the payload, fills the result fields, marks it READY and bumps
//           the header's completion counter (main's futex word);
//   main    waits for READY (checking the sequence stamp, so a stale slot
//           never looks ready), marks it LEASED while views of it are alive,
//           then FREE again.
// Every wait is a bounded futex wait that also watches the shutdown flag.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "segment.h"
#include "sync.h"

namespace fastload {

constexpr uint64_t kRingMagic = 0x474e4952444c5346ULL;  // "FSLDRING" read little-endian
constexpr uint32_t kRingVersion = 1;
constexpr uint32_t kMaxSlots = 1024;  // power of two: queue indices are masked with it
constexpr uint32_t kMaxWorkers = 512;
constexpr size_t kCacheLine = 64;
constexpr size_t kPayloadAlign = 4096;  // slot payloads start on a page
constexpr uint64_t kNoSeq = ~0ULL;

static_assert((kMaxSlots & (kMaxSlots - 1)) == 0, "kMaxSlots must be a power of two");

enum class SlotState : uint32_t { Free = 0, Assigned = 1, Writing = 2, Ready = 3, Leased = 4 };
enum class WaitResult : int { Ready = 0, TimedOut = 1, Shutdown = 2 };

// One per slot, in shared memory. Plain fields are handed over by the state
// word: written before a store_release of `state`, read after a
// load_acquire of it that saw the matching value.
struct alignas(kCacheLine) ShmSlot {
  // Written by main (FREE->ASSIGNED, READY->LEASED, LEASED->FREE) and by the
  // owning worker (ASSIGNED->WRITING->READY); never by two sides at once.
  std::atomic<uint32_t> state;
  uint32_t worker;       // main, before ASSIGNED
  uint64_t seq;          // main, before ASSIGNED: the batch number
  uint64_t task_len;     // main, before ASSIGNED: task bytes at payload start
  std::atomic<uint64_t> done_seq;  // worker, before READY: the lap stamp main checks
  uint32_t result_kind;  // worker, before READY: meaning is the caller's
  uint32_t reserved;
  uint64_t data_len;     // worker, before READY
  uint64_t meta_offset;  // worker, before READY
  uint64_t meta_len;     // worker, before READY
};

// One per worker, in shared memory: a single-producer (main) single-consumer
// (the worker) queue of slot indices, io_uring-SQ style with free-running
// 32-bit head/tail masked only to index.
struct alignas(kCacheLine) ShmWorker {
  alignas(kCacheLine) std::atomic<uint32_t> tail;  // main writes (release) after the entry
  std::atomic<uint32_t> doorbell;  // main bumps after each push and at shutdown: the worker's futex word
  alignas(kCacheLine) std::atomic<uint32_t> head;  // the worker writes after reading an entry
  std::atomic<uint32_t> sleeping;  // the worker: 1 while it may be in futex_wait (main wakes only then)
  std::atomic<uint32_t> pid;       // the worker, once attached
  std::atomic<uint64_t> progress;  // the worker bumps at every pop and commit: the hang watchdog reads it
  std::atomic<uint64_t> current_seq;  // the worker: batch in hand, kNoSeq when idle
  alignas(kCacheLine) uint32_t entries[kMaxSlots];  // main writes before its tail release
};

struct ShmHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;  // sizeof(ShmHeader): catches two builds with different layouts
  uint32_t num_slots;
  uint32_t num_workers;
  uint64_t slot_bytes;
  uint64_t total_bytes;
  uint64_t workers_offset;
  uint64_t slots_offset;
  uint64_t payload_offset;
  // main sets it once; every wait loop of every process checks it.
  alignas(kCacheLine) std::atomic<uint32_t> shutdown;
  // workers bump it (after READY) ; main's futex word.
  alignas(kCacheLine) std::atomic<uint32_t> completions;
  std::atomic<uint32_t> main_waiting;  // main: 1 while it may sleep on `completions`
};

static_assert(std::is_standard_layout_v<ShmSlot> && sizeof(ShmSlot) % kCacheLine == 0,
              "ShmSlot is an ABI between processes");
static_assert(std::is_standard_layout_v<ShmWorker> && sizeof(ShmWorker) % kCacheLine == 0,
              "ShmWorker is an ABI between processes");
static_assert(std::is_standard_layout_v<ShmHeader>, "ShmHeader is an ABI between processes");
static_assert(offsetof(ShmHeader, shutdown) % kCacheLine == 0 &&
                  offsetof(ShmHeader, completions) % kCacheLine == 0,
              "hot header fields each start a cache line");

struct TaskRef {
  uint32_t slot;
  uint64_t seq;
  uint64_t task_len;
};

struct SlotResult {
  uint32_t kind;
  uint64_t data_len;
  uint64_t meta_offset;
  uint64_t meta_len;
};

class Ring {
 public:
  // Main process: a new segment. Throws std::invalid_argument on bad
  // geometry, std::runtime_error when the memory cannot be had.
  static std::shared_ptr<Ring> create(uint32_t num_slots, uint32_t num_workers,
                                      uint64_t slot_bytes, bool force_shm = false);
  // Worker: maps the segment behind `fd` (takes ownership) and checks the
  // magic, version and layout.
  static std::shared_ptr<Ring> attach(int fd);

  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  uint32_t num_slots() const { return hdr_->num_slots; }
  uint32_t num_workers() const { return hdr_->num_workers; }
  uint64_t slot_bytes() const { return hdr_->slot_bytes; }
  int fd() const { return seg_.fd(); }
  SegmentBackend backend() const { return seg_.backend(); }
  void close_fd() { seg_.close_fd(); }
  char* payload(uint32_t slot) const;
  char* payload_base() const { return base_ + hdr_->payload_offset; }
  size_t payload_bytes() const { return static_cast<size_t>(hdr_->slot_bytes) * hdr_->num_slots; }
  SlotState state(uint32_t slot) const;

  // ---- main process -------------------------------------------------------
  // Takes a FREE slot off the process-local free list, the lowest (for
  // batches) or the highest (`highest`: for tasks that write no batch);
  // false when none is.
  bool pop_free_slot(uint32_t* slot, bool highest = false);
  size_t free_slot_count() const;
  // Puts back a slot taken by pop_free_slot() and never assigned.
  void push_free_slot(uint32_t slot);
  // FREE -> ASSIGNED, task bytes copied to the payload start, queued for `worker`.
  void assign(uint32_t slot, uint64_t seq, uint32_t worker, const void* task, size_t task_len);
  // Waits until `slot` is READY with stamp `seq`.
  WaitResult wait_ready(uint32_t slot, uint64_t seq, int64_t timeout_ns);
  // Waits until any of slots[i] is READY with stamp seqs[i]; *which = i.
  WaitResult wait_any(const uint32_t* slots, const uint64_t* seqs, size_t n, int64_t timeout_ns,
                      size_t* which);
  bool is_ready(uint32_t slot, uint64_t seq) const;
  SlotResult result(uint32_t slot) const;
  void lease(uint32_t slot);    // READY -> LEASED
  void release(uint32_t slot);  // READY/LEASED -> FREE, back on the free list
  void shutdown();
  bool is_shutdown() const;
  // After a worker died: forget its queue so a replacement starts clean.
  void reset_worker(uint32_t worker);
  // ASSIGNED/WRITING (a dead worker's unfinished task) -> FREE, off any list:
  // main assigns it again at once. False if the slot was in another state.
  bool reclaim(uint32_t slot);
  uint32_t worker_pid(uint32_t worker) const;
  uint64_t worker_progress(uint32_t worker) const;
  uint64_t worker_current_seq(uint32_t worker) const;

  // ---- worker process -----------------------------------------------------
  void worker_started(uint32_t worker, uint32_t pid);
  // Pops the next task (ASSIGNED -> WRITING).
  WaitResult next_task(uint32_t worker, int64_t timeout_ns, TaskRef* out);
  // WRITING -> READY with the result fields, then wakes main if it sleeps.
  void commit(uint32_t slot, const SlotResult& r);

 private:
  Ring(Segment seg, bool owner);
  ShmSlot& slot(uint32_t i) const;
  ShmWorker& worker(uint32_t i) const;
  void check_slot(uint32_t i) const;
  void check_worker(uint32_t i) const;
  template <class Pred>
  WaitResult wait_main(Pred ready, int64_t timeout_ns);

  Segment seg_;
  char* base_;
  ShmHeader* hdr_;
  // Process-local (main only): slots main may assign. Guarded by a mutex
  // because a slot's last view may die on any thread.
  mutable std::mutex free_mu_;
  std::vector<uint32_t> free_slots_;
};

// Layout arithmetic, shared by create() and the tests.
size_t ring_payload_offset(uint32_t num_slots, uint32_t num_workers);

}  // namespace fastload
