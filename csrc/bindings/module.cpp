#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyloader native core: shard reader, LZ4 decoder, collation pipeline";
  pyloader::register_errors(m);
  pyloader::register_codec(m);
  pyloader::register_pipeline(m);
}
