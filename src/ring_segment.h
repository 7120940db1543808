// fastload/src/ring_segment.h — one process's mapping of the ring's segment:
// creating it (main) or attaching to it (a worker, with every field of the
// header checked), and the accessors both sides index the shared structs of
// ring.h with. It holds no side's state: MainRing (ring_main.h) and
// WorkerRing (ring_worker.h) each keep a std::shared_ptr to one, and two
// sides in one process (threads in the tests) may share one mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ring.h"
#include "segment.h"

namespace fastload {

class RingSegment {
 public:
  // Main process: a new segment laid out for this geometry, every shared
  // struct constructed in it (slots FREE, queues empty). Throws
  // std::invalid_argument on bad geometry, std::runtime_error when the
  // memory cannot be had.
  static std::shared_ptr<RingSegment> create(uint32_t num_slots, uint32_t num_workers,
                                             uint64_t slot_bytes, bool force_shm = false);
  // Worker: maps the segment behind `fd` (takes ownership) and validates the
  // whole header (magic, version, geometry, offsets, size) against the
  // segment; std::runtime_error says which check failed.
  static std::shared_ptr<RingSegment> attach(int fd);

  RingSegment(const RingSegment&) = delete;
  RingSegment& operator=(const RingSegment&) = delete;

  uint32_t num_slots() const { return hdr_->num_slots; }
  uint32_t num_workers() const { return hdr_->num_workers; }
  uint64_t slot_bytes() const { return hdr_->slot_bytes; }
  int fd() const { return seg_.fd(); }
  SegmentBackend backend() const { return seg_.backend(); }
  // Drops this process's fd; the mapping lives on.
  void close_fd() { seg_.close_fd(); }
  char* payload(uint32_t slot) const;
  char* payload_base() const { return base_ + hdr_->payload_offset; }
  size_t payload_bytes() const { return static_cast<size_t>(hdr_->slot_bytes) * hdr_->num_slots; }
  // Debug views, readable from either side.
  SlotState state(uint32_t slot) const;
  uint64_t lap(uint32_t slot) const;  // how many times the slot was assigned
  bool is_shutdown() const;

  // The shared structs (ring.h), for the two sides' protocol code. Indices
  // are not checked here: callers check them first (check_slot/check_worker).
  ShmHeader& header() const { return *hdr_; }
  ShmSlot& slot(uint32_t i) const;
  ShmWorker& worker(uint32_t i) const;
  ShmCompletions& completions() const;
  // Throw std::out_of_range for an index past the geometry.
  void check_slot(uint32_t i) const;
  void check_worker(uint32_t i) const;

 private:
  explicit RingSegment(Segment seg);

  Segment seg_;
  char* base_;
  ShmHeader* hdr_;
};

// Layout arithmetic, shared by create() and attach()'s checks.
size_t ring_payload_offset(uint32_t num_slots, uint32_t num_workers);

}  // namespace fastload
