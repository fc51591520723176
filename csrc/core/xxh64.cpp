// XXH64, following the steps of the xxHash specification: four lane accumulators over
// 32-byte stripes, merge, then 8-, 4- and 1-byte tail steps and a final avalanche.
#include "xxh64.h"

#include <cstring>

#include "core/hash_load.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PYLOADER_XXH64_X86 1
#else
#define PYLOADER_XXH64_X86 0
#endif

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

// Accumulates the 32-byte stripes of p[0, n) (n a multiple of 32) into the four lanes v[0..3],
// which stay in registers for the whole loop; when kCopy, also stores each stripe at *out
// (advanced). Scalar: eight multiplies per stripe through the core's one 64-bit multiplier.
template <bool kCopy>
inline const uint8_t* stripes_scalar(const uint8_t* p, size_t n, uint64_t* v, uint8_t** out) noexcept {
  uint64_t v1 = v[0], v2 = v[1], v3 = v[2], v4 = v[3];
  uint8_t* o = kCopy ? *out : nullptr;
  const uint8_t* const end = p + n;
  for (; p != end; p += 32) {
    // Load the stripe once; the four lanes are independent dependency chains.
    const uint64_t l1 = le64(p);
    const uint64_t l2 = le64(p + 8);
    const uint64_t l3 = le64(p + 16);
    const uint64_t l4 = le64(p + 24);
    if constexpr (kCopy) {
      if constexpr (kBigEndian) {
        std::memcpy(o, p, 32);  // the lanes are byte-swapped; copy the raw bytes
      } else {
        // Store the lanes already in registers instead of reading src a second time.
        std::memcpy(o, &l1, 8);
        std::memcpy(o + 8, &l2, 8);
        std::memcpy(o + 16, &l3, 8);
        std::memcpy(o + 24, &l4, 8);
      }
      o += 32;
    }
    v1 = lane_round(v1, l1);
    v2 = lane_round(v2, l2);
    v3 = lane_round(v3, l3);
    v4 = lane_round(v4, l4);
  }
  v[0] = v1, v[1] = v2, v[2] = v3, v[3] = v4;
  if constexpr (kCopy) *out = o;
  return p;
}

#if PYLOADER_XXH64_X86
// The four lanes in one 256-bit vector: a stripe is one load, one add, one rotate and two
// 64-bit multiplies (AVX-512 VL and DQ), one dependency chain of add, rotate and multiply,
// about twice the scalar loop's rate where that multiply is fast (AMD Zen 4: 18.8 against
// 9.0 GB/s). Intel's takes 15 cycles, slower than scalar: see vector_lanes().
#define PYLOADER_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq")))

template <bool kCopy>
PYLOADER_AVX512 void stripes_avx512(const uint8_t* p, size_t n, uint64_t* v, uint8_t* out) noexcept {
  const __m256i prime1 = _mm256_set1_epi64x(static_cast<long long>(kPrime1));
  const __m256i prime2 = _mm256_set1_epi64x(static_cast<long long>(kPrime2));
  __m256i acc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
  for (const uint8_t* const end = p + n; p != end; p += 32) {
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (kCopy) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), lanes);
      out += 32;
    }
    acc = _mm256_add_epi64(acc, _mm256_mullo_epi64(lanes, prime2));
    acc = _mm256_mullo_epi64(_mm256_rol_epi64(acc, 31), prime1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), acc);
}

#undef PYLOADER_AVX512

// Whether the CPU runs the vector lanes, and runs them faster than the scalar loop: AMD's
// with AVX-512 VL and DQ (Zen 4 and later).
bool vector_lanes() noexcept {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

bool avx512_runs() noexcept {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#endif  // PYLOADER_XXH64_X86

// The stripes of p[0, n) by `impl` (kAuto: the vector lanes where vector_lanes()). Shared by
// the one-shot and the streaming hash so that they cannot drift apart.
template <bool kCopy>
inline const uint8_t* stripes(Xxh64Impl impl, const uint8_t* p, size_t n, uint64_t* v, uint8_t** out) noexcept {
#if PYLOADER_XXH64_X86
  if (n && (impl == Xxh64Impl::kAvx512 || (impl == Xxh64Impl::kAuto && vector_lanes()))) {
    stripes_avx512<kCopy>(p, n, v, kCopy ? *out : nullptr);
    if constexpr (kCopy) *out += n;
    return p + n;
  }
#endif
  return stripes_scalar<kCopy>(p, n, v, out);
}

// Hashes p[0, len); when kCopy, also copies it to out. Shared so that xxh64 and
// xxh64_copy cannot drift apart.
template <bool kCopy>
inline uint64_t hash_impl(Xxh64Impl impl, const uint8_t* p, size_t len, uint64_t seed, uint8_t* out) noexcept {
  const uint8_t* const end = p + len;
  uint64_t acc;
  if (len >= 32) {
    uint64_t v[4] = {seed + kPrime1 + kPrime2, seed + kPrime2, seed, seed - kPrime1};
    p = stripes<kCopy>(impl, p, (len / 32) * 32, v, &out);
    acc = rotl64(v[0], 1) + rotl64(v[1], 7) + rotl64(v[2], 12) + rotl64(v[3], 18);
    acc = merge_lane(acc, v[0]);
    acc = merge_lane(acc, v[1]);
    acc = merge_lane(acc, v[2]);
    acc = merge_lane(acc, v[3]);
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
  return hash_impl<false>(Xxh64Impl::kAuto, static_cast<const uint8_t*>(data), len, seed, nullptr);
}

uint64_t xxh64_copy(void* dst, const void* src, size_t len, uint64_t seed) noexcept {
  return hash_impl<true>(Xxh64Impl::kAuto, static_cast<const uint8_t*>(src), len, seed, static_cast<uint8_t*>(dst));
}

bool xxh64_impl_available(Xxh64Impl impl) noexcept {
#if PYLOADER_XXH64_X86
  if (impl == Xxh64Impl::kAvx512) return avx512_runs();
#else
  if (impl == Xxh64Impl::kAvx512) return false;
#endif
  return true;
}

uint64_t xxh64_with(Xxh64Impl impl, const void* data, size_t len, uint64_t seed) noexcept {
  return hash_impl<false>(impl, static_cast<const uint8_t*>(data), len, seed, nullptr);
}

Xxh64Stream::Xxh64Stream(uint64_t seed) noexcept
    : seed_(seed), v_{seed + kPrime1 + kPrime2, seed + kPrime2, seed, seed - kPrime1} {}

void Xxh64Stream::update(const void* data, size_t len) noexcept {
  consume<false>(static_cast<const uint8_t*>(data), len, nullptr);
}

void Xxh64Stream::update_copy(void* dst, const void* src, size_t len) noexcept {
  consume<true>(static_cast<const uint8_t*>(src), len, static_cast<uint8_t*>(dst));
}

template <bool kCopy>
void Xxh64Stream::consume(const uint8_t* p, size_t len, uint8_t* out) noexcept {
  total_ += len;
  if (held_) {  // complete the stripe held from the last call first
    size_t k = len < 32 - held_ ? len : 32 - held_;
    std::memcpy(buf_ + held_, p, k);
    if constexpr (kCopy) {
      std::memcpy(out, p, k);
      out += k;
    }
    held_ += k;
    p += k;
    len -= k;
    if (held_ < 32) return;
    stripes<false>(Xxh64Impl::kAuto, buf_, 32, v_, nullptr);
    held_ = 0;
  }
  size_t whole = (len / 32) * 32;
  p = stripes<kCopy>(Xxh64Impl::kAuto, p, whole, v_, &out);
  len -= whole;
  if (len) {
    std::memcpy(buf_, p, len);
    if constexpr (kCopy) std::memcpy(out, p, len);
  }
  held_ = len;
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
