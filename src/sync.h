// fastload/src/sync.h — every atomic ordering primitive and futex call of the
// core lives here (as liburing's barrier.h does), so the rest of the code
// names *what* it orders and this file says *how*.
//
// The futex words live in a MAP_SHARED mapping of one file that several
// processes map, so the futex calls are the shared (non-PRIVATE) kind: the
// kernel keys them by (inode, offset), not by virtual address.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <ctime>

namespace fastload::sync {

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "futex words must be plain lock-free 32-bit atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "64-bit counters shared between processes must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "a futex word must have the layout of a uint32_t");

// Each helper below names what it orders; its comment says which operation
// on the other side it pairs with. Nothing outside this file spells a
// std::memory_order or a fence.

// Loads that must see everything the other side wrote before the release
// (store_release, bump_release or a successful cas_acq_rel) whose value they
// read: a slot's fields before its state word, a queue entry before the tail.
template <class T>
inline T load_acquire(const std::atomic<T>& a) {
  return a.load(std::memory_order_acquire);
}

// Stores that publish everything this side wrote before them to the other
// side's load_acquire (or cas_acq_rel) that reads the stored value.
template <class T>
inline void store_release(std::atomic<T>& a, T v) {
  a.store(v, std::memory_order_release);
}

// Loads that need no ordering: a value only this side writes (own
// counters), or a field whose hand-over is ordered by another atomic (a
// slot field read after the acquire of its state word, or before a
// cas_acq_rel that decides whether the read value is used).
template <class T>
inline T load_relaxed(const std::atomic<T>& a) {
  return a.load(std::memory_order_relaxed);
}

// Stores ordered by a later release of another atomic (slot fields before
// the state word's store_release/cas_acq_rel), or made before any other
// process can see the memory (construction of a fresh segment).
template <class T>
inline void store_relaxed(std::atomic<T>& a, T v) {
  a.store(v, std::memory_order_relaxed);
}

// Counter bumps that are also wake-up words (futex) or progress reports:
// release publishes what this side did before the bump to a load_acquire of
// the counter that sees the new value (the hang watchdog, a waiter's re-check).
template <class T>
inline T bump_release(std::atomic<T>& a) {
  return a.fetch_add(1, std::memory_order_release);
}

// A ticket: a fetch-and-add whose only job is to give each caller a
// different number (a position in the completion queue). It orders nothing;
// what the holder then writes at that position is published by its own
// store_release, which the reader pairs with a load_acquire.
template <class T>
inline T take_ticket(std::atomic<T>& a) {
  return a.fetch_add(1, std::memory_order_relaxed);
}

// State transitions of a slot and claims of a queue entry: succeeds only
// when `a` still holds `expected` (the state and lap the caller believes
// in), so of two sides racing for one transition exactly one wins. On
// success it acquires what the previous owner released with the value it
// replaces and releases this side's earlier writes to the next acquirer;
// on failure `expected` receives the current value (acquired).
template <class T>
inline bool cas_acq_rel(std::atomic<T>& a, T& expected, T desired) {
  return a.compare_exchange_strong(expected, desired, std::memory_order_acq_rel,
                                   std::memory_order_acquire);
}

// The waiter/waker handshake ("Dekker"): the waker stores the new value then
// reads the waiter flag; the waiter stores the flag then re-reads the value.
// Both pairs need a full fence between the store and the load, or each side
// can miss the other's store and the waiter sleeps through a wake-up.
//
// GCC >= 11 rejects std::atomic_thread_fence under -fsanitize=thread
// (-Wtsan, an error with -Werror) because TSan does not model fences. The
// fence is still needed and still executed (TSan's __tsan_atomic_thread_fence
// runs a full hardware barrier); TSan only derives no happens-before from it,
// which is harmless here: these fences order the sleep/wake handshake between
// atomics, never the hand-over of plain data (that is release/acquire).
#if defined(__SANITIZE_THREAD__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wtsan"
inline void full_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#pragma GCC diagnostic pop
#else
inline void full_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#endif

enum class FutexResult { Woken, ValueChanged, TimedOut, Interrupted };

// Sleeps while *word == expected, for at most timeout_ns (relative, on the
// monotonic clock). Spurious returns are allowed: callers re-check state.
inline FutexResult futex_wait(std::atomic<uint32_t>* word, uint32_t expected,
                              int64_t timeout_ns) {
  struct timespec ts;
  if (timeout_ns < 0) timeout_ns = 0;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000LL);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000LL);
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT,
                    expected, &ts, nullptr, 0);
  if (rc == 0) return FutexResult::Woken;
  switch (errno) {
    case EAGAIN: return FutexResult::ValueChanged;
    case ETIMEDOUT: return FutexResult::TimedOut;
    default: return FutexResult::Interrupted;  // EINTR: let the caller look at signals
  }
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX,
          nullptr, nullptr, 0);
}

inline int64_t monotonic_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// ---- timeouts -------------------------------------------------------------
// Every timeout becomes a Deadline here, once, with saturating arithmetic:
// INT64_MAX nanoseconds, a huge number of seconds or +infinity all mean
// "wait forever" and can never overflow into a deadline in the past.

constexpr int64_t kForeverNs = INT64_MAX;

// Seconds (Python's float timeouts) to nanoseconds, saturated: <= 0 is 0
// (poll), >= ~292 years and +inf are kForeverNs. NaN is 0; callers that can
// see a NaN reject it before calling (fastload._core raises ValueError).
inline int64_t seconds_to_ns(double seconds) {
  if (!(seconds > 0.0)) return 0;  // negative, zero or NaN
  // 9.2e9 s is just under INT64_MAX ns; the comparison is exact in double.
  if (seconds >= 9.2e9) return kForeverNs;
  return static_cast<int64_t>(seconds * 1e9);
}

// A point on the monotonic clock. after_ns() saturates, so a timeout of
// kForeverNs (or anything that would pass INT64_MAX) waits forever.
class Deadline {
 public:
  static Deadline after_ns(int64_t timeout_ns) {
    const int64_t now = monotonic_ns();
    if (timeout_ns < 0) timeout_ns = 0;
    return Deadline(timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns);
  }
  // Nanoseconds left, 0 once passed.
  int64_t left_ns() const {
    const int64_t left = at_ns_ - monotonic_ns();
    return left > 0 ? left : 0;
  }
  bool passed() const { return left_ns() == 0; }

 private:
  explicit Deadline(int64_t at_ns) : at_ns_(at_ns) {}
  int64_t at_ns_;
};

// Brief spinning before sleeping: a batch is usually ready within
// microseconds of the wake-up check when the ring is busy; when it is idle
// we fall through to a futex sleep and burn nothing.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace fastload::sync
