// Maps native LoaderError to pyloader's Python exception classes. The classes live in
// pyloader/_errors.py (so `except ValueError` keeps working); from_native() builds the
// instance with shard/record/field attributes attached.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "core/errors.h"

namespace py = pybind11;

namespace pyloader {

void register_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const LoaderError& e) {
      py::object from_native = py::module_::import("pyloader.errors").attr("from_native");
      py::object exc = from_native(int(e.kind()), e.what(), e.shard(), e.record(), e.field(), e.sys_errno());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

}  // namespace pyloader
