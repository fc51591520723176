// HTTP(S) downloads into a file descriptor for pyloader/remote/transport.py (See NOTE
// [native transport] in core/http_fetch.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/gil_release.h"
#include "core/http_fetch.h"

namespace py = pybind11;

namespace pyloader {
namespace {

constexpr int kSliceMs = 50;  // how often the cancel event and progress are looked at

py::dict part_dict(const http::PartResult& r) {
  py::dict d;
  d["status"] = r.status;
  d["written"] = r.written;
  d["curl_code"] = r.curl_code;
  d["curl_error"] = r.curl_error;
  d["content_length"] = r.content_length;
  d["range_total"] = r.range_total;
  d["retry_after"] = r.retry_after;
  d["bucket_region"] = r.bucket_region;
  d["error_body"] = py::bytes(r.error_body);
  d["wrong"] = r.wrong;
  d["wrong_kind"] = r.wrong_kind == http::kWrongRange      ? "range"
                    : r.wrong_kind == http::kWrongObject   ? "object"
                    : r.wrong_kind == http::kWrongRedirect ? "redirect"
                                                           : "";
  d["redirects"] = r.redirects;
  d["redirected_away"] = r.redirected_away;
  d["write_errno"] = r.write_errno;
  d["xxh64"] = r.hashed ? py::object(py::int_(r.xxh64)) : py::object(py::none());
  return d;
}

bool failed(const http::PartResult& r) {
  return r.curl_code > 0 || !r.wrong.empty() || r.write_errno != 0 ||
         (r.curl_code == 0 && (r.status < 200 || r.status > 299));
}

}  // namespace

void register_http(py::module_& m) {
  m.def(
      "http_available",
      [] {
        std::string why;
        bool ok = http::available(&why);
        return std::make_pair(ok, why);
      },
      "(whether libcurl.so.4 could be loaded, the reason when not).");
  m.def("http_version", &http::version, "The version string of libcurl, or '' without it.");
  m.def(
      "http_download",
      [](int fd, const std::string& url, uint64_t size, const std::vector<std::pair<uint64_t, uint64_t>>& parts,
         const std::vector<std::string>& headers, double connect_timeout, double stall_timeout, size_t write_buffer,
         size_t recv_buffer, const std::string& ca_file, const py::object& cancel, const py::object& on_bytes) {
        http::Request req;
        req.url = url;
        req.fd = fd;
        req.size = size;
        for (const auto& p : parts) req.parts.push_back(http::Part{p.first, p.second});
        req.headers = headers;
        req.connect_timeout_s = connect_timeout;
        req.stall_timeout_s = stall_timeout;
        req.write_buffer = write_buffer;
        req.recv_buffer = recv_buffer;
        req.ca_file = ca_file;
        http::Download d(req);
        bool cancelled = false;
        auto report = [&] {
          uint64_t n = d.take_written();
          if (n && !on_bytes.is_none()) on_bytes(n);
        };
        while (!without_gil([&] { return d.step(kSliceMs); })) {
          report();
          if (!cancel.is_none() && cancel.attr("is_set")().cast<bool>()) {
            d.stop();
            cancelled = true;
            break;
          }
          bool any_failed = false;
          for (const http::PartResult& r : d.results()) any_failed = any_failed || (r.curl_code >= 0 && failed(r));
          if (any_failed) {  // the attempt has failed: the other parts would be fetched again anyway
            d.stop();
            break;
          }
          if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        }
        report();
        py::list out;
        for (const http::PartResult& r : d.results()) out.append(part_dict(r));
        py::dict result;
        result["cancelled"] = cancelled;
        result["parts"] = out;
        return result;
      },
      py::arg("fd"), py::arg("url"), py::arg("size"), py::kw_only(), py::arg("parts"), py::arg("headers"),
      py::arg("connect_timeout"), py::arg("stall_timeout"), py::arg("write_buffer"),
      py::arg("recv_buffer") = size_t(4 << 20), py::arg("ca_file") = "", py::arg("cancel"), py::arg("on_bytes"),
      "One attempt to download `url` (`size` bytes) into `fd` with pwrite(): the whole object (`parts` empty) or "
      "one ranged GET per (offset, length) part, all at once. Releases the GIL between 50 ms slices, in which "
      "`cancel.is_set()` is checked and `on_bytes(n)` told the bytes written. Returns {'cancelled': bool, "
      "'parts': [dict per part]}; judges nothing (NOTE [native transport]).");
}

}  // namespace pyloader
