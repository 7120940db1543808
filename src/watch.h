// fastload/src/watch.h — the main process's watch over its workers' lives.
//
// A worker that dies (SIGKILL, the OOM killer, a crash in native code) can
// leave no word in the ring. Its pidfd (or any fd that becomes readable when
// the process is gone, such as multiprocessing's sentinel) can: DeathWatch
// polls those fds on a thread of its own and, when one fires, marks that
// worker dead and calls `wake`, which wakes the main process's wait on the
// ring (MainRing bumps its completion word and futex-wakes it). The wait then
// returns WorkerDied at once instead of the main process polling liveness.
//
// Why a thread and not poll() in the wait itself: the wait sleeps on a futex
// word that workers bump from other processes without any syscall of their
// own in the common case; a futex cannot be polled together with fds, and
// turning every commit into an eventfd write would cost each batch a
// syscall. A death is rare; a thread asleep in poll() costs nothing until it
// happens.
//
// The thread blocks every signal, so Ctrl-C always reaches a thread that
// runs Python (the main thread's futex wait returns EINTR). It starts with
// the first watch() and is joined by stop() or the destructor. In a process
// forked from the owner (which inherits this object but not the thread) the
// destructor touches neither the thread nor the lock, and leaks them.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "segment.h"

namespace fastload {

class DeathWatch {
 public:
  // `wake` runs on the watch thread after a death is recorded.
  explicit DeathWatch(std::function<void()> wake);
  ~DeathWatch();
  DeathWatch(const DeathWatch&) = delete;
  DeathWatch& operator=(const DeathWatch&) = delete;

  // Watches `fd` (duplicated here; the caller keeps its own) for worker
  // `key`, replacing what was watched for it, dead or not. Starts the thread
  // if it is not running; a no-op after stop() or outside the owner process.
  void watch(uint32_t key, int fd);
  // Stops watching `key` (a worker retired on purpose, or replaced).
  void unwatch(uint32_t key);
  // Watched keys whose fd fired and that were not unwatched or replaced
  // since. Level-triggered: a death stays reported until the caller acts on
  // it (restarts the worker, or gives up on the pool).
  uint32_t dead_count() const;
  std::vector<uint32_t> dead() const;
  // Deaths recorded so far, ever (a monotonic count: the ring rescans its
  // slots once per new death, see MainRing::wait_any).
  uint64_t events() const;
  // Joins the thread and closes every fd; later watch() calls are ignored.
  void stop();

 private:
  struct Entry {
    UniqueFd fd;
    uint64_t generation;  // tells a replaced entry from the one the thread polled
    bool dead;
  };
  void run();
  void start_locked();  // mu_ held
  void ping();          // wakes the thread so it re-reads entries_

  std::function<void()> wake_;
  const pid_t owner_pid_;
  mutable std::mutex mu_;
  std::map<uint32_t, Entry> entries_;  // mu_
  // fds replaced or unwatched while the thread may be polling them: closed by
  // the thread after its poll() returns, so no fd number it polls is reused.
  std::vector<UniqueFd> retired_;  // mu_
  uint64_t next_generation_ = 0;   // mu_
  bool stopped_ = false;           // mu_
  UniqueFd ping_fd_;  // eventfd: entries changed, or stop; while the thread runs (mu_)
  std::unique_ptr<std::thread> thread_;  // mu_ (start/stop)
  // The watch thread writes both under mu_ (store_release); the main
  // process's wait reads them without the lock (load_acquire), before it
  // sleeps and after every wake-up.
  std::atomic<uint32_t> dead_count_{0};
  std::atomic<uint64_t> events_{0};
  std::atomic<uint32_t> stop_flag_{0};  // stop(): the thread leaves its loop
};

}  // namespace fastload
