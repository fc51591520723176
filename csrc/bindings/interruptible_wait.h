// Blocking waits that Ctrl-C and a timeout can end.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "bindings/gil_release.h"
#include "core/errors.h"

namespace pyloader {

constexpr int64_t kSignalPollMs = 50;

// Calls slice(kSignalPollMs) without the GIL until it returns true, running Python signal
// handlers (Ctrl-C) between slices. After `timeout` seconds (when > 0) raises
// LoaderError(kTimeout): "<what> within the timeout of <timeout> s". The streams that take a
// DataLoader's timeout word it in torch's words where they catch it (See NOTE [timeout message]
// in pyloader/errors.py).
template <typename Slice>
void wait_interruptibly(Slice&& slice, double timeout, const char* what) {
  auto start = std::chrono::steady_clock::now();
  while (!without_gil([&] { return slice(kSignalPollMs); })) {
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
    if (timeout > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout)
      throw LoaderError(ErrorKind::kTimeout, "", -1, "",
                        std::string(what) + " within the timeout of " + std::to_string(timeout) + " s");
  }
}

}  // namespace pyloader
