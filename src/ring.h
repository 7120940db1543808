// fastload/src/ring.h — the shared ring: one segment = ShmHeader, the
// completion queue, the per-worker submission queues, the per-slot headers,
// then the slot payloads.
//
//   [ShmHeader][ShmCompletions][ShmWorker x num_workers][ShmSlot x num_slots][pad][slot 0]...
//
// Who does what (one writer per field, as in the Disruptor):
//   main    picks a FREE slot, writes the task into it, marks it ASSIGNED
//           and pushes its index on the submission queue of the worker that
//           must make it (round-robin is the caller's policy, not the ring's);
//   worker  pops the index, marks the slot WRITING, writes the batch into
//           the payload, marks it COMMITTING, fills the result fields, marks
//           it READY, pushes (slot, lap) on the completion queue and bumps
//           the header's completion counter (main's futex word);
//   main    pops the completion queue (io_uring-CQ style) instead of
//           scanning the slots, checks each entry against the slot's state
//           word and sequence stamp (so a stale entry or slot never looks
//           ready), marks the slot LEASED while views of it are alive, then
//           FREE again.
// Every state change is a compare-and-swap from the (lap, state) the caller
// expects, the lap being bumped at each assign: a worker believed dead whose
// slot main reclaimed and reassigned can never commit into the new lap.
// The state word stays the one truth: a queue entry only says "look at this
// slot". Main rescans every slot when an entry may have been lost (a worker
// died between READY and its push; see Ring::wait_any).
// Every wait is a bounded futex wait that also watches the shutdown flag and,
// on the main side, the deaths of watched workers (DeathWatch, watch.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "segment.h"
#include "sync.h"
#include "watch.h"

namespace fastload {

constexpr uint64_t kRingMagic = 0x474e4952444c5346ULL;  // "FSLDRING" read little-endian
// Bumped whenever a shared struct changes: two builds with different
// layouts refuse to share a segment. 2: 64-bit slot state words with a lap,
// lap-stamped queue entries, worker generations. 3: the completion queue.
constexpr uint32_t kRingVersion = 4;
constexpr uint32_t kMaxSlots = 1024;  // power of two: queue indices are masked with it
constexpr uint32_t kMaxWorkers = 512;
constexpr size_t kCacheLine = 64;
constexpr size_t kPayloadAlign = 4096;  // slot payloads start on a page
constexpr uint64_t kNoSeq = ~0ULL;

static_assert((kMaxSlots & (kMaxSlots - 1)) == 0, "kMaxSlots must be a power of two");
static_assert(kMaxSlots % 64 == 0, "the free bitmap is whole 64-bit words");
// Completion queue capacity: a power of two, and twice the most slots. Main
// takes every entry at each look, and a slot completes once per assignment,
// so unread entries outnumber the slots only when main took results without
// looking at the queue (is_ready()); entries then written over cost a
// rescan, never a batch.
constexpr uint32_t kCompletionCapacity = 2 * kMaxSlots;
static_assert((kCompletionCapacity & (kCompletionCapacity - 1)) == 0 &&
                  kCompletionCapacity >= kMaxSlots,
              "the completion queue is a power of two and holds an entry per slot");

// A slot's life. COMMITTING is the few instructions in which a worker that
// won the slot from WRITING writes the result fields before READY.
enum class SlotState : uint32_t {
  Free = 0,
  Assigned = 1,
  Writing = 2,
  Ready = 3,
  Leased = 4,
  Committing = 5,
};
// WorkerDied (main only): a worker watched with watch_worker() is gone and
// nothing asked for was READY; the caller looks at its workers now.
enum class WaitResult : int { Ready = 0, TimedOut = 1, Shutdown = 2, WorkerDied = 3 };
// What commit() did. Reclaimed: main took the slot back (the worker was
// believed dead) before this commit; the result is dropped, and the slot may
// already carry another task under a new lap, which this commit never touches.
enum class CommitResult : int { Committed = 0, Reclaimed = 1 };
// What reclaim() did. WasQueued: no worker had taken the task, none ever
// will. WasTaken: a worker held it (WRITING/COMMITTING); its commit will be
// refused, but it may still write the payload until it is really dead.
enum class ReclaimResult : int { NotInFlight = 0, WasQueued = 1, WasTaken = 2 };

// A slot's state word: the state in the low byte, the slot's lap above it.
// Main bumps the lap at every assign(), so a stale party (a queue entry, a
// worker believed dead) that names an old lap can never match the word of
// a reassigned slot: every transition is a CAS from (lap, expected state).
constexpr unsigned kLapShift = 8;
constexpr uint64_t slot_word(uint64_t lap, SlotState st) {
  return (lap << kLapShift) | static_cast<uint64_t>(st);
}
constexpr SlotState word_state(uint64_t word) { return static_cast<SlotState>(word & 0xff); }
constexpr uint64_t word_lap(uint64_t word) { return word >> kLapShift; }

// A queue entry: the slot index and the lap it was assigned under.
constexpr unsigned kEntrySlotBits = 16;
static_assert(kMaxSlots <= (1u << kEntrySlotBits), "slot indices fit a queue entry");
constexpr uint64_t queue_entry(uint64_t lap, uint32_t slot) {
  return (lap << kEntrySlotBits) | slot;
}

// A completion entry: the position it was pushed at (tells a written cell
// from one left by an earlier lap of the queue), the low 16 bits of the
// slot's lap (drops most stale entries before their slot is even read), and
// the slot index.
constexpr uint64_t completion_entry(uint32_t pos, uint64_t lap, uint32_t slot) {
  return (uint64_t{pos} << 32) | ((lap & 0xffff) << kEntrySlotBits) | slot;
}
constexpr uint32_t completion_pos(uint64_t e) { return static_cast<uint32_t>(e >> 32); }
constexpr uint32_t completion_lap16(uint64_t e) {
  return static_cast<uint32_t>((e >> kEntrySlotBits) & 0xffff);
}
constexpr uint32_t completion_slot(uint64_t e) {
  return static_cast<uint32_t>(e & ((1u << kEntrySlotBits) - 1));
}

// One per slot, in shared memory. Fields other than `state` are relaxed
// atomics handed over by the state word: written before the release (store
// or CAS) of a state, read after the acquire of it. They are atomics, not
// plain fields, because a party that lost a race (a stale queue entry, a
// worker whose slot was reclaimed) may read them concurrently with main
// rewriting them; it then throws what it read away when its CAS fails.
struct alignas(kCacheLine) ShmSlot {
  // (lap << 8) | SlotState. Main: FREE->ASSIGNED (lap+1), READY->LEASED,
  // READY/LEASED->FREE, ASSIGNED/WRITING/COMMITTING->FREE (reclaim). The
  // worker that popped the lap: ASSIGNED->WRITING->COMMITTING->READY. All CAS.
  std::atomic<uint64_t> state;
  std::atomic<uint64_t> seq;       // main, before ASSIGNED: the caller's batch number
  std::atomic<uint64_t> task_len;  // main, before ASSIGNED: task bytes at payload start
  std::atomic<uint32_t> worker;    // main, before ASSIGNED
  std::atomic<uint32_t> result_kind;  // worker, in COMMITTING: meaning is the caller's
  std::atomic<uint64_t> data_len;     // worker, in COMMITTING
  std::atomic<uint64_t> meta_offset;  // worker, in COMMITTING
  std::atomic<uint64_t> meta_len;     // worker, in COMMITTING
  std::atomic<uint64_t> make_ns;      // worker, in COMMITTING: time it spent making the result
};

// One per worker, in shared memory: a single-producer (main) single-consumer
// (the worker) queue of lap-stamped slot indices, io_uring-SQ style with
// free-running 32-bit head/tail masked only to index.
struct alignas(kCacheLine) ShmWorker {
  alignas(kCacheLine) std::atomic<uint32_t> tail;  // main writes (release) after the entry
  std::atomic<uint32_t> doorbell;  // main bumps after each push, at reset and at shutdown: the worker's futex word
  // The worker claims entries by CAS (head, head+1); main's reset_worker()
  // moves it to tail, so a retired worker's claim fails.
  alignas(kCacheLine) std::atomic<uint32_t> head;
  std::atomic<uint32_t> sleeping;  // the worker: 1 while it may be in futex_wait (main wakes only then)
  std::atomic<uint32_t> pid;       // the worker, once attached
  // Main bumps it in reset_worker(): a worker that started under an older
  // generation is retired (next_task() answers Shutdown).
  std::atomic<uint32_t> generation;
  std::atomic<uint64_t> progress;  // the worker bumps at every pop and commit: the hang watchdog reads it
  std::atomic<uint64_t> current_seq;  // the worker: batch in hand, kNoSeq when idle
  // queue_entry(lap, slot); main writes before its tail release.
  alignas(kCacheLine) std::atomic<uint64_t> entries[kMaxSlots];
};

// The completion queue, in shared memory: many producers (the workers, in
// commit()), one consumer (main). A producer takes a position with a
// fetch-and-add on `tail` and stores its entry, stamped with that position,
// into cells[pos % capacity]; nothing else is shared. Main keeps its head to
// itself and takes any cell of the window [head, tail) whose stamp matches
// its position, in whatever order they were written, so a producer that
// took a position and died before writing it (a hole) holds up nothing but
// that position, until tail runs a whole capacity past it and main gives it
// up (and rescans the slots). A producer never waits: if main fell a
// capacity behind, the oldest unread entries are overwritten, main notices
// the gap and rescans. Either way the slot states stay right; the queue only
// saves main from reading every slot at every wake-up.
struct alignas(kCacheLine) ShmCompletions {
  // Workers: fetch-and-add (the ticket of a position); main reads it
  // (acquire) to bound the window.
  alignas(kCacheLine) std::atomic<uint32_t> tail;
  // completion_entry(pos, lap, slot); the producer of `pos` stores it
  // (release, after its READY), main loads it (acquire). Initially stamped
  // with the position of the previous lap, so no cell looks written.
  alignas(kCacheLine) std::atomic<uint64_t> cells[kCompletionCapacity];
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
  uint64_t completions_offset;  // the ShmCompletions
  uint32_t completion_capacity;
  // main sets it once; every wait loop of every process checks it.
  alignas(kCacheLine) std::atomic<uint32_t> shutdown;
  // workers bump it (after READY) ; main's futex word.
  alignas(kCacheLine) std::atomic<uint32_t> completions;
  std::atomic<uint32_t> main_waiting;  // main: 1 while it may sleep on `completions`
};

static_assert(std::is_standard_layout_v<ShmSlot> && sizeof(ShmSlot) == kCacheLine,
              "ShmSlot is an ABI between processes: one cache line per slot");
static_assert(offsetof(ShmSlot, state) == 0 && offsetof(ShmSlot, seq) == 8 &&
                  offsetof(ShmSlot, worker) == 24 && offsetof(ShmSlot, meta_len) == 48 &&
                  offsetof(ShmSlot, make_ns) == 56,
              "ShmSlot layout (bump kRingVersion when it changes)");
static_assert(std::is_standard_layout_v<ShmWorker> && sizeof(ShmWorker) % kCacheLine == 0,
              "ShmWorker is an ABI between processes");
static_assert(offsetof(ShmWorker, head) == kCacheLine && offsetof(ShmWorker, entries) == 2 * kCacheLine &&
                  sizeof(ShmWorker) == 2 * kCacheLine + 8 * kMaxSlots,
              "ShmWorker layout (bump kRingVersion when it changes)");
static_assert(std::is_standard_layout_v<ShmHeader>, "ShmHeader is an ABI between processes");
static_assert(offsetof(ShmHeader, shutdown) % kCacheLine == 0 &&
                  offsetof(ShmHeader, completions) % kCacheLine == 0,
              "hot header fields each start a cache line");
static_assert(offsetof(ShmHeader, payload_offset) == 56 &&
                  offsetof(ShmHeader, completion_capacity) == 72 &&
                  sizeof(ShmHeader) == 4 * kCacheLine,
              "ShmHeader layout (bump kRingVersion when it changes)");
static_assert(std::is_standard_layout_v<ShmCompletions> &&
                  offsetof(ShmCompletions, cells) == kCacheLine &&
                  sizeof(ShmCompletions) == kCacheLine + 8 * kCompletionCapacity,
              "ShmCompletions layout (bump kRingVersion when it changes)");

// A task a worker took with next_task(). `lap` names this assignment of the
// slot; commit() succeeds only while the slot is still on that lap.
struct TaskRef {
  uint32_t slot;
  uint64_t seq;
  uint64_t task_len;
  uint64_t lap;
};

struct SlotResult {
  uint32_t kind;
  uint64_t data_len;
  uint64_t meta_offset;
  uint64_t meta_len;
  // Nanoseconds the worker spent making the result (its own clock): the
  // loader's statistics, never used to decide anything in the ring.
  uint64_t make_ns = 0;
};

// What a worker names itself by: its index and the queue generation it
// started under (see ShmWorker::generation).
struct WorkerTicket {
  uint32_t worker;
  uint32_t generation;
};

class Ring {
 public:
  // Main process: a new segment. Throws std::invalid_argument on bad
  // geometry, std::runtime_error when the memory cannot be had.
  static std::shared_ptr<Ring> create(uint32_t num_slots, uint32_t num_workers,
                                      uint64_t slot_bytes, bool force_shm = false);
  // Worker: maps the segment behind `fd` (takes ownership) and validates the
  // whole header (magic, version, geometry, offsets, size) against the
  // segment; std::runtime_error says which check failed.
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
  uint64_t lap(uint32_t slot) const;  // how many times the slot was assigned (a debug view)

  // ---- main process -------------------------------------------------------
  // Free slots are a bitmap (process-local, main only) indexing the slots
  // whose state is FREE and that main has not taken: release() sets a bit as
  // it frees a slot, pop_free_slot() clears one, push_free_slot() puts back
  // one that pop_free_slot() gave and that was never assigned. The state word
  // stays the truth: a bit is only ever set for a FREE slot.
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
  // unwatched or watched again (a replacement). Main process only.
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
  bool is_shutdown() const;
  // After a worker died (or was given up on): empties its queue, bumps its
  // generation so the old worker, should it still run, is retired (its
  // next_task() answers Shutdown and its claims fail), and wakes it.
  void reset_worker(uint32_t worker);
  // ASSIGNED/WRITING/COMMITTING (a dead worker's unfinished task) -> FREE,
  // by CAS, off the free bitmap: main assigns it again at once. A late
  // commit() of the old lap is refused. NotInFlight: the slot was FREE,
  // READY or LEASED (the worker's commit won the race), nothing changed.
  ReclaimResult reclaim(uint32_t slot);
  uint32_t worker_pid(uint32_t worker) const;
  uint64_t worker_progress(uint32_t worker) const;
  uint64_t worker_current_seq(uint32_t worker) const;

  // ---- worker process -----------------------------------------------------
  // Announces the worker (its pid for the watchdog) and returns its ticket,
  // which names the queue generation it serves.
  WorkerTicket worker_started(uint32_t worker, uint32_t pid);
  // Pops the next task (ASSIGNED -> WRITING, by CAS on its lap: a stale
  // entry of a reclaimed slot is skipped). Shutdown also when the worker was
  // retired by reset_worker() since worker_started().
  WaitResult next_task(const WorkerTicket& me, int64_t timeout_ns, TaskRef* out);
  // WRITING -> COMMITTING -> READY with the result fields, if the slot is
  // still on task.lap; then wakes main if it sleeps. Reclaimed: main took
  // the slot back first; nothing was written to it.
  CommitResult commit(const TaskRef& task, const SlotResult& r);

  // One worker per Ring object (a worker process, as the Python workers
  // are): the same calls, with the ticket and the lap remembered by this
  // object. next_task(worker) adopts the current generation if
  // worker_started() was not called; commit(slot) throws std::logic_error
  // for a slot this object did not pop.
  WaitResult next_task(uint32_t worker, int64_t timeout_ns, TaskRef* out);
  CommitResult commit(uint32_t slot, const SlotResult& r);

 public:
  ~Ring();

 private:
  Ring(Segment seg, bool owner);
  ShmSlot& slot(uint32_t i) const;
  ShmWorker& worker(uint32_t i) const;
  void check_slot(uint32_t i) const;
  void check_worker(uint32_t i) const;
  ShmCompletions& completions() const;
  // wait_any's look: takes new completion entries, rescans if due, and
  // looks the wanted slots up. cq_mu_ held.
  bool find_ready(const uint32_t* slots, const uint64_t* seqs, size_t n, size_t* which);
  void take_completions();  // cq_mu_ held
  void rescan_slots();      // cq_mu_ held
  bool any_dead() const;
  void wake_main();
  enum class PopResult { Popped, Empty, Retired };
  PopResult try_pop(const WorkerTicket& me, TaskRef* out);
  void set_free_bit(uint32_t s);  // free_mu_ held

  Segment seg_;
  char* base_;
  ShmHeader* hdr_;
  // Process-local (main only): the free bitmap, bit s of word s/64. Guarded
  // by a mutex because a slot's last view may die on any thread.
  mutable std::mutex free_mu_;
  uint64_t free_bits_[kMaxSlots / 64] = {};
  size_t free_count_ = 0;
  // Process-local (the one-worker-per-object calls): the generation each
  // worker index started under here, and the lap of each slot popped here
  // and not yet committed (kNoLap: none). Relaxed atomics: only the thread
  // serving a worker touches its entries, but a test may share one object.
  std::unique_ptr<std::atomic<uint64_t>[]> local_generation_;
  std::unique_ptr<std::atomic<uint64_t>[]> local_lap_;
  // Process-local (main only): the consumer side of the completion queue.
  // cq_head_: the oldest position not yet taken; cq_taken_[pos % capacity]:
  // taken out of order while an older position is still unwritten;
  // ready_lap_[slot]: the lap under which the slot was seen READY (kNoLap:
  // none), re-checked against the state word at every use; rescan_due_: an
  // entry may be missing; rescanned_deaths_: deaths counted at the last
  // rescan; rescans_: rescan_count(). All guarded by cq_mu_.
  mutable std::mutex cq_mu_;
  uint32_t cq_head_ = 0;
  std::unique_ptr<bool[]> cq_taken_;
  std::unique_ptr<uint64_t[]> ready_lap_;
  bool rescan_due_ = false;
  uint64_t rescanned_deaths_ = 0;
  uint64_t rescans_ = 0;
  // Main only (null in workers). Declared last: destroyed (its thread
  // joined) before the mapping its wake-ups write to.
  std::unique_ptr<DeathWatch> watch_;
};

// Layout arithmetic, shared by create() and the tests.
size_t ring_payload_offset(uint32_t num_slots, uint32_t num_workers);

}  // namespace fastload
