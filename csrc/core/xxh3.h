// XXH3-64 checksum (seed 0, default secret) as the xxHash specification defines it
// (Cyan4973/xxHash doc/xxhash_spec.md); results equal the reference XXH3_64bits bit for bit.
// The checksum of shard format version 2 (docs/format.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// XXH3-64 of data[0, len), seed 0. data may be null when len is 0.
uint64_t xxh3_64(const void* data, size_t len) noexcept;

// Copies len bytes from src to dst (the ranges must not overlap) and returns
// xxh3_64(src, len). Inputs longer than 240 bytes are read once: each 64-byte stripe is
// loaded, stored to dst and accumulated; from 4 KB into a 16-byte aligned dst with
// non-temporal stores, fenced before the return (NOTE [streaming copy] in xxh3.cpp).
// Shorter ones are copied, then hashed.
uint64_t xxh3_64_copy(void* dst, const void* src, size_t len) noexcept;

// The implementations of the long-input loop. kAuto picks the fastest this CPU runs
// (AVX2 when the CPU has it, else SSE2 on x86-64, else scalar); the others exist so that
// tests can check each one against the reference.
enum class Xxh3Impl { kAuto, kScalar, kSse2, kAvx2 };

// Whether this build and CPU can run `impl` (kAuto and kScalar always can).
bool xxh3_impl_available(Xxh3Impl impl) noexcept;

// xxh3_64 / xxh3_64_copy using `impl`, which must be available.
uint64_t xxh3_64_with(Xxh3Impl impl, const void* data, size_t len) noexcept;
uint64_t xxh3_64_copy_with(Xxh3Impl impl, void* dst, const void* src, size_t len) noexcept;

}  // namespace pyloader
