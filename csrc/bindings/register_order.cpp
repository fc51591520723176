// Epoch orders (core/order.h): a reader's share of a global shuffle and the (shard,
// record) of sample ids, for pyloader/read/order.py. Both release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bindings.h"
#include "bindings/gil_release.h"
#include "core/order.h"

namespace py = pybind11;

namespace pyloader {

void register_order(py::module_& m) {
  m.def(
      "global_order",
      [](uint64_t n, uint64_t state, uint64_t lo, uint64_t hi) {
        if (lo > hi || hi > n)
          throw py::value_error("global_order needs 0 <= lo <= hi <= n, got lo=" + std::to_string(lo) +
                                ", hi=" + std::to_string(hi) + ", n=" + std::to_string(n));
        py::array_t<int64_t> out{py::ssize_t(hi - lo)};
        int64_t* p = out.mutable_data();
        without_gil([&] { global_order(n, state, lo, hi, p); });
        return out;
      },
      py::arg("n"), py::arg("state"), py::arg("lo"), py::arg("hi"),
      "Positions [lo, hi) of the ids 0..n-1 sorted by mix64(id ^ state) (int64): a global shuffle's "
      "epoch_order(...)[lo:hi], computed from two passes over the keys and a sort of that share alone "
      "(NOTE [native global order] in core/order.cpp).");
  m.def(
      "locate",
      [](const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& ids,
         const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& ends) {
        if (ids.ndim() != 1 || ends.ndim() != 1) throw py::value_error("locate needs 1-D ids and ends");
        const size_t m = size_t(ids.size());
        py::array_t<int32_t> shard{py::ssize_t(m)};
        py::array_t<int64_t> record{py::ssize_t(m)};
        int64_t bad = 0;
        const int64_t* ip = ids.data();
        const int64_t* ep = ends.data();
        int32_t* sp = shard.mutable_data();
        int64_t* rp = record.mutable_data();
        const size_t ns = size_t(ends.size());
        const bool ok = without_gil([&] { return locate_ids(ip, m, ep, ns, sp, rp, &bad); });
        if (!ok)
          throw py::value_error("ids must be in [0, " + std::to_string(ns ? ep[ns - 1] : 0) + "), got " +
                                std::to_string(bad));
        return py::make_tuple(shard, record);
      },
      py::arg("ids"), py::arg("ends"),
      "(shard int32, record int64) of each id, given ends = the running sum of records per shard "
      "(empty shards are skipped); ValueError naming an id outside [0, total).");
}

}  // namespace pyloader
