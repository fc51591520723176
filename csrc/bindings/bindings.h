// The only place pybind11 appears. One register_<area>() per file.
#pragma once

#include <pybind11/pybind11.h>

namespace pyloader {

void register_errors(pybind11::module_& m);
void register_codec(pybind11::module_& m);
void register_pipeline(pybind11::module_& m);
void register_copy(pybind11::module_& m);
void register_image(pybind11::module_& m);
void register_packer(pybind11::module_& m);
void register_order(pybind11::module_& m);
void register_http(pybind11::module_& m);

}  // namespace pyloader
