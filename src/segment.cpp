#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>

namespace fastload {

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) reset(o.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    addr_ = o.addr_;
    len_ = o.len_;
    o.addr_ = nullptr;
    o.len_ = 0;
  }
  return *this;
}

void Mapping::reset() {
  if (addr_ != nullptr) ::munmap(addr_, len_);
  addr_ = nullptr;
  len_ = 0;
}

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

Mapping map_fd(int fd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw std::runtime_error("fastload: mmap of a " + mib(bytes) +
                             " shared-memory segment failed: " + errno_text(err));
  }
  return Mapping(p, bytes);
}

UniqueFd open_memfd() {
#ifdef SYS_memfd_create
  int fd = static_cast<int>(::syscall(SYS_memfd_create, "fastload-ring", 1U /*MFD_CLOEXEC*/));
  return UniqueFd(fd);  // -1 when the kernel lacks memfd (ENOSYS): caller falls back
#else
  return UniqueFd(-1);
#endif
}

UniqueFd open_posix_shm(size_t bytes) {
  std::random_device rd;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char name[96];
    std::snprintf(name, sizeof name, "/fastload-%d-%08x%08x%08x", static_cast<int>(::getpid()),
                  rd(), rd(), rd());
    int fd = ::shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST) continue;
      int err = errno;
      throw std::runtime_error("fastload: shm_open failed: " + errno_text(err) +
                               " (is /dev/shm mounted and writable?)");
    }
    // Unlinked at once: the name never outlives this call, so no process
    // death can leave an entry in /dev/shm; the fd keeps the memory.
    ::shm_unlink(name);
    UniqueFd owned(fd);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      throw std::runtime_error("fastload: ftruncate of the shared-memory segment failed: " +
                               errno_text(err));
    }
    int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      throw std::runtime_error(
          "fastload: cannot reserve " + mib(bytes) + " in /dev/shm (" + errno_text(rc) +
          "). /dev/shm is too small (Docker's default is 64 MB): run the container with "
          "--shm-size, or lower prefetch_factor/num_workers/slot_bytes.");
    }
    return owned;
  }
  throw std::runtime_error("fastload: could not find a free name for a shared-memory segment");
}

}  // namespace

Segment Segment::create(size_t bytes, bool force_shm) {
  if (bytes == 0) throw std::invalid_argument("fastload: a segment needs a non-zero size");
  UniqueFd fd;
  SegmentBackend backend = SegmentBackend::Memfd;
  if (!force_shm) fd = open_memfd();
  if (fd.get() >= 0) {
    if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
      int err = errno;
      throw std::runtime_error("fastload: cannot size a memfd segment to " + mib(bytes) + ": " +
                               errno_text(err));
    }
  } else {
    backend = SegmentBackend::PosixShm;
    fd = open_posix_shm(bytes);
  }
  Mapping map = map_fd(fd.get(), bytes);
  return Segment(std::move(fd), std::move(map), backend);
}

Segment Segment::attach(int raw_fd) {
  UniqueFd fd(raw_fd);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    int err = errno;
    throw std::runtime_error("fastload: fstat of a segment fd failed: " + errno_text(err));
  }
  if (st.st_size <= 0) throw std::runtime_error("fastload: segment fd has no size");
  Mapping map = map_fd(fd.get(), static_cast<size_t>(st.st_size));
  return Segment(std::move(fd), std::move(map), SegmentBackend::Memfd);
}

}  // namespace fastload
