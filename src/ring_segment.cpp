// fastload/src/ring_segment.cpp — the ring's segment: its layout (where the
// header, the completion queue, the worker queues, the slot headers and the
// payloads lie), creating it (main) and attaching to it (a worker, with every
// field of the header checked), and the accessors both sides index it with.
// The protocol is described in ring.h.

#include "ring_segment.h"

#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#include "ring_detail.h"

namespace fastload {

using namespace detail;  // NOLINT: the helpers shared by the ring's files

size_t ring_payload_offset(uint32_t num_slots, uint32_t num_workers) {
  size_t off = align_up(sizeof(ShmHeader), kCacheLine);
  off += sizeof(ShmCompletions);
  off += sizeof(ShmWorker) * num_workers;
  off += sizeof(ShmSlot) * num_slots;
  return align_up(off, kPayloadAlign);
}

RingSegment::RingSegment(Segment seg)
    : seg_(std::move(seg)),
      base_(static_cast<char*>(seg_.data())),
      hdr_(reinterpret_cast<ShmHeader*>(base_)) {}

std::shared_ptr<RingSegment> RingSegment::create(uint32_t num_slots, uint32_t num_workers,
                                                 uint64_t slot_bytes, bool force_shm) {
  if (num_slots == 0 || num_slots > kMaxSlots)
    throw std::invalid_argument("fastload: num_slots must be in [1, " + str(kMaxSlots) +
                                "], got " + str(num_slots));
  if (num_workers == 0 || num_workers > kMaxWorkers)
    throw std::invalid_argument("fastload: num_workers must be in [1, " + str(kMaxWorkers) +
                                "], got " + str(num_workers));
  if (slot_bytes == 0) throw std::invalid_argument("fastload: slot_bytes must be positive");
  // 2^40 bytes per slot: far beyond any machine, and keeps the sums below
  // from overflowing.
  if (slot_bytes > (uint64_t{1} << 40))
    throw std::invalid_argument("fastload: slot_bytes of " + str(slot_bytes) + " is too large");
  slot_bytes = align_up(slot_bytes, kPayloadAlign);
  const size_t payload_off = ring_payload_offset(num_slots, num_workers);
  const size_t total = payload_off + static_cast<size_t>(slot_bytes) * num_slots;

  Segment seg = Segment::create(total, force_shm);
  char* base = static_cast<char*>(seg.data());
  // The segment is fresh and zero-filled; construct the shared structs in it.
  auto* hdr = new (base) ShmHeader{};
  hdr->magic = kRingMagic;
  hdr->version = kRingVersion;
  hdr->header_bytes = sizeof(ShmHeader);
  hdr->num_slots = num_slots;
  hdr->num_workers = num_workers;
  hdr->slot_bytes = slot_bytes;
  hdr->total_bytes = total;
  hdr->completions_offset = align_up(sizeof(ShmHeader), kCacheLine);
  hdr->completion_capacity = kCompletionCapacity;
  hdr->workers_offset = hdr->completions_offset + sizeof(ShmCompletions);
  hdr->slots_offset = hdr->workers_offset + sizeof(ShmWorker) * num_workers;
  hdr->payload_offset = payload_off;
  auto* cq = new (base + hdr->completions_offset) ShmCompletions{};
  // Each cell stamped with its position one lap back: none looks written
  // (a zero cell would pass for position 0's entry).
  for (uint32_t i = 0; i < kCompletionCapacity; ++i)
    store_relaxed(cq->cells[i], completion_entry(i - kCompletionCapacity, 0, 0));
  auto* workers = reinterpret_cast<ShmWorker*>(base + hdr->workers_offset);
  for (uint32_t w = 0; w < num_workers; ++w) {
    new (&workers[w]) ShmWorker{};
    store_relaxed(workers[w].current_seq, kNoSeq);
  }
  auto* slots = reinterpret_cast<ShmSlot*>(base + hdr->slots_offset);
  for (uint32_t s = 0; s < num_slots; ++s) new (&slots[s]) ShmSlot{};  // FREE, lap 0
  // Publishing happens when the fd reaches a worker (a syscall, which orders
  // these writes before anything the worker reads).
  return std::shared_ptr<RingSegment>(new RingSegment(std::move(seg)));
}

std::shared_ptr<RingSegment> RingSegment::attach(int fd) {
  Segment seg = Segment::attach(fd);
  const size_t size = seg.size();
  auto bad = [&](const std::string& what) {
    return std::runtime_error("fastload: cannot attach the ring: " + what);
  };
  if (size < sizeof(ShmHeader))
    throw bad("the segment (" + str(size) + " bytes) is too small to hold a ring header");
  const auto* hdr = static_cast<const ShmHeader*>(seg.data());
  if (hdr->magic != kRingMagic) throw bad("the segment is not a fastload ring (bad magic)");
  if (hdr->version != kRingVersion || hdr->header_bytes != sizeof(ShmHeader))
    throw bad("ring layout version " + str(hdr->version) + " (header " + str(hdr->header_bytes) +
              " bytes) but this build uses version " + str(kRingVersion) + " (" +
              str(sizeof(ShmHeader)) + " bytes): two fastload builds in one job?");
  if (hdr->num_slots == 0 || hdr->num_slots > kMaxSlots)
    throw bad("num_slots " + str(hdr->num_slots) + " is not in [1, " + str(kMaxSlots) + "]");
  if (hdr->num_workers == 0 || hdr->num_workers > kMaxWorkers)
    throw bad("num_workers " + str(hdr->num_workers) + " is not in [1, " + str(kMaxWorkers) + "]");
  if (hdr->slot_bytes == 0 || hdr->slot_bytes % kPayloadAlign != 0 ||
      hdr->slot_bytes > (uint64_t{1} << 40))
    throw bad("slot_bytes " + str(hdr->slot_bytes) + " is not a positive multiple of " +
              str(kPayloadAlign));
  if (hdr->completion_capacity != kCompletionCapacity)
    throw bad("completion queue of " + str(hdr->completion_capacity) +
              " entries but this build uses " + str(kCompletionCapacity));
  const uint64_t completions_off = align_up(sizeof(ShmHeader), kCacheLine);
  const uint64_t workers_off = completions_off + sizeof(ShmCompletions);
  const uint64_t slots_off = workers_off + sizeof(ShmWorker) * hdr->num_workers;
  const uint64_t payload_off = ring_payload_offset(hdr->num_slots, hdr->num_workers);
  if (hdr->completions_offset != completions_off || hdr->workers_offset != workers_off ||
      hdr->slots_offset != slots_off ||
      hdr->payload_offset != payload_off)
    throw bad("the header's offsets do not match its geometry (corrupt header)");
  // No overflow: slot_bytes <= 2^40 and num_slots <= 1024.
  const uint64_t total = payload_off + hdr->slot_bytes * hdr->num_slots;
  if (hdr->total_bytes != total || total != size)
    throw bad("the header says " + str(hdr->total_bytes) + " bytes (geometry: " + str(total) +
              ") but the segment has " + str(size));
  return std::shared_ptr<RingSegment>(new RingSegment(std::move(seg)));
}

ShmSlot& RingSegment::slot(uint32_t i) const {
  return reinterpret_cast<ShmSlot*>(base_ + hdr_->slots_offset)[i];
}

ShmCompletions& RingSegment::completions() const {
  return *reinterpret_cast<ShmCompletions*>(base_ + hdr_->completions_offset);
}

ShmWorker& RingSegment::worker(uint32_t i) const {
  return reinterpret_cast<ShmWorker*>(base_ + hdr_->workers_offset)[i];
}

void RingSegment::check_slot(uint32_t i) const {
  if (i >= hdr_->num_slots)
    throw std::out_of_range("fastload: slot " + str(i) + " out of range");
}

void RingSegment::check_worker(uint32_t i) const {
  if (i >= hdr_->num_workers)
    throw std::out_of_range("fastload: worker " + str(i) + " out of range");
}

char* RingSegment::payload(uint32_t s) const {
  check_slot(s);
  return payload_base() + static_cast<size_t>(hdr_->slot_bytes) * s;
}

SlotState RingSegment::state(uint32_t s) const {
  check_slot(s);
  return word_state(load_acquire(slot(s).state));
}

uint64_t RingSegment::lap(uint32_t s) const {
  check_slot(s);
  return word_lap(load_acquire(slot(s).state));
}

bool RingSegment::is_shutdown() const { return load_acquire(hdr_->shutdown) != 0; }

}  // namespace fastload
