// ShardSet, SlotPool and BatchPipeline. Batches reach Python zero-copy: every array
// holds a reference to its slot (NOTE [slot reuse] in core/slot_pool.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "bindings/dlpack_export.h"
#include "bindings/gil_release.h"
#include "bindings/interruptible_wait.h"
#include "bindings/numpy_args.h"
#include "core/batch_pipeline.h"
#include "core/cuda_driver.h"
#include "core/dtype.h"
#include "core/errors.h"
#include "core/host_memory.h"
#include "core/shard_reader.h"
#include "core/slot_pool.h"

namespace py = pybind11;

namespace pyloader {
namespace {

// The next batch; false at the end of the plan.
bool next_batch(BatchPipeline& p, Batch* b, double timeout) {
  BatchPipeline::Next r = BatchPipeline::Next::kTimeout;
  wait_interruptibly([&](int64_t ms) { return (r = p.next(b, ms)) != BatchPipeline::Next::kTimeout; }, timeout,
                     "no batch arrived");
  return r == BatchPipeline::Next::kBatch;
}

// (index, rows, [capsule per field], [lengths capsule per field or None]); each capsule
// holds the batch's slot (NOTE [DLPack lifetime]).
py::tuple export_batch(const Batch& b, const std::vector<FieldSpec>& fspec) {
  py::list arrays, lengths;
  for (size_t f = 0; f < b.fields.size(); ++f) {
    const FieldView& v = b.fields[f];
    arrays.append(to_dlpack(v.data, v.shape, dlpack_dtype(fspec[f].dtype), b.slot));
    if (v.lengths)
      lengths.append(to_dlpack(v.lengths, {int64_t(b.rows)}, dlpack_dtype(uint8_t(DType::kInt64)), b.slot));
    else
      lengths.append(py::none());
  }
  return py::make_tuple(b.index, b.rows, arrays, lengths);
}

}  // namespace

void register_pipeline(py::module_& m) {
  m.def("_pipelines_destroyed_on_workers", &BatchPipeline::destroyed_on_workers,
        "How many BatchPipelines were destroyed on a pipeline's worker thread (none may be: NOTE [hand-over gate] "
        "in core/batch_pipeline.h). For tests.");
  py::class_<ShardSet, std::shared_ptr<ShardSet>>(
      m, "ShardSet",
      "The shards of one dataset, each mapped and validated on first use; idle ones stay mapped in LRU order "
      "(NOTE [working set] in core/shard_reader.h).")
      .def(py::init([](std::vector<std::string> paths, std::vector<uint64_t> bytes, std::vector<uint64_t> records,
                       py::bytes schema, bool pending, size_t max_idle, std::vector<py::bytes> shard_schemas,
                       std::vector<uint32_t> schema_of, uint64_t max_value_bytes, size_t max_mapped) {
             std::vector<std::string> alts;
             for (auto& b : shard_schemas) alts.emplace_back(std::string(b));
             return std::make_shared<ShardSet>(std::move(paths), std::move(bytes), std::move(records),
                                               std::string(schema), pending, max_idle, std::move(alts),
                                               std::move(schema_of), max_value_bytes, max_mapped);
           }),
           py::kw_only(), py::arg("paths"), py::arg("bytes"), py::arg("records"), py::arg("schema"),
           py::arg("pending") = false, py::arg("max_idle") = 4096, py::arg("shard_schemas") = std::vector<py::bytes>{},
           py::arg("schema_of") = std::vector<uint32_t>{}, py::arg("max_value_bytes") = kDefaultMaxValueBytes,
           py::arg("max_mapped") = 0)
      .def("mark_ready", &ShardSet::mark_ready, py::arg("index"), py::arg("path"),
           "A pending shard's file is verified and in place at `path` (NOTE [shard readiness]).")
      .def("mark_failed", &ShardSet::mark_failed, py::arg("index"), py::arg("message"), py::arg("errno") = 0,
           "A pending shard could not be fetched; readers of it raise ShardIOError(errno, message) "
           "(a FileNotFoundError for ENOENT, a PermissionError for EACCES).")
      .def("retry", &ShardSet::retry, py::arg("index"),
           "A failed shard of a pending set becomes pending again, for a later iterator to fetch; False if it "
           "had not failed.")
      .def(
          "unload", [](ShardSet& s, size_t i, bool force) { return without_gil([&] { return s.unload(i, force); }); },
          py::arg("index"), py::arg("force") = false,
          "Unmaps shard `index` of a pending set and makes it pending again: an idle one, or with force=True one "
          "that no worker holds now. False if it cannot be.")
      .def(
          "wait_events",
          [](ShardSet& s, double timeout) {
            ShardEvents ev = without_gil([&] { return s.wait_events(int64_t(timeout * 1000.0)); });
            py::list corrupt;
            for (auto& [i, msg] : ev.corrupt) corrupt.append(py::make_tuple(i, msg));
            return py::make_tuple(ev.released, ev.waiting, corrupt);
          },
          py::arg("timeout") = 0.0,
          "Waits up to `timeout` seconds for an event; returns (released, waiting, corrupt): shards that "
          "became idle, shards a worker waits on now, and (shard, reason) of cached copies to fetch again.")
      .def(
          "waiting", [](ShardSet& s) { return without_gil([&] { return s.waiting(); }); },
          "The shards a worker waits on now.")
      .def(
          "trust",
          [](ShardSet& s, size_t i, uint64_t dev, uint64_t ino, uint64_t size, int64_t mtime_ns, int64_t ctime_ns) {
            s.trust(i, FileIdentity{dev, ino, size, mtime_ns, ctime_ns});
          },
          py::arg("index"), py::arg("dev"), py::arg("ino"), py::arg("size"), py::arg("mtime_ns"), py::arg("ctime_ns"),
          "Shard `index`, when mapped from a file of exactly this identity (os.stat's st_dev, st_ino, st_size, "
          "st_mtime_ns, st_ctime_ns), is read without checksum checks: it was verified in full before "
          "(NOTE [verified files] in core/shard_reader.cpp).")
      .def(
          "newly_verified",
          [](ShardSet& s) {
            auto v = without_gil([&] { return s.newly_verified(); });
            py::list out;
            for (const auto& e : v)
              out.append(py::make_tuple(e.index,
                                        py::make_tuple(e.identity.dev, e.identity.ino, e.identity.size,
                                                       e.identity.mtime_ns, e.identity.ctime_ns),
                                        e.opened_ns));
            return out;
          },
          "Mapped shards whose every record was verified, not reported before: (index, (dev, ino, size, "
          "mtime_ns, ctime_ns), opened_ns) with the file's identity and when it was opened (time.time_ns()). "
          "Each is reported once (NOTE [verified files] in core/shard_reader.cpp).")
      .def("counts",
           [](ShardSet& s) {
             ShardSet::Counts c = s.counts();
             py::dict d;
             d["mapped"] = c.mapped;
             d["idle"] = c.idle;
             d["active"] = c.active;
             d["heals"] = c.heals;
             d["unloads"] = c.unloads;
             d["peak_mapped"] = c.peak_mapped;
             d["remaps"] = c.remaps;
             d["opens"] = c.opens;
             return d;
           })
      .def("__len__", &ShardSet::size);

  py::class_<SlotPool, std::shared_ptr<SlotPool>>(m, "SlotPool", "Reusable batch buffers.")
      .def(py::init([](size_t num_fields, bool pinned, int device, int64_t cache_bytes) {
             // Each pool its own allocator, so that memory() counts this pool's buffers only.
             if (!pinned) return std::make_shared<SlotPool>(num_fields, std::make_shared<PageableAllocator>());
             if (cache_bytes < 0) throw std::invalid_argument("cache_bytes must be >= 0");
             std::string why;
             const cuda::Driver* d = cuda::driver(&why);
             if (!d) throw LoaderError(ErrorKind::kDevice, "", -1, "", "pinned memory needs the CUDA driver: " + why);
             auto alloc = without_gil(
                 [&] { return std::make_shared<PinnedAllocator>(*d, device, size_t(cache_bytes)); });
             return std::make_shared<SlotPool>(num_fields, std::move(alloc));
           }),
           py::kw_only(), py::arg("num_fields"), py::arg("pinned") = false, py::arg("device") = 0,
           py::arg("cache_bytes") = int64_t(PinnedAllocator::kDefaultCacheLimit),
           "pinned=True: page-locked buffers from the CUDA driver (raises without one), cached by size "
           "class up to cache_bytes released bytes (NOTE [pinned cache]).")
      .def_property_readonly("pinned", &SlotPool::pinned)
      .def_property_readonly("created", &SlotPool::created)
      .def(
          "prepare",
          [](SlotPool& p, size_t count, std::vector<size_t> field_bytes) {
            without_gil([&] { p.prepare(count, std::move(field_bytes)); });
          },
          py::kw_only(), py::arg("count"), py::arg("field_bytes"),
          "Makes slots until the pool has `count`, on a thread of its own, each field's buffer reserved for "
          "field_bytes[i] bytes (0: at its first batch); returns at once (NOTE [prepared slots]).")
      .def_property_readonly("preparing", &SlotPool::preparing, "Whether a prepare() thread is still making slots.")
      .def_property_readonly("free", &SlotPool::free_count)
      .def(
          "memory",
          [](const SlotPool& p) {
            HostMemoryStats m = p.memory();
            py::dict d;
            d["pinned"] = p.pinned();
            d["bytes"] = m.live_bytes + m.cached_bytes;
            d["live_bytes"] = m.live_bytes;
            d["cached_bytes"] = m.cached_bytes;
            d["cache_limit"] = m.cache_limit;
            d["allocs"] = m.allocs;
            d["reused"] = m.reused;
            d["driver_allocs"] = m.driver_allocs;
            d["driver_frees"] = m.driver_frees;
            d["driver_alloc_bytes"] = m.driver_alloc_bytes;
            d["driver_alloc_s"] = double(m.driver_alloc_ns) / 1e9;
            return d;
          },
          "The pool's host memory: bytes held (live in slots + cached), the allocations and how many "
          "reached the system or the CUDA driver (NOTE [pinned cache]), with their bytes and the thread "
          "time they took.");

  py::class_<Batch>(m, "HostBatch",
                    "One collated batch in its host slot; the slot is reused only when this object and "
                    "every array exported from it are gone.")
      .def_readonly("index", &Batch::index)
      .def_readonly("rows", &Batch::rows);

  py::class_<BatchPipeline, std::shared_ptr<BatchPipeline>>(
      m, "BatchPipeline", "Collates the planned records into batches on native threads; yields them in plan order.")
      .def(py::init([](std::shared_ptr<ShardSet> shards, std::shared_ptr<SlotPool> pool,
                       const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& shard_idx,
                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& record_idx,
                       size_t batch_size, bool drop_last, int num_threads, int prefetch, int ahead, bool early,
                       int active_threads, bool ragged) {
             PipelineConfig cfg;
             cfg.ragged = ragged;
             cfg.ahead = ahead;
             cfg.early = early;
             cfg.active_threads = active_threads;
             cfg.batch_size = batch_size;
             cfg.drop_last = drop_last;
             cfg.num_threads = num_threads;
             cfg.prefetch = prefetch;
             auto s = to_vector<int32_t>(shard_idx);
             auto r = to_vector<int64_t>(record_idx);
             return without_gil([&] {
               return std::make_shared<BatchPipeline>(std::move(shards), std::move(pool), std::move(s), std::move(r),
                                                      cfg);
             });
           }),
           py::kw_only(), py::arg("shards"), py::arg("pool"), py::arg("shard_idx"), py::arg("record_idx"),
           py::arg("batch_size"), py::arg("drop_last") = false, py::arg("num_threads") = 1, py::arg("prefetch") = 2,
           py::arg("ahead") = -1, py::arg("early") = false, py::arg("active_threads") = 0, py::arg("ragged") = false)
      .def("__len__", &BatchPipeline::num_batches)
      .def_property(
          "ahead", &BatchPipeline::ahead, [](BatchPipeline& p, int n) { p.set_ahead(n); },
          "Batches the workers may collate ahead of the consumer, 1..prefetch (set: clamped to that range).")
      .def(
          "hand_over",
          [](BatchPipeline& p, const std::shared_ptr<BatchPipeline>& next, int ahead) {
            without_gil([&] { p.hand_over(next, ahead); });
          },
          py::arg("next"), py::arg("ahead"),
          "Once every batch of this pipeline is claimed, the first of its workers to find nothing left sets "
          "next.ahead = ahead (at once if that moment has passed): the next epoch's pipeline then runs at full "
          "read-ahead without the consumer waking its threads.")
      .def_property(
          "threads", &BatchPipeline::threads, [](BatchPipeline& p, int n) { p.set_threads(n); },
          "How many of the started workers collate, 1..num_threads (set: clamped; the others wait).")
      .def("adopt", &BatchPipeline::adopt, py::arg("ahead"),
           "A pipeline made ahead (ahead= at construction: it takes only slots others return) begins its "
           "epoch: read-ahead `ahead` from the next take, and its slot pool may grow again.")
      .def(
          "set_ahead", [](BatchPipeline& p, int n, bool later) { p.set_ahead(n, later); }, py::arg("n"), py::kw_only(),
          py::arg("later") = false,
          "Sets `ahead` (clamped to 1..prefetch); later=True: from the consumer's next take on, waking no "
          "thread now.")
      .def(
          "next",
          [](BatchPipeline& p, double timeout) -> py::object {
            Batch b;
            if (!next_batch(p, &b, timeout)) return py::none();
            py::tuple out = export_batch(b, p.fields());
            b.slot.reset();
            return out;
          },
          py::arg("timeout") = 0.0,
          "The next batch as (index, rows, [DLPack capsule per field], [lengths capsule per field or "
          "None]), or None at the end. Releases the GIL while waiting. The capsules view the slot's "
          "memory (NOTE [DLPack lifetime] in bindings/dlpack_export.h).")
      .def(
          "next_host",
          [](BatchPipeline& p, double timeout) -> py::object {
            Batch b;
            if (!next_batch(p, &b, timeout)) return py::none();
            py::tuple arrays = export_batch(b, p.fields());
            return py::make_tuple(py::cast(std::move(b)), arrays[2], arrays[3]);
          },
          py::arg("timeout") = 0.0,
          "Like next(), but returns (HostBatch, arrays, lengths): the HostBatch can be handed "
          "to a CopyEngine, which keeps its slot until the copies completed.")
      .def("close", [](BatchPipeline& p) { without_gil([&] { p.close(); }); })
      .def("counters", [](const BatchPipeline& p) {
        const auto& c = p.counters();
        py::dict d;
        d["records"] = c.records.load();
        d["batches"] = c.batches.load();
        d["stored_bytes"] = c.stored_bytes.load();
        d["decoded_bytes"] = c.decoded_bytes.load();
        d["lz4_stored_bytes"] = c.lz4_stored_bytes.load();
        d["verified_bytes"] = c.verified_bytes.load();
        d["shard_wait_ns"] = c.shard_wait_ns.load();
        d["collate_ns"] = c.collate_ns.load();
        d["wait_ns"] = c.wait_ns.load();
        d["mapped_ahead_bytes"] = p.mapped_ahead_bytes();
        return d;
      });
}

}  // namespace pyloader
