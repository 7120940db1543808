// fastload/src/segment.h — one shared-memory segment: an fd and its mapping.
//
// Linux: a memfd (not limited by the size of the /dev/shm mount, gone when
// the last process holding it exits, even after SIGKILL). Fallback where
// memfd_create is missing (or forced, for tests): a POSIX shm object created
// O_EXCL with mode 0600 under an unguessable name, unlinked at once (so
// nothing is left in /dev/shm even if every process is killed), with all of
// its pages reserved up front so a full /dev/shm is an error here, never a
// SIGBUS later.
#pragma once

#include <cstddef>
#include <string>

namespace fastload {

// Owns one file descriptor. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  ~UniqueFd() { reset(); }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Owns one MAP_SHARED mapping. Move-only.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* addr, size_t len) : addr_(addr), len_(len) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept : addr_(o.addr_), len_(o.len_) {
    o.addr_ = nullptr;
    o.len_ = 0;
  }
  Mapping& operator=(Mapping&& o) noexcept;
  ~Mapping() { reset(); }
  void* data() const { return addr_; }
  size_t size() const { return len_; }
  void reset();

 private:
  void* addr_ = nullptr;
  size_t len_ = 0;
};

enum class SegmentBackend { Memfd, PosixShm };

class Segment {
 public:
  // Creates a new zero-filled segment of `bytes`. `force_shm` skips memfd
  // (used by tests of the fallback). Throws std::runtime_error with the size
  // wanted and the remedy when the memory cannot be had.
  static Segment create(size_t bytes, bool force_shm = false);
  // Maps an existing segment from an fd this process owns (takes ownership).
  static Segment attach(int fd);

  Segment(Segment&&) noexcept = default;
  Segment& operator=(Segment&&) noexcept = default;

  void* data() const { return map_.data(); }
  size_t size() const { return map_.size(); }
  int fd() const { return fd_.get(); }
  SegmentBackend backend() const { return backend_; }
  // Drops the fd; the mapping (and so the memory) lives on until unmapped.
  void close_fd() { fd_.reset(); }

 private:
  Segment(UniqueFd fd, Mapping map, SegmentBackend b)
      : fd_(std::move(fd)), map_(std::move(map)), backend_(b) {}
  UniqueFd fd_;
  Mapping map_;
  SegmentBackend backend_ = SegmentBackend::Memfd;
};

}  // namespace fastload
