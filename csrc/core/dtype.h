// Element types of shard fields. Codes are part of the on-disk format (docs/format.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

enum class DType : uint8_t {
  kBool = 1,
  kUInt8 = 2,
  kUInt16 = 3,
  kUInt32 = 4,
  kUInt64 = 5,
  kInt8 = 6,
  kInt16 = 7,
  kInt32 = 8,
  kInt64 = 9,
  kFloat16 = 10,
  kBFloat16 = 11,
  kFloat32 = 12,
  kFloat64 = 13,
  kBytes = 14,  // opaque bytes: a variable-length uint8 vector per record
};

// Returns 0 for an unknown code.
inline size_t dtype_itemsize(uint8_t code) noexcept {
  switch (static_cast<DType>(code)) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBytes: return 1;
    case DType::kUInt16:
    case DType::kInt16:
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kUInt32:
    case DType::kInt32:
    case DType::kFloat32: return 4;
    case DType::kUInt64:
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  return 0;
}

}  // namespace pyloader
