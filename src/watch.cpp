#include "watch.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "sync.h"

namespace fastload {

using sync::load_acquire;
using sync::load_relaxed;
using sync::store_release;

namespace {

UniqueFd make_eventfd() {
  const int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "fastload: eventfd");
  return UniqueFd(fd);
}

// Every signal blocked on the calling thread while it lives; a thread
// started meanwhile inherits the mask.
class AllSignalsBlocked {
 public:
  AllSignalsBlocked() {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old_);
  }
  ~AllSignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }
  AllSignalsBlocked(const AllSignalsBlocked&) = delete;
  AllSignalsBlocked& operator=(const AllSignalsBlocked&) = delete;

 private:
  sigset_t old_;
};

}  // namespace

DeathWatch::DeathWatch(std::function<void()> wake)
    : wake_(std::move(wake)), owner_pid_(::getpid()) {}

DeathWatch::~DeathWatch() {
  if (::getpid() != owner_pid_) {
    // A forked copy: the thread is the owner's and does not exist here, and
    // the lock may have been held by it at the fork. Leak both.
    (void)thread_.release();
    return;
  }
  stop();
}

void DeathWatch::ping() {
  if (ping_fd_.get() < 0) return;  // no thread to wake
  const uint64_t one = 1;
  // EAGAIN (the counter is full) still leaves the thread a wake-up pending.
  ssize_t rc;
  do {
    rc = ::write(ping_fd_.get(), &one, sizeof one);
  } while (rc < 0 && errno == EINTR);
}

void DeathWatch::start_locked() {
  if (thread_ != nullptr || stopped_) return;
  ping_fd_ = make_eventfd();
  // The thread must never take a signal meant for Python: it is created with
  // every signal blocked (and inherits the mask).
  AllSignalsBlocked blocked;
  thread_ = std::make_unique<std::thread>(&DeathWatch::run, this);
}

void DeathWatch::watch(uint32_t key, int fd) {
  if (::getpid() != owner_pid_) return;
  UniqueFd mine(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (mine.get() < 0)
    throw std::system_error(errno, std::generic_category(),
                            "fastload: cannot watch worker " + std::to_string(key));
  std::lock_guard<std::mutex> g(mu_);
  if (stopped_) return;
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.dead) store_release(dead_count_, load_relaxed(dead_count_) - 1);
    retired_.push_back(std::move(it->second.fd));
    entries_.erase(it);
  }
  entries_.emplace(key, Entry{std::move(mine), next_generation_++, false});
  start_locked();
  ping();
}

void DeathWatch::unwatch(uint32_t key) {
  if (::getpid() != owner_pid_) return;
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (it->second.dead) store_release(dead_count_, load_relaxed(dead_count_) - 1);
  retired_.push_back(std::move(it->second.fd));
  entries_.erase(it);
  if (thread_ != nullptr) ping();
}

uint32_t DeathWatch::dead_count() const { return load_acquire(dead_count_); }

uint64_t DeathWatch::events() const { return load_acquire(events_); }

std::vector<uint32_t> DeathWatch::dead() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<uint32_t> out;
  for (const auto& kv : entries_)
    if (kv.second.dead) out.push_back(kv.first);
  return out;
}

void DeathWatch::stop() {
  if (::getpid() != owner_pid_) return;
  std::unique_ptr<std::thread> t;
  {
    std::lock_guard<std::mutex> g(mu_);
    stopped_ = true;
    t = std::move(thread_);
    // Read by the thread after every poll(); the ping wakes it to read it.
    store_release(stop_flag_, 1u);
    ping();
  }
  if (t != nullptr && t->joinable()) t->join();
  // No thread polls them any more: close every fd now rather than when the
  // ring goes (leases may keep it alive long after its pool stopped).
  std::lock_guard<std::mutex> g(mu_);
  entries_.clear();
  retired_.clear();
  ping_fd_.reset();
  store_release(dead_count_, 0u);
}

void DeathWatch::run() {
  std::vector<pollfd> fds;
  std::vector<std::pair<uint32_t, uint64_t>> polled;  // (key, generation) of fds[i + 1]
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      retired_.clear();  // none of them is in `fds` any more: close them now
      if (load_acquire(stop_flag_) != 0) return;
      fds.assign(1, pollfd{ping_fd_.get(), POLLIN, 0});
      polled.clear();
      for (const auto& kv : entries_) {
        if (kv.second.dead) continue;  // a pidfd stays readable: poll it no more
        fds.push_back(pollfd{kv.second.fd.get(), POLLIN, 0});
        polled.emplace_back(kv.first, kv.second.generation);
      }
    }
    const int rc = ::poll(fds.data(), fds.size(), -1);
    if (rc < 0) {
      if (errno != EINTR) ::usleep(10000);  // ENOMEM: try again, without spinning
      continue;
    }
    if (fds[0].revents != 0) {
      uint64_t n;
      while (::read(ping_fd_.get(), &n, sizeof n) > 0) {
      }
    }
    bool died = false;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;  // POLLIN (exited), or POLLHUP/POLLERR: gone too
        auto it = entries_.find(polled[i - 1].first);
        if (it == entries_.end() || it->second.generation != polled[i - 1].second ||
            it->second.dead)
          continue;  // replaced or unwatched meanwhile
        it->second.dead = true;
        store_release(dead_count_, load_relaxed(dead_count_) + 1);
        store_release(events_, load_relaxed(events_) + 1);
        died = true;
      }
    }
    if (died) wake_();
  }
}

}  // namespace fastload
