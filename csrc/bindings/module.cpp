#include "bindings/bindings.h"
#include "bindings/gil_release.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyloader native core: shard reader, LZ4 decoder, collation pipeline, pinned staging, copy engine";
  pyloader::main_thread_ident().store(
      pybind11::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  pyloader::register_errors(m);
  pyloader::register_codec(m);
  pyloader::register_pipeline(m);
  pyloader::register_copy(m);
  pyloader::register_image(m);
  pyloader::register_packer(m);
  pyloader::register_order(m);
  pyloader::register_http(m);
}

namespace pyloader {

void reacquire_gil(PyThreadState* state) {
  if (pthread_self() != pthread_t(main_thread_ident().load()))
    while (interpreter_finalizing()) ::pause();  // NOTE [GIL at interpreter exit]
  PyEval_RestoreThread(state);
}

}  // namespace pyloader
