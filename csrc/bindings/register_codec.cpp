// Checksum and LZ4 entry points used by the Python writer, the cache and the tests.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bindings.h"
#include "bindings/gil_release.h"
#include "core/errors.h"
#include "core/lz4_block.h"
#include "core/xxh64.h"

namespace py = pybind11;

namespace pyloader {
namespace {

// A read-only contiguous view of any buffer-protocol object.
struct ReadView {
  explicit ReadView(const py::buffer& b) {
    if (PyObject_GetBuffer(b.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  }
  ~ReadView() { PyBuffer_Release(&view); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(view.buf); }
  size_t size() const { return size_t(view.len); }
  Py_buffer view{};
};

}  // namespace

void register_codec(py::module_& m) {
  m.def(
      "xxh64",
      [](const py::buffer& data, uint64_t seed) {
        ReadView v(data);
        return without_gil([&] { return xxh64(v.data(), v.size(), seed); });
      },
      py::arg("data"), py::kw_only(), py::arg("seed") = 0,
      "XXH64 of a contiguous buffer (the checksum of the shard format). Releases the GIL.");

  m.def(
      "lz4_decode_block",
      [](const py::buffer& src, size_t decoded_size) {
        ReadView v(src);
        py::bytes out(nullptr, decoded_size);
        char* dst = PyBytes_AS_STRING(out.ptr());
        const char* err = without_gil(
            [&] { return lz4_decode_block(v.data(), v.size(), reinterpret_cast<uint8_t*>(dst), decoded_size); });
        if (err) throw LoaderError(ErrorKind::kFormat, "", -1, "", std::string("LZ4 block is malformed: ") + err);
        return out;
      },
      py::arg("src"), py::arg("decoded_size"),
      "Decodes one raw LZ4 block that must expand to exactly decoded_size bytes. Releases the GIL.");

  m.def(
      "lz4_decode_into",
      [](const py::buffer& src, const py::buffer& dst, int repeat) {
        ReadView v(src);
        Py_buffer out{};
        if (PyObject_GetBuffer(dst.ptr(), &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
          throw py::error_already_set();
        const char* err = without_gil([&] {
          const char* e = nullptr;
          for (int i = 0; i < repeat && !e; ++i)
            e = lz4_decode_block(v.data(), v.size(), static_cast<uint8_t*>(out.buf), size_t(out.len));
          return e;
        });
        PyBuffer_Release(&out);
        if (err) throw LoaderError(ErrorKind::kFormat, "", -1, "", std::string("LZ4 block is malformed: ") + err);
      },
      py::arg("src"), py::arg("dst"), py::kw_only(), py::arg("repeat") = 1,
      "Decodes one LZ4 block into a writable buffer of exactly the decoded size, `repeat` times "
      "(for benchmarks). Releases the GIL.");
}

}  // namespace pyloader
