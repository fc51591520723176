// XXH64, following the steps of the xxHash specification: four lane accumulators over
// 32-byte stripes, merge, then 8-, 4- and 1-byte tail steps and a final avalanche.
#include "xxh64.h"

#include <cstring>

#include "core/hash_load.h"

namespace pyloader {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

using hash_load::kBigEndian;
using hash_load::le32;
using hash_load::le64;
using hash_load::rotl64;

inline uint64_t lane_round(uint64_t acc, uint64_t lane) noexcept {
  acc += lane * kPrime2;
  acc = rotl64(acc, 31);
  return acc * kPrime1;
}

inline uint64_t merge_lane(uint64_t acc, uint64_t v) noexcept {
  acc ^= lane_round(0, v);
  return acc * kPrime1 + kPrime4;
}

// The 8-, 4- and 1-byte steps over the last (fewer than 32) bytes, then the avalanche.
inline uint64_t finish(uint64_t acc, const uint8_t* p, const uint8_t* end) noexcept {
  for (; end - p >= 8; p += 8) {
    acc ^= lane_round(0, le64(p));
    acc = rotl64(acc, 27) * kPrime1 + kPrime4;
  }
  if (end - p >= 4) {
    acc ^= static_cast<uint64_t>(le32(p)) * kPrime1;
    acc = rotl64(acc, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  for (; p != end; ++p) {
    acc ^= static_cast<uint64_t>(*p) * kPrime5;
    acc = rotl64(acc, 11) * kPrime1;
  }
  acc ^= acc >> 33;
  acc *= kPrime2;
  acc ^= acc >> 29;
  acc *= kPrime3;
  acc ^= acc >> 32;
  return acc;
}

// Hashes p[0, len); when kCopy, also copies it to out. Shared so that xxh64 and
// xxh64_copy cannot drift apart.
template <bool kCopy>
inline uint64_t hash_impl(const uint8_t* p, size_t len, uint64_t seed, uint8_t* out) noexcept {
  const uint8_t* const end = p + len;
  uint64_t acc;
  if (len >= 32) {
    uint64_t v1 = seed + kPrime1 + kPrime2;
    uint64_t v2 = seed + kPrime2;
    uint64_t v3 = seed;
    uint64_t v4 = seed - kPrime1;
    const uint8_t* const last_stripe = end - 32;
    do {
      // Load the stripe once; the four lanes are independent dependency chains.
      const uint64_t l1 = le64(p);
      const uint64_t l2 = le64(p + 8);
      const uint64_t l3 = le64(p + 16);
      const uint64_t l4 = le64(p + 24);
      if constexpr (kCopy) {
        if constexpr (kBigEndian) {
          std::memcpy(out, p, 32);  // the lanes are byte-swapped; copy the raw bytes
        } else {
          // Store the lanes already in registers instead of reading src a second time.
          std::memcpy(out, &l1, 8);
          std::memcpy(out + 8, &l2, 8);
          std::memcpy(out + 16, &l3, 8);
          std::memcpy(out + 24, &l4, 8);
        }
        out += 32;
      }
      v1 = lane_round(v1, l1);
      v2 = lane_round(v2, l2);
      v3 = lane_round(v3, l3);
      v4 = lane_round(v4, l4);
      p += 32;
    } while (p <= last_stripe);
    acc = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    acc = merge_lane(acc, v1);
    acc = merge_lane(acc, v2);
    acc = merge_lane(acc, v3);
    acc = merge_lane(acc, v4);
  } else {
    acc = seed + kPrime5;
  }
  acc += static_cast<uint64_t>(len);

  // Fewer than 32 bytes remain; this tail is in L1, so copying it separately is cheap.
  if constexpr (kCopy) {
    if (end != p) std::memcpy(out, p, static_cast<size_t>(end - p));
  }
  return finish(acc, p, end);
}

}  // namespace

uint64_t xxh64(const void* data, size_t len, uint64_t seed) noexcept {
  return hash_impl<false>(static_cast<const uint8_t*>(data), len, seed, nullptr);
}

uint64_t xxh64_copy(void* dst, const void* src, size_t len, uint64_t seed) noexcept {
  return hash_impl<true>(static_cast<const uint8_t*>(src), len, seed, static_cast<uint8_t*>(dst));
}

Xxh64Stream::Xxh64Stream(uint64_t seed) noexcept
    : seed_(seed), v_{seed + kPrime1 + kPrime2, seed + kPrime2, seed, seed - kPrime1} {}

void Xxh64Stream::update(const void* data, size_t len) noexcept {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += len;
  if (held_) {  // complete the stripe held from the last call first
    size_t k = len < 32 - held_ ? len : 32 - held_;
    std::memcpy(buf_ + held_, p, k);
    held_ += k;
    p += k;
    len -= k;
    if (held_ < 32) return;
    stripe(buf_);
    held_ = 0;
  }
  for (; len >= 32; p += 32, len -= 32) stripe(p);
  if (len) std::memcpy(buf_, p, len);
  held_ = len;
}

void Xxh64Stream::stripe(const uint8_t* p) noexcept {
  v_[0] = lane_round(v_[0], le64(p));
  v_[1] = lane_round(v_[1], le64(p + 8));
  v_[2] = lane_round(v_[2], le64(p + 16));
  v_[3] = lane_round(v_[3], le64(p + 24));
}

uint64_t Xxh64Stream::digest() const noexcept {
  uint64_t acc;
  if (total_ >= 32) {
    acc = rotl64(v_[0], 1) + rotl64(v_[1], 7) + rotl64(v_[2], 12) + rotl64(v_[3], 18);
    for (uint64_t v : v_) acc = merge_lane(acc, v);
  } else {
    acc = seed_ + kPrime5;
  }
  acc += total_;
  return finish(acc, buf_, buf_ + held_);
}

}  // namespace pyloader
