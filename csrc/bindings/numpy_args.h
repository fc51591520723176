// Numpy arguments of the bindings, copied into native vectors.
#pragma once

#include <pybind11/numpy.h>

#include <vector>

namespace pyloader {

// A 1-D array (any integer dtype, cast to T) as a vector.
template <typename T>
std::vector<T> to_vector(const pybind11::array_t<T, pybind11::array::c_style | pybind11::array::forcecast>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

}  // namespace pyloader
