#include "bindings/dlpack_export.h"

#include <stdexcept>

#include "core/dtype.h"

namespace py = pybind11;

namespace pyloader {
namespace {

struct Context {
  dl::ManagedTensor managed;
  std::vector<int64_t> shape;
  std::shared_ptr<Slot> owner;
};

void delete_context(dl::ManagedTensor* self) {
  delete static_cast<Context*>(self->manager_ctx);  // See NOTE [DLPack lifetime]: no GIL needed
}

void capsule_destructor(PyObject* capsule) {
  // A capsule that was never consumed still owns its tensor; a consumed one was renamed
  // "used_dltensor" by the consumer, which now calls the deleter itself.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (m && m->deleter) m->deleter(m);
  } else {
    PyErr_Clear();
  }
}

}  // namespace

py::capsule to_dlpack(void* data, std::vector<int64_t> shape, dl::DataType dtype, std::shared_ptr<Slot> owner,
                      dl::Device device) {
  auto* ctx = new Context();
  ctx->shape = std::move(shape);
  ctx->owner = std::move(owner);
  dl::ManagedTensor& m = ctx->managed;
  m.dl_tensor.data = data;
  m.dl_tensor.device = device;
  m.dl_tensor.ndim = int32_t(ctx->shape.size());
  m.dl_tensor.dtype = dtype;
  m.dl_tensor.shape = ctx->shape.data();
  m.dl_tensor.strides = nullptr;
  m.dl_tensor.byte_offset = 0;
  m.manager_ctx = ctx;
  m.deleter = delete_context;
  PyObject* cap = PyCapsule_New(&m, "dltensor", capsule_destructor);
  if (!cap) {
    delete ctx;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

dl::DataType dlpack_dtype(uint8_t code) {
  switch (static_cast<DType>(code)) {
    case DType::kBool: return {6, 8, 1};
    case DType::kUInt8:
    case DType::kBytes: return {1, 8, 1};
    case DType::kUInt16: return {1, 16, 1};
    case DType::kUInt32: return {1, 32, 1};
    case DType::kUInt64: return {1, 64, 1};
    case DType::kInt8: return {0, 8, 1};
    case DType::kInt16: return {0, 16, 1};
    case DType::kInt32: return {0, 32, 1};
    case DType::kInt64: return {0, 64, 1};
    case DType::kFloat16: return {2, 16, 1};
    case DType::kBFloat16: return {4, 16, 1};
    case DType::kFloat32: return {2, 32, 1};
    case DType::kFloat64: return {2, 64, 1};
  }
  throw std::invalid_argument("unknown dtype code");
}

}  // namespace pyloader
