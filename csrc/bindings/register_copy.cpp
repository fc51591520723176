// The CUDA driver probe, host batches and the copy engine. NOTE [copy ordering] in
// core/copy_engine.h says how a job's two halves (submit, take) order the copies.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings/bindings.h"
#include "bindings/dlpack_export.h"
#include "bindings/gil_release.h"
#include "bindings/interruptible_wait.h"
#include "core/batch_pipeline.h"
#include "core/copy_engine.h"
#include "core/cuda_driver.h"
#include "core/dtype.h"
#include "core/errors.h"

namespace py = pybind11;

namespace pyloader {
namespace {

// The stream a submit() or take() orders against. Required with the CUDA backend: a silent
// default of 0 would be the legacy default stream, which does not order against torch's
// non-blocking streams. The CPU backend has no streams.
uintptr_t stream_arg(const CopyEngine& e, const std::optional<uintptr_t>& stream, const char* what) {
  if (stream) return *stream;
  if (std::string(e.backend_name()) == "cpu") return 0;
  throw std::invalid_argument(std::string("CopyEngine.") + what +
                              ": stream= is required with backend='cuda': pass the handle of the consumer's "
                              "current stream (torch.cuda.current_stream(device).cuda_stream)");
}

}  // namespace

void register_copy(py::module_& m) {
  m.def(
      "cuda_driver_error",
      []() -> py::object {
        std::string why;
        // The first call loads the driver and runs cuInit, which can take a while.
        const cuda::Driver* d = without_gil([&] { return cuda::driver(&why); });
        if (d) return py::none();
        return py::str(why);
      },
      "None when the CUDA driver (libcuda.so.1) loaded and sees a device, else why not.");

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(
      m, "CopyEngine", "A native thread that copies batches to their destination (NOTE [copy ordering]).")
      .def(py::init([](const std::string& backend, int device, size_t depth, std::shared_ptr<SlotPool> staging) {
             std::unique_ptr<CopyBackend> b;
             if (backend == "cpu")
               b = make_cpu_copy_backend();
             else if (backend == "cuda")
               b = without_gil([&] { return make_cuda_copy_backend(device, depth); });
             else
               throw std::invalid_argument("backend must be 'cpu' or 'cuda'");
             // Waits for the engine thread to start (it raises here if it cannot).
             return without_gil([&] { return std::make_shared<CopyEngine>(std::move(b), std::move(staging), depth); });
           }),
           py::kw_only(), py::arg("backend"), py::arg("device") = 0, py::arg("depth") = 2,
           py::arg("staging").none(false))
      .def(
          "submit",
          [](CopyEngine& e, const std::vector<std::tuple<uintptr_t, uintptr_t, size_t>>& segments,
             std::optional<uintptr_t> stream_opt, py::object source, bool stage, double timeout) {
            const uintptr_t stream = stream_arg(e, stream_opt, "submit");
            CopyJob job;
            job.stage = stage;
            job.segments.reserve(segments.size());
            for (const auto& [src, dst, bytes] : segments) {
              if (!stage && dst == 0 && bytes)
                throw std::invalid_argument("a segment without a destination needs stage=True");
              if (bytes && src == 0) throw std::invalid_argument("a segment has a null source");
              job.segments.push_back({reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst), bytes});
            }
            if (!source.is_none()) job.source = source.cast<Batch&>().slot;
            uint64_t ticket = 0;
            wait_interruptibly(
                [&](int64_t ms) { return e.submit(job, stream, ms, &ticket) == CopyEngine::Wait::kDone; }, timeout,
                "copy engine submit did not finish");
            return ticket;
          },
          py::arg("segments"), py::kw_only(), py::arg("stream") = py::none(), py::arg("source") = py::none(),
          py::arg("stage") = false, py::arg("timeout") = 0.0,
          "Queues copies [(src, dst, bytes)] ordered after the work queued on `stream` (required with "
          "backend='cuda') and returns a ticket. Waits until job ticket - depth's copies completed. "
          "`source` (a HostBatch) stays referenced until the copies completed; with stage=True the "
          "sources are packed into a staging slot first, and must stay alive until take().")
      .def(
          "take",
          [](CopyEngine& e, uint64_t ticket, std::optional<uintptr_t> stream_opt, double timeout) -> py::object {
            const uintptr_t stream = stream_arg(e, stream_opt, "take");
            CopyResult res;
            wait_interruptibly([&](int64_t ms) { return e.take(ticket, stream, ms, &res) == CopyEngine::Wait::kDone; },
                               timeout, "copy engine take did not finish");
            if (!res.staged) return py::none();
            py::list out;
            for (size_t i = 0; i < res.offsets.size(); ++i) {
              if (res.result[i])
                out.append(to_dlpack(res.base + res.offsets[i], {int64_t(res.bytes[i])},
                                     dlpack_dtype(uint8_t(DType::kUInt8)), res.staged));
              else
                out.append(py::none());
            }
            return out;
          },
          py::arg("ticket"), py::kw_only(), py::arg("stream") = py::none(), py::arg("timeout") = 0.0,
          "Waits for job `ticket` (the oldest not taken), orders `stream` (required with backend='cuda') "
          "after its copies. For "
          "staged jobs returns one uint8 DLPack capsule per segment whose staged copy is the result "
          "(None for the others); else None.")
      .def("close", [](CopyEngine& e) { without_gil([&] { e.close(); }); })
      .def_property_readonly("depth", &CopyEngine::depth)
      .def_property_readonly("submitted", &CopyEngine::submitted,
                             "Jobs accepted so far: the ticket the next accepted submit() returns.")
      .def_property_readonly("taken", &CopyEngine::taken)
      .def_property_readonly("backend", [](const CopyEngine& e) { return std::string(e.backend_name()); })
      .def("counters", [](const CopyEngine& e) {
        const auto& c = e.counters();
        py::dict d;
        d["jobs"] = c.jobs.load();
        d["bytes"] = c.bytes.load();
        d["staged_bytes"] = c.staged_bytes.load();
        d["issue_ns"] = c.issue_ns.load();
        d["complete_ns"] = c.complete_ns.load();
        d["take_wait_ns"] = c.take_wait_ns.load();
        d["submit_wait_ns"] = c.submit_wait_ns.load();
        return d;
      });
}

}  // namespace pyloader
