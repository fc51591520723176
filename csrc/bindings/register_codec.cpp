// Checksum and LZ4 entry points used by the Python writer, the cache and the tests.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bindings.h"
#include "bindings/gil_release.h"
#include "core/errors.h"
#include "core/lz4_block.h"
#include "core/xxh3.h"
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

// An Xxh3Impl by name; ValueError if unknown or if this CPU cannot run it.
Xxh3Impl xxh3_impl(const std::string& name) {
  Xxh3Impl impl;
  if (name == "auto") {
    impl = Xxh3Impl::kAuto;
  } else if (name == "scalar") {
    impl = Xxh3Impl::kScalar;
  } else if (name == "sse2") {
    impl = Xxh3Impl::kSse2;
  } else if (name == "avx2") {
    impl = Xxh3Impl::kAvx2;
  } else {
    throw py::value_error("impl must be 'auto', 'scalar', 'sse2' or 'avx2', not '" + name + "'");
  }
  if (!xxh3_impl_available(impl)) throw py::value_error("this build or CPU cannot run the " + name + " XXH3 loop");
  return impl;
}

// An Xxh64Impl by name; ValueError if unknown or if this CPU cannot run it.
Xxh64Impl xxh64_impl(const std::string& name) {
  Xxh64Impl impl;
  if (name == "auto") {
    impl = Xxh64Impl::kAuto;
  } else if (name == "scalar") {
    impl = Xxh64Impl::kScalar;
  } else if (name == "avx512") {
    impl = Xxh64Impl::kAvx512;
  } else {
    throw py::value_error("impl must be 'auto', 'scalar' or 'avx512', not '" + name + "'");
  }
  if (!xxh64_impl_available(impl)) throw py::value_error("this build or CPU cannot run the " + name + " XXH64 loop");
  return impl;
}

}  // namespace

void register_codec(py::module_& m) {
  m.def(
      "xxh64",
      [](const py::buffer& data, uint64_t seed, const std::string& impl) {
        ReadView v(data);
        const Xxh64Impl which = xxh64_impl(impl);
        return without_gil([&] { return xxh64_with(which, v.data(), v.size(), seed); });
      },
      py::arg("data"), py::kw_only(), py::arg("seed") = 0, py::arg("impl") = "auto",
      "XXH64 of a contiguous buffer (the checksum of shard format version 1 and of the manifest). `impl` "
      "picks the 32-byte stripe loop ('auto', 'scalar', 'avx512'; for tests). Releases the GIL.");

  m.def(
      "xxh3_64",
      [](const py::buffer& data, const std::string& impl) {
        ReadView v(data);
        const Xxh3Impl which = xxh3_impl(impl);
        return without_gil([&] { return xxh3_64_with(which, v.data(), v.size()); });
      },
      py::arg("data"), py::kw_only(), py::arg("impl") = "auto",
      "XXH3-64 (seed 0) of a contiguous buffer (the checksum of shard format version 2). `impl` "
      "picks the long-input loop ('auto', 'scalar', 'sse2', 'avx2'; for tests). Releases the GIL.");

  m.def(
      "xxh3_64_copy",
      [](const py::buffer& dst, const py::buffer& src, const std::string& impl) {
        ReadView v(src);
        Py_buffer out{};
        if (PyObject_GetBuffer(dst.ptr(), &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
          throw py::error_already_set();
        if (size_t(out.len) != v.size()) {
          PyBuffer_Release(&out);
          throw py::value_error("dst and src must have the same size");
        }
        Xxh3Impl which;
        try {
          which = xxh3_impl(impl);
        } catch (...) {
          PyBuffer_Release(&out);
          throw;
        }
        const uint64_t h = without_gil([&] { return xxh3_64_copy_with(which, out.buf, v.data(), v.size()); });
        PyBuffer_Release(&out);
        return h;
      },
      py::arg("dst"), py::arg("src"), py::kw_only(), py::arg("impl") = "auto",
      "Copies src into dst (a writable buffer of the same size, not overlapping src) and returns "
      "xxh3_64(src), reading src once (the reader's first-read path). Releases the GIL.");

  m.def(
      "lz4_decode_block",
      [](const py::buffer& src, size_t decoded_size) {
        ReadView v(src);
        // NOTE [value bounds] in core/shard_reader.h: refused before the allocation.
        if (decoded_size > lz4_max_decoded_size(v.size()))
          throw LoaderError(ErrorKind::kFormat, "", -1, "",
                            "LZ4 block is malformed: " + std::to_string(decoded_size) +
                                " bytes is more than a block of " + std::to_string(v.size()) + " bytes can decode to");
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
