// XXH64 checksum, written from the public xxHash specification
// (Cyan4973/xxHash doc/xxhash_spec.md). Results match the reference XXH64 bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// XXH64 of data[0, len) with the given seed. data may be null when len is 0.
uint64_t xxh64(const void* data, size_t len, uint64_t seed) noexcept;

// Copies len bytes from src to dst (the ranges must not overlap) and returns
// xxh64(src, len, seed). Each 32-byte stripe is loaded once, then both stored and hashed,
// so the copy rides along with the hash instead of making a second pass over src.
uint64_t xxh64_copy(void* dst, const void* src, size_t len, uint64_t seed) noexcept;

// The implementations of the 32-byte stripe loop. kAuto picks the faster this CPU runs (the
// four lanes in one AVX-512 vector on AMD CPUs with AVX-512 VL and DQ, else scalar); the
// others exist so that tests can check each one against the reference.
enum class Xxh64Impl { kAuto, kScalar, kAvx512 };

// Whether this build and CPU can run `impl` (kAuto and kScalar always can).
bool xxh64_impl_available(Xxh64Impl impl) noexcept;

// xxh64 using `impl`, which must be available.
uint64_t xxh64_with(Xxh64Impl impl, const void* data, size_t len, uint64_t seed) noexcept;

// XXH64 of bytes given in pieces: digest() after update() calls over data[0, len) in order
// equals xxh64(data, len, seed).
class Xxh64Stream {
 public:
  explicit Xxh64Stream(uint64_t seed = 0) noexcept;
  void update(const void* data, size_t len) noexcept;
  // update(src, len) that also copies src[0, len) to dst (not overlapping it), reading each
  // stripe once: the copy rides along with the hash, as in xxh64_copy.
  void update_copy(void* dst, const void* src, size_t len) noexcept;
  uint64_t digest() const noexcept;
  uint64_t length() const noexcept { return total_; }

 private:
  template <bool kCopy>
  void consume(const uint8_t* p, size_t len, uint8_t* out) noexcept;
  uint64_t seed_;
  uint64_t v_[4];
  uint64_t total_ = 0;
  uint8_t buf_[32] = {0};
  size_t held_ = 0;
};

}  // namespace pyloader
