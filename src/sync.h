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

// Loads that must see everything the other side wrote before its matching
// store_release (a slot's fields before its state word).
template <class T>
inline T load_acquire(const std::atomic<T>& a) {
  return a.load(std::memory_order_acquire);
}

// Stores that publish everything this side wrote before them (slot fields
// before the state word that hands the slot to the other side).
template <class T>
inline void store_release(std::atomic<T>& a, T v) {
  a.store(v, std::memory_order_release);
}

// Values only this side writes and only this side reads back (own counters).
template <class T>
inline T load_relaxed(const std::atomic<T>& a) {
  return a.load(std::memory_order_relaxed);
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
