// fastload._core — thin pybind11 bindings over the C++ ring (src/).
// Logic lives in src/; this file converts types, releases the GIL around
// waits and ties slot lifetimes to Python buffer objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>
#include <vector>

#include "ring.h"
#include "ring_main.h"
#include "ring_segment.h"
#include "ring_worker.h"
#include "sync.h"

namespace py = pybind11;
using fastload::CommitResult;
using fastload::MainRing;
using fastload::RingSegment;
using fastload::SlotResult;
using fastload::TaskRef;
using fastload::WaitResult;
using fastload::WorkerRing;

namespace {

// A writable byte range of the ring exposed through the buffer protocol.
// It keeps the mapping alive (shared_ptr<RingSegment>); when it is a slot
// lease, it also holds the main side that leased it, and its destruction —
// i.e. the death of the last tensor or array viewing it — hands the slot
// back to the workers, or to `on_release(slot)` when one was given (pinned
// memory: the slot must wait for device copies still reading it; that
// callback calls Ring.release later).
class Region {
 public:
  // A plain view of the mapping: no slot to give back.
  Region(std::shared_ptr<RingSegment> mapping, char* ptr, size_t len)
      : mapping_(std::move(mapping)), ptr_(ptr), len_(len), owner_pid_(::getpid()) {}
  // A lease of `slot` from `lessor`.
  Region(std::shared_ptr<MainRing> lessor, uint32_t slot, size_t len, py::object on_release)
      : mapping_(lessor->segment()),
        lessor_(std::move(lessor)),
        ptr_(mapping_->payload(slot)),
        len_(len),
        leased_slot_(static_cast<int64_t>(slot)),
        owner_pid_(::getpid()),
        on_release_(std::move(on_release)) {}
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  // Runs when the Python wrapper dies, so the GIL is held. Never throws:
  // a failure is reported as an unraisable exception.
  ~Region() {
    if (leased_slot_ < 0 || ::getpid() != owner_pid_) return;
    const auto slot = static_cast<uint32_t>(leased_slot_);
    if (!on_release_.is_none()) {
      try {
        on_release_(slot);
        return;
      } catch (py::error_already_set& e) {
        // A destructor cannot raise: report it, and free the slot here so
        // it is not lost.
        e.discard_as_unraisable("fastload: slot release callback");
      }
    }
    try {
      lessor_->release(slot);
    } catch (const std::exception& e) {
      py::error_scope keep;  // an exception already in flight survives this report
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(nullptr);
    }
  }
  char* ptr() const { return ptr_; }
  size_t size() const { return len_; }
  int64_t leased_slot() const { return leased_slot_; }
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(ptr_); }

 private:
  std::shared_ptr<RingSegment> mapping_;
  std::shared_ptr<MainRing> lessor_;  // leases only
  char* ptr_;
  size_t len_;
  int64_t leased_slot_ = -1;
  pid_t owner_pid_;
  py::object on_release_ = py::none();
};

// Python timeouts are seconds as floats: negative is a poll, +inf or any
// huge value waits forever (sync::seconds_to_ns saturates), NaN is an error.
int64_t timeout_ns(double timeout_s) {
  if (std::isnan(timeout_s)) throw py::value_error("fastload: timeout must be a number, got nan");
  return fastload::sync::seconds_to_ns(timeout_s);
}

// After a wait that may have been cut short by a signal: let Python raise
// KeyboardInterrupt (or whatever the handler raises) now.
void check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// What both sides read of the mapping (RingSegment): geometry, all payloads
// as one buffer, and the debug views of a slot.
template <class Side>
void def_segment_views(py::class_<Side, std::shared_ptr<Side>>& cls) {
  cls.def_property_readonly("num_slots", [](const Side& r) { return r.segment()->num_slots(); })
      .def_property_readonly("num_workers",
                             [](const Side& r) { return r.segment()->num_workers(); })
      .def_property_readonly("slot_bytes", [](const Side& r) { return r.segment()->slot_bytes(); })
      .def("state", [](const Side& r, uint32_t slot) { return r.segment()->state(slot); },
           py::arg("slot"))
      .def("lap", [](const Side& r, uint32_t slot) { return r.segment()->lap(slot); },
           py::arg("slot"), "How many times the slot was assigned (a debug view).")
      .def("payload_region",
           [](const Side& r) {
             const std::shared_ptr<RingSegment>& seg = r.segment();
             return std::make_shared<Region>(seg, seg->payload_base(), seg->payload_bytes());
           },
           "All slot payloads as one writable buffer (slot k starts at k * slot_bytes).");
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "fastload's C++ core: a shared-memory ring of batch slots (see src/ring.h).";
  m.attr("MAX_SLOTS") = fastload::kMaxSlots;
  m.attr("MAX_WORKERS") = fastload::kMaxWorkers;
  m.attr("PAYLOAD_ALIGN") = fastload::kPayloadAlign;

  py::enum_<WaitResult>(m, "WaitResult")
      .value("READY", WaitResult::Ready)
      .value("TIMED_OUT", WaitResult::TimedOut)
      .value("SHUTDOWN", WaitResult::Shutdown)
      .value("WORKER_DIED", WaitResult::WorkerDied);

  py::enum_<fastload::SlotState>(m, "SlotState")
      .value("FREE", fastload::SlotState::Free)
      .value("ASSIGNED", fastload::SlotState::Assigned)
      .value("WRITING", fastload::SlotState::Writing)
      .value("READY", fastload::SlotState::Ready)
      .value("LEASED", fastload::SlotState::Leased)
      .value("COMMITTING", fastload::SlotState::Committing);

  py::enum_<CommitResult>(m, "CommitResult")
      .value("COMMITTED", CommitResult::Committed)
      .value("RECLAIMED", CommitResult::Reclaimed);

  py::class_<Region, std::shared_ptr<Region>>(m, "Region", py::buffer_protocol())
      .def_buffer([](Region& r) {
        return py::buffer_info(r.ptr(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {1}, /*readonly=*/false);
      })
      .def("__len__", &Region::size)
      .def_property_readonly("address", &Region::address)
      .def_property_readonly("leased_slot", &Region::leased_slot);

  // The main process's side (MainRing): made by create(), never attached.
  py::class_<MainRing, std::shared_ptr<MainRing>> ring(
      m, "Ring", "The main process's side of a ring (src/ring_main.h); workers use WorkerRing.");
  ring.def_static("create", &MainRing::create, py::arg("num_slots"), py::arg("num_workers"),
                  py::arg("slot_bytes"), py::arg("force_shm") = false,
                  "A new ring in a new shared-memory segment.");
  def_segment_views(ring);
  ring.def_property_readonly("fd", [](const MainRing& r) { return r.segment()->fd(); },
                             "The segment's fd, to hand to workers (WorkerRing.attach).")
      .def_property_readonly("backend",
                             [](const MainRing& r) {
                               return r.segment()->backend() == fastload::SegmentBackend::Memfd
                                          ? "memfd"
                                          : "posix_shm";
                             })
      .def("close_fd", [](MainRing& r) { r.segment()->close_fd(); })
      .def("pop_free_slot",
           [](MainRing& r, bool highest) -> py::object {
             uint32_t s;
             if (!r.pop_free_slot(&s, highest)) return py::none();
             return py::int_(s);
           },
           py::arg("highest") = false,
           "The lowest free slot (the highest with highest=True, for tasks that "
           "write no batch), or None.")
      .def("free_slot_count", &MainRing::free_slot_count)
      .def("trim_free_slot", &MainRing::trim_free_slot, py::arg("slot"), py::arg("keep"),
           "Give the pages of a free slot past its first `keep` bytes back to the kernel "
           "(memfd segments only); returns the bytes released.")
      .def("push_free_slot", &MainRing::push_free_slot, py::arg("slot"),
           "Put back a slot from pop_free_slot() that was never assigned.")
      .def("assign",
           [](MainRing& r, uint32_t slot, uint64_t seq, uint32_t worker, py::buffer task) {
             py::buffer_info info = task.request();
             r.assign(slot, seq, worker, info.ptr,
                      static_cast<size_t>(info.size * info.itemsize));
           },
           py::arg("slot"), py::arg("seq"), py::arg("worker"), py::arg("task"))
      .def("wait_ready",
           [](MainRing& r, uint32_t slot, uint64_t seq, double timeout_s) {
             WaitResult res;
             {
               py::gil_scoped_release nogil;
               res = r.wait_ready(slot, seq, timeout_ns(timeout_s));
             }
             check_signals();
             return res;
           },
           py::arg("slot"), py::arg("seq"), py::arg("timeout"))
      .def("wait_any",
           [](MainRing& r, const std::vector<uint32_t>& slots, const std::vector<uint64_t>& seqs,
              double timeout_s) {
             if (slots.size() != seqs.size())
               throw std::invalid_argument("slots and seqs differ in length");
             WaitResult res;
             size_t which = 0;
             {
               py::gil_scoped_release nogil;
               res = r.wait_any(slots.data(), seqs.data(), slots.size(), timeout_ns(timeout_s),
                                &which);
             }
             check_signals();
             return py::make_tuple(res, res == WaitResult::Ready ? py::int_(which)
                                                                 : py::int_(-1));
           },
           py::arg("slots"), py::arg("seqs"), py::arg("timeout"))
      .def("watch_worker", &MainRing::watch_worker, py::arg("worker"), py::arg("fd"),
           "Watch worker's life through fd (a pidfd; duplicated): its death wakes\n"
           "wait_ready/wait_any, which answer WORKER_DIED until the worker is\n"
           "unwatched or watched again.")
      .def("unwatch_worker", &MainRing::unwatch_worker, py::arg("worker"))
      .def("dead_workers", &MainRing::dead_workers,
           "Watched workers whose death was seen and not yet acted on.")
      .def("rescan_count", &MainRing::rescan_count,
           "How many times the main process read every slot instead of the completion "
           "queue (a debug view).")
      .def("is_ready", &MainRing::is_ready, py::arg("slot"), py::arg("seq"))
      .def("result",
           [](const MainRing& r, uint32_t slot) {
             SlotResult res = r.result(slot);
             return py::make_tuple(res.kind, res.data_len, res.meta_offset, res.meta_len,
                                   res.make_ns);
           },
           py::arg("slot"),
           "(kind, data_len, meta_offset, meta_len, make_ns) of a READY slot; make_ns:\n"
           "the nanoseconds the worker said it spent making the result.")
      .def("lease",
           [](const std::shared_ptr<MainRing>& r, uint32_t slot, size_t nbytes,
              py::object on_release) {
             if (nbytes > r->segment()->slot_bytes())
               throw std::out_of_range("lease longer than a slot");
             if (!on_release.is_none() && !PyCallable_Check(on_release.ptr()))
               throw py::type_error("on_release must be callable or None");
             r->lease(slot);
             return std::make_shared<Region>(r, slot, nbytes, std::move(on_release));
           },
           py::arg("slot"), py::arg("nbytes"), py::arg("on_release") = py::none(),
           "READY -> LEASED; when the returned Region dies the slot is freed, or\n"
           "on_release(slot) is called instead (it must call release(slot) later).")
      .def("release", &MainRing::release, py::arg("slot"))
      .def("shutdown", &MainRing::shutdown)
      .def("is_shutdown", &MainRing::is_shutdown)
      .def("reset_worker", &MainRing::reset_worker, py::arg("worker"))
      .def("reclaim",
           [](MainRing& r, uint32_t slot) {
             return r.reclaim(slot) != fastload::ReclaimResult::NotInFlight;
           },
           py::arg("slot"),
           "ASSIGNED/WRITING/COMMITTING -> FREE (off the free slots): True if the\n"
           "slot was in flight; its worker's late commit() is then refused.")
      .def("worker_pid", &MainRing::worker_pid, py::arg("worker"))
      .def("worker_progress", &MainRing::worker_progress, py::arg("worker"))
      .def("worker_current_seq",
           [](const MainRing& r, uint32_t w) -> py::object {
             uint64_t s = r.worker_current_seq(w);
             if (s == fastload::kNoSeq) return py::none();
             return py::int_(s);
           },
           py::arg("worker"));

  // One worker's side (WorkerRing): attached in the worker process.
  py::class_<WorkerRing, std::shared_ptr<WorkerRing>> worker_ring(
      m, "WorkerRing",
      "One worker's side of a ring (src/ring_worker.h): attached from the fd of the\n"
      "main process's Ring; worker_started() once, then next_task() and commit().");
  worker_ring.def_static("attach", &WorkerRing::attach, py::arg("fd"),
                         "Map the ring behind fd (ownership of fd is taken), its header checked.");
  def_segment_views(worker_ring);
  worker_ring
      .def("worker_started", &WorkerRing::worker_started, py::arg("worker"), py::arg("pid"),
           "Announce worker `worker` (its pid, for the main process's watchdog) and\n"
           "serve it from now on; once per WorkerRing.")
      .def("next_task",
           [](WorkerRing& r, double timeout_s) {
             WaitResult res;
             TaskRef t{0, 0, 0, 0};
             {
               py::gil_scoped_release nogil;
               res = r.next_task(timeout_ns(timeout_s), &t);
             }
             check_signals();
             return py::make_tuple(res, t.slot, t.seq, t.task_len);
           },
           py::arg("timeout"),
           "(WaitResult, slot, seq, task_len) of this worker's next task; the slot\n"
           "fields are valid only with READY. SHUTDOWN also when the main process\n"
           "replaced this worker (reset_worker).")
      .def("commit",
           [](WorkerRing& r, uint32_t slot, uint32_t kind, uint64_t data_len, uint64_t meta_offset,
              uint64_t meta_len, uint64_t make_ns) {
             return r.commit(slot, SlotResult{kind, data_len, meta_offset, meta_len, make_ns});
           },
           py::arg("slot"), py::arg("kind"), py::arg("data_len"), py::arg("meta_offset"),
           py::arg("meta_len"), py::arg("make_ns") = 0,
           "WRITING -> READY for the task this worker took from `slot`. RECLAIMED:\n"
           "main took the slot back first (it believed this worker dead); the\n"
           "result is dropped and nothing was written to the slot's header.");
}
