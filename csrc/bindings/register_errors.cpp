// Maps native LoaderError to pyloader's Python exception classes. The classes live in
// pyloader/errors.py (so `except ValueError` keeps working); from_native() builds the
// instance with shard/record/field attributes attached.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "core/errors.h"

namespace py = pybind11;

namespace pyloader {
namespace {

// A message, path or name as str, never failing: bytes that are not UTF-8 (a forged shard's
// names, a path from a foreign filesystem) become \xNN escapes instead of a UnicodeDecodeError
// that would hide the error being raised.
py::str text(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

}  // namespace

void register_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LoaderError& e) {
      py::object from_native = py::module_::import("pyloader.errors").attr("from_native");
      py::object exc = from_native(int(e.kind()), text(e.what()), text(e.shard()), e.record(), text(e.field()),
                                   e.sys_errno());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

}  // namespace pyloader
