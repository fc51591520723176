// Image entry points used by pyloader.transform.image.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/gil_release.h"
#include "core/image_normalize.h"
#include "core/jpeg_decode.h"

namespace py = pybind11;

namespace pyloader {

namespace {

struct ReadBuffer {
  explicit ReadBuffer(const py::buffer& b) {
    if (PyObject_GetBuffer(b.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
  }
  ~ReadBuffer() { PyBuffer_Release(&view); }
  Py_buffer view{};
};

}  // namespace

void register_image(py::module_& m) {
  m.def("jpeg_available", &jpeg_available,
        "Whether this build decodes JPEG natively (it found libjpeg-turbo when it was built).");

  m.def(
      "jpeg_header",
      [](const py::buffer& data) {
        ReadBuffer in(data);
        JpegHeader h;
        const char* err = without_gil(
            [&] { return jpeg_read_header_info(static_cast<const uint8_t*>(in.view.buf), size_t(in.view.len), &h); });
        if (err) throw py::value_error(err);
        return py::make_tuple(h.width, h.height, h.components, h.progressive);
      },
      py::arg("data"), "(width, height, components, progressive) of a JPEG. Releases the GIL.");

  m.def(
      "jpeg_decode_region",
      [](const py::buffer& data, const py::buffer& dst, int denom, int x, int y, int width, int height, int channels,
         uint64_t max_pixels) {
        ReadBuffer in(data);
        Py_buffer out{};
        if (PyObject_GetBuffer(dst.ptr(), &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0)
          throw py::error_already_set();
        if (width <= 0 || height <= 0 || channels <= 0 ||
            size_t(out.len) != size_t(width) * size_t(height) * size_t(channels)) {
          PyBuffer_Release(&out);
          throw py::value_error("jpeg_decode_region: dst must hold width * height * channels bytes");
        }
        const char* err = without_gil([&] {
          return jpeg_decode_region(static_cast<const uint8_t*>(in.view.buf), size_t(in.view.len), denom, x, y, width,
                                    height, channels, static_cast<uint8_t*>(out.buf), max_pixels);
        });
        PyBuffer_Release(&out);
        if (err) throw py::value_error(err);
      },
      py::arg("data"), py::arg("dst"), py::kw_only(), py::arg("denom"), py::arg("x"), py::arg("y"), py::arg("width"),
      py::arg("height"), py::arg("channels"), py::arg("max_pixels") = kDefaultMaxPixels,
      "Decodes the region (x, y, width, height) of a JPEG scaled by 1/denom into dst (HWC uint8). An image "
      "of more than max_pixels pixels is refused from its header, and a corrupt-data warning stops the "
      "decode, both as ValueError (NOTE [pixel limit] in core/jpeg_decode.h). Releases the GIL.");

  m.def(
      "normalize_u8",
      [](const py::buffer& src, const py::buffer& dst, int64_t height, int64_t width, const std::vector<float>& mean,
         const std::vector<float>& std, bool chw) {
        const size_t c = mean.size();
        if (c < 1 || c > 4 || std.size() != c)
          throw py::value_error("normalize_u8: mean and std need 1 to 4 entries each, as many as channels");
        for (float s : std)
          if (!(s > 0.0f)) throw py::value_error("normalize_u8: every std must be > 0");
        if (height < 0 || width < 0) throw py::value_error("normalize_u8: negative size");
        Py_buffer in{}, out{};
        if (PyObject_GetBuffer(src.ptr(), &in, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
        if (PyObject_GetBuffer(dst.ptr(), &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
          PyBuffer_Release(&in);
          throw py::error_already_set();
        }
        const size_t pixels = size_t(height) * size_t(width) * c;
        if (size_t(in.len) != pixels || size_t(out.len) != pixels * sizeof(float)) {
          const std::string msg = "normalize_u8: src must hold " + std::to_string(pixels) + " bytes and dst " +
                                  std::to_string(pixels * sizeof(float)) + " (got " + std::to_string(in.len) + " and " +
                                  std::to_string(out.len) + ")";
          PyBuffer_Release(&in);
          PyBuffer_Release(&out);
          throw py::value_error(msg);
        }
        without_gil([&] {
          normalize_u8(static_cast<const uint8_t*>(in.buf), static_cast<float*>(out.buf), height, width, int(c),
                       mean.data(), std.data(), chw);
        });
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
      },
      py::arg("src"), py::arg("dst"), py::kw_only(), py::arg("height"), py::arg("width"), py::arg("mean"),
      py::arg("std"), py::arg("chw") = true,
      "uint8 HWC pixels into float32 (x / 255 - mean) / std, CHW (chw=True) or HWC, in one pass. "
      "Releases the GIL.");
}

}  // namespace pyloader
