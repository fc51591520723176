// Little-endian loads and a rotate, shared by the XXH64 and XXH3 implementations (both
// specifications read their input as little-endian lanes).
#pragma once

#include <cstdint>
#include <cstring>

namespace pyloader {
namespace hash_load {

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
inline constexpr bool kBigEndian = true;
#else
inline constexpr bool kBigEndian = false;
#endif

inline uint64_t le64(const uint8_t* p) noexcept {
  if constexpr (kBigEndian) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  } else {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
}

inline uint32_t le32(const uint8_t* p) noexcept {
  if constexpr (kBigEndian) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
  } else {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
}

inline uint64_t rotl64(uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }

}  // namespace hash_load
}  // namespace pyloader
