// fastload/src/ring.h — the shared ring's layout and protocol: one segment =
// ShmHeader, the completion queue, the per-worker submission queues, the
// per-slot headers, then the slot payloads.
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
// died between READY and its push; see MainRing::wait_any).
// Every wait is a bounded futex wait that also watches the shutdown flag and,
// on the main side, the deaths of watched workers (DeathWatch, watch.h).
//
// One type per role, as liburing splits io_uring_sq from io_uring_cq; each
// process builds only its own role's state:
//   RingSegment (ring_segment.h)  one process's mapping of the segment: the
//                                 layout below, created or attached and
//                                 checked; shared by both sides.
//   MainRing (ring_main.h)        the main process's side: free slots,
//                                 assigning tasks, the completion reader and
//                                 its waits, leases, reclaims, shutdown, the
//                                 death watch.
//   WorkerRing (ring_worker.h)    one worker's side: its cursor on its
//                                 submission queue (next_task) and its commits.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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

// A task a worker took with WorkerRing::next_task(). `lap` names this
// assignment of the slot; the worker's commit succeeds only while the slot is
// still on that lap.
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

}  // namespace fastload
