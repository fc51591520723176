// Zero-copy export of batch buffers as DLPack capsules (the "dltensor" capsule protocol,
// declared here from the DLPack specification: https://dmlc.github.io/dlpack/latest/).
//
// NOTE [DLPack lifetime]: each capsule's manager context holds a shared_ptr to the batch
// slot; the consumer (torch.from_dlpack) calls the deleter when its tensor's storage
// dies, which drops that reference -- no GIL is needed for it, so tensors may be freed on
// any thread, including at interpreter exit. The slot returns to its pool when the last
// tensor viewing it is gone (NOTE [slot reuse]).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/slot_pool.h"

namespace pyloader {
namespace dl {

struct Device {
  int32_t device_type;  // 1 = CPU, 2 = CUDA
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

}  // namespace dl

// A capsule named "dltensor" viewing `data` with `shape`, keeping `owner` alive.
pybind11::capsule to_dlpack(void* data, std::vector<int64_t> shape, dl::DataType dtype, std::shared_ptr<Slot> owner,
                            dl::Device device = {1, 0});

// The DLPack type of a format dtype code (docs/format.md).
dl::DataType dlpack_dtype(uint8_t code);

}  // namespace pyloader
