// Packer: packed batches reach Python zero-copy, with the packing state after each one
// (NOTE [packing state] in core/packer.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "bindings/dlpack_export.h"
#include "bindings/gil_release.h"
#include "bindings/interruptible_wait.h"
#include "bindings/numpy_args.h"
#include "core/packer.h"

namespace py = pybind11;

namespace pyloader {
namespace {

bool next_packed(Packer& p, PackedBatch* b, double timeout) {
  Packer::Next r = Packer::Next::kTimeout;
  wait_interruptibly([&](int64_t ms) { return (r = p.next(b, ms)) != Packer::Next::kTimeout; }, timeout,
                     "no packed batch arrived");
  return r == Packer::Next::kBatch;
}

py::list export_fields(const PackedBatch& b, const std::vector<FieldSpec>& spec) {
  py::list arrays;
  for (size_t f = 0; f < b.batch.fields.size(); ++f) {
    const FieldView& v = b.batch.fields[f];
    arrays.append(to_dlpack(v.data, v.shape, dlpack_dtype(spec[f].dtype), b.batch.slot));
  }
  return arrays;
}

// (cursor_pos, cursor_tok, window int64 [k, 3], rows)
py::tuple export_state(const PackState& s) {
  py::array_t<int64_t> w({py::ssize_t(s.window.size() / 3), py::ssize_t(3)});
  if (!s.window.empty()) std::memcpy(w.mutable_data(), s.window.data(), s.window.size() * sizeof(int64_t));
  return py::make_tuple(s.cursor_pos, s.cursor_tok, w, s.rows);
}

}  // namespace

void register_packer(py::module_& m) {
  py::class_<Packer, std::shared_ptr<Packer>>(
      m, "Packer",
      "Packs the documents a BatchPipeline reads into rows of seq_len tokens on its own thread "
      "(NOTE [packing rule] in core/packer.h).")
      .def(py::init([](std::shared_ptr<BatchPipeline> docs, size_t field, std::shared_ptr<SlotPool> pool,
                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& pos,
                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& start,
                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& end, size_t seq_len,
                       size_t rows, size_t lookahead, bool split, bool drop_last, int prefetch, int64_t pad_id) {
             PackConfig cfg;
             cfg.seq_len = seq_len;
             cfg.rows = rows;
             cfg.lookahead = lookahead;
             cfg.split = split;
             cfg.drop_last = drop_last;
             cfg.prefetch = prefetch;
             cfg.pad_id = pad_id;
             auto p = to_vector<int64_t>(pos), s = to_vector<int64_t>(start), e = to_vector<int64_t>(end);
             return without_gil([&] {
               return std::make_shared<Packer>(std::move(docs), field, std::move(pool), std::move(p), std::move(s),
                                               std::move(e), cfg);
             });
           }),
           py::kw_only(), py::arg("docs"), py::arg("field"), py::arg("pool"), py::arg("pos"), py::arg("start"),
           py::arg("end"), py::arg("seq_len"), py::arg("rows"), py::arg("lookahead") = 1, py::arg("split") = true,
           py::arg("drop_last") = false, py::arg("prefetch") = 2, py::arg("pad_id") = 0)
      .def(
          "next",
          [](Packer& p, double timeout) -> py::object {
            PackedBatch b;
            if (!next_packed(p, &b, timeout)) return py::none();
            py::list arrays = export_fields(b, p.out_fields());
            return py::make_tuple(b.batch.index, b.batch.rows, arrays, export_state(b.state));
          },
          py::arg("timeout") = 0.0,
          "The next packed batch as (index, rows, [DLPack capsule per output], state), or None at the end. "
          "Outputs: tokens, position_ids, document_ids, cu_seqlens; state: (cursor_pos, cursor_tok, "
          "window [k, 3], rows) after this batch (NOTE [packing state]).")
      .def(
          "next_host",
          [](Packer& p, double timeout) -> py::object {
            PackedBatch b;
            if (!next_packed(p, &b, timeout)) return py::none();
            py::list arrays = export_fields(b, p.out_fields());
            py::tuple state = export_state(b.state);
            py::list lengths;
            for (size_t f = 0; f < arrays.size(); ++f) lengths.append(py::none());
            return py::make_tuple(py::cast(std::move(b.batch)), arrays, lengths, state);
          },
          py::arg("timeout") = 0.0,
          "Like next(), but returns (HostBatch, arrays, lengths, state), the HostBatch for a CopyEngine.")
      .def_property_readonly("names",
                             [](const Packer& p) {
                               std::vector<std::string> out;
                               for (const auto& f : p.out_fields()) out.push_back(f.name);
                               return out;
                             })
      .def("close", [](Packer& p) { without_gil([&] { p.close(); }); })
      .def("counters", [](const Packer& p) {
        const auto& c = p.counters();
        py::dict d;
        d["items"] = c.items.load();
        d["pieces"] = c.pieces.load();
        d["split_items"] = c.split_items.load();
        d["rows"] = c.rows.load();
        d["tokens"] = c.tokens.load();
        d["pad_tokens"] = c.pad_tokens.load();
        d["truncated_tokens"] = c.truncated_tokens.load();
        d["batches"] = c.batches.load();
        d["pack_ns"] = c.pack_ns.load();
        d["input_wait_ns"] = c.input_wait_ns.load();
        d["wait_ns"] = c.wait_ns.load();
        return d;
      });
}

}  // namespace pyloader
