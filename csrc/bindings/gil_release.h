// Releasing the GIL safely around blocking native work.
//
// NOTE [GIL at interpreter exit]: when a daemon thread tries to re-take the GIL while the
// interpreter is finalizing, CPython ends that thread with pthread_exit(), whose forced
// unwind through a noexcept destructor (such as pybind11's gil_scoped_release) aborts
// the whole process. GilRelease checks first and, if the interpreter is going away, parks
// the thread instead: the process is exiting, so the thread simply never resumes. A thread
// already blocked waiting for the GIL when finalization starts cannot be parked; for it,
// the GIL is re-taken outside any destructor, so the forced unwind passes through our
// frames and pybind11's dispatcher (which rethrows abi::__forced_unwind) and the thread
// ends quietly.
#pragma once

#include <Python.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <type_traits>

namespace pyloader {

// The interpreter's main thread (set at import): it is the thread that finalizes, so it
// must never park.
inline std::atomic<unsigned long>& main_thread_ident() {
  static std::atomic<unsigned long> ident{0};
  return ident;
}

inline bool interpreter_finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Re-takes the GIL released by PyEval_SaveThread(), or parks this thread forever if the
// interpreter is finalizing (NOTE [GIL at interpreter exit]). Not inline and not
// noexcept, so that CPython's pthread_exit() from inside it can unwind through callers.
[[gnu::noinline]] void reacquire_gil(PyThreadState* state);

// Runs fn() without the GIL. The GIL is re-taken in ordinary code, never in a destructor:
// an unwind started by pthread_exit() inside a destructor would abort the process.
template <typename Fn>
auto without_gil(Fn&& fn) -> decltype(fn()) {
  PyThreadState* state = PyEval_SaveThread();
  try {
    if constexpr (std::is_void_v<decltype(fn())>) {
      fn();
      reacquire_gil(state);
    } else {
      auto result = fn();
      reacquire_gil(state);
      return result;
    }
  } catch (...) {
    reacquire_gil(state);
    throw;
  }
}

}  // namespace pyloader
