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

namespace py = pybind11;
using fastload::CommitResult;
using fastload::Ring;
using fastload::SlotResult;
using fastload::TaskRef;
using fastload::WaitResult;

namespace {

// A writable byte range of the ring exposed through the buffer protocol.
// It keeps the mapping alive (shared_ptr<Ring>); when it is a slot lease,
// its destruction — i.e. the death of the last tensor or array viewing it —
// hands the slot back to the workers, or to `on_release(slot)` when one was
// given (pinned memory: the slot must wait for device copies still reading
// it; that callback calls Ring.release later).
class Region {
 public:
  Region(std::shared_ptr<Ring> ring, char* ptr, size_t len, int64_t leased_slot,
         py::object on_release = py::none())
      : ring_(std::move(ring)),
        ptr_(ptr),
        len_(len),
        leased_slot_(leased_slot),
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
      ring_->release(slot);
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
  std::shared_ptr<Ring> ring_;
  char* ptr_;
  size_t len_;
  int64_t leased_slot_;
  pid_t owner_pid_;
  py::object on_release_;
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

  py::class_<Ring, std::shared_ptr<Ring>>(m, "Ring")
      .def_static("create", &Ring::create, py::arg("num_slots"), py::arg("num_workers"),
                  py::arg("slot_bytes"), py::arg("force_shm") = false,
                  "Main process: a new ring in a new shared-memory segment.")
      .def_static("attach", &Ring::attach, py::arg("fd"),
                  "Worker: map the ring behind fd (ownership of fd is taken).")
      .def_property_readonly("num_slots", &Ring::num_slots)
      .def_property_readonly("num_workers", &Ring::num_workers)
      .def_property_readonly("slot_bytes", &Ring::slot_bytes)
      .def_property_readonly("fd", &Ring::fd)
      .def_property_readonly("backend",
                             [](const Ring& r) {
                               return r.backend() == fastload::SegmentBackend::Memfd ? "memfd"
                                                                                     : "posix_shm";
                             })
      .def("close_fd", &Ring::close_fd)
      .def("state", &Ring::state, py::arg("slot"))
      .def("lap", &Ring::lap, py::arg("slot"),
           "How many times the slot was assigned (a debug view).")
      .def("payload_region",
           [](const std::shared_ptr<Ring>& r) {
             return std::make_shared<Region>(r, r->payload_base(), r->payload_bytes(), -1);
           },
           "All slot payloads as one writable buffer (slot k starts at k * slot_bytes).")
      // main process
      .def("pop_free_slot",
           [](Ring& r, bool highest) -> py::object {
             uint32_t s;
             if (!r.pop_free_slot(&s, highest)) return py::none();
             return py::int_(s);
           },
           py::arg("highest") = false,
           "The lowest free slot (the highest with highest=True, for tasks that "
           "write no batch), or None.")
      .def("free_slot_count", &Ring::free_slot_count)
      .def("trim_free_slot", &Ring::trim_free_slot, py::arg("slot"), py::arg("keep"),
           "Give the pages of a free slot past its first `keep` bytes back to the kernel "
           "(memfd segments only); returns the bytes released.")
      .def("push_free_slot", &Ring::push_free_slot, py::arg("slot"),
           "Put back a slot from pop_free_slot() that was never assigned.")
      .def("assign",
           [](Ring& r, uint32_t slot, uint64_t seq, uint32_t worker, py::buffer task) {
             py::buffer_info info = task.request();
             r.assign(slot, seq, worker, info.ptr,
                      static_cast<size_t>(info.size * info.itemsize));
           },
           py::arg("slot"), py::arg("seq"), py::arg("worker"), py::arg("task"))
      .def("wait_ready",
           [](Ring& r, uint32_t slot, uint64_t seq, double timeout_s) {
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
           [](Ring& r, const std::vector<uint32_t>& slots, const std::vector<uint64_t>& seqs,
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
      .def("watch_worker", &Ring::watch_worker, py::arg("worker"), py::arg("fd"),
           "Watch worker's life through fd (a pidfd; duplicated): its death wakes\n"
           "wait_ready/wait_any, which answer WORKER_DIED until the worker is\n"
           "unwatched or watched again.")
      .def("unwatch_worker", &Ring::unwatch_worker, py::arg("worker"))
      .def("dead_workers", &Ring::dead_workers,
           "Watched workers whose death was seen and not yet acted on.")
      .def("rescan_count", &Ring::rescan_count,
           "How many times the main process read every slot instead of the completion "
           "queue (a debug view).")
      .def("is_ready", &Ring::is_ready, py::arg("slot"), py::arg("seq"))
      .def("result",
           [](const Ring& r, uint32_t slot) {
             SlotResult res = r.result(slot);
             return py::make_tuple(res.kind, res.data_len, res.meta_offset, res.meta_len,
                                   res.make_ns);
           },
           py::arg("slot"),
           "(kind, data_len, meta_offset, meta_len, make_ns) of a READY slot; make_ns:\n"
           "the nanoseconds the worker said it spent making the result.")
      .def("lease",
           [](const std::shared_ptr<Ring>& r, uint32_t slot, size_t nbytes,
              py::object on_release) {
             if (nbytes > r->slot_bytes()) throw std::out_of_range("lease longer than a slot");
             if (!on_release.is_none() && !PyCallable_Check(on_release.ptr()))
               throw py::type_error("on_release must be callable or None");
             r->lease(slot);
             return std::make_shared<Region>(r, r->payload(slot), nbytes,
                                             static_cast<int64_t>(slot), std::move(on_release));
           },
           py::arg("slot"), py::arg("nbytes"), py::arg("on_release") = py::none(),
           "READY -> LEASED; when the returned Region dies the slot is freed, or\n"
           "on_release(slot) is called instead (it must call release(slot) later).")
      .def("release", &Ring::release, py::arg("slot"))
      .def("shutdown", &Ring::shutdown)
      .def("is_shutdown", &Ring::is_shutdown)
      .def("reset_worker", &Ring::reset_worker, py::arg("worker"))
      .def("reclaim",
           [](Ring& r, uint32_t slot) {
             return r.reclaim(slot) != fastload::ReclaimResult::NotInFlight;
           },
           py::arg("slot"),
           "ASSIGNED/WRITING/COMMITTING -> FREE (off the free slots): True if the\n"
           "slot was in flight; its worker's late commit() is then refused.")
      .def("worker_pid", &Ring::worker_pid, py::arg("worker"))
      .def("worker_progress", &Ring::worker_progress, py::arg("worker"))
      .def("worker_current_seq",
           [](const Ring& r, uint32_t w) -> py::object {
             uint64_t s = r.worker_current_seq(w);
             if (s == fastload::kNoSeq) return py::none();
             return py::int_(s);
           },
           py::arg("worker"))
      // worker process
      .def("worker_started",
           [](Ring& r, uint32_t worker, uint32_t pid) { r.worker_started(worker, pid); },
           py::arg("worker"), py::arg("pid"))
      .def("next_task",
           [](Ring& r, uint32_t worker, double timeout_s) {
             WaitResult res;
             TaskRef t{0, 0, 0, 0};
             {
               py::gil_scoped_release nogil;
               res = r.next_task(worker, timeout_ns(timeout_s), &t);
             }
             check_signals();
             return py::make_tuple(res, t.slot, t.seq, t.task_len);
           },
           py::arg("worker"), py::arg("timeout"),
           "(WaitResult, slot, seq, task_len); slot fields are valid only with READY.")
      .def("commit",
           [](Ring& r, uint32_t slot, uint32_t kind, uint64_t data_len, uint64_t meta_offset,
              uint64_t meta_len, uint64_t make_ns) {
             return r.commit(slot, SlotResult{kind, data_len, meta_offset, meta_len, make_ns});
           },
           py::arg("slot"), py::arg("kind"), py::arg("data_len"), py::arg("meta_offset"),
           py::arg("meta_len"), py::arg("make_ns") = 0,
           "WRITING -> READY for the task this process took from `slot`. RECLAIMED:\n"
           "main took the slot back first (it believed this worker dead); the\n"
           "result is dropped and nothing was written to the slot's header.");
}
