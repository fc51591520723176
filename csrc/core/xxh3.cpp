// XXH3-64 with seed 0 and the default secret, following the xxHash specification: one
// routine per length class up to 240 bytes, and for longer inputs eight 64-bit lane
// accumulators fed 64-byte stripes, scrambled after each 1024-byte block, then merged.
//
// The long-input loop has three implementations with identical results: scalar (any
// host), SSE2 (the x86-64 baseline) and AVX2, compiled with a function target attribute
// and chosen at run time, so one build runs on every x86-64 CPU.
#include "xxh3.h"

#include <cstring>

#include "core/hash_load.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PYLOADER_XXH3_X86 1
#else
#define PYLOADER_XXH3_X86 0
#endif

namespace pyloader {
namespace {

constexpr uint64_t kPrime32_1 = 0x9E3779B1U;
constexpr uint64_t kPrime32_2 = 0x85EBCA77U;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3DU;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ULL;
constexpr uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ULL;

// The specification's default secret.
alignas(64) constexpr uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4,
    0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e,
    0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43,
    0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb,
    0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
    0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7,
    0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78,
    0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16,
    0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
    0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
constexpr size_t kSecretSize = sizeof(kSecret);
constexpr size_t kStripeLen = 64;
constexpr size_t kSecretConsumeRate = 8;  // each stripe of a block uses the secret 8 bytes further on
constexpr size_t kStripesPerBlock = (kSecretSize - kStripeLen) / kSecretConsumeRate;  // 16
constexpr size_t kBlockLen = kStripeLen * kStripesPerBlock;                           // 1024
constexpr size_t kLastStripeSecret = kSecretSize - kStripeLen - 7;  // the final stripe's secret offset
constexpr size_t kScrambleSecret = kSecretSize - kStripeLen;
constexpr size_t kMergeSecret = 11;
constexpr size_t kMidSizeMax = 240;

using hash_load::le32;
using hash_load::le64;
using hash_load::rotl64;

inline uint64_t swap64(uint64_t x) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_bswap64(x);
#else
  uint64_t out = 0;
  for (int i = 0; i < 8; ++i) out = (out << 8) | ((x >> (8 * i)) & 0xff);
  return out;
#endif
}

// The 128-bit product of a and b, folded to 64 bits by xoring its halves.
inline uint64_t mul128_fold64(uint64_t a, uint64_t b) noexcept {
#if defined(__SIZEOF_INT128__)
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#else
  const uint64_t lo_lo = (a & 0xffffffffu) * (b & 0xffffffffu);
  const uint64_t hi_lo = (a >> 32) * (b & 0xffffffffu);
  const uint64_t lo_hi = (a & 0xffffffffu) * (b >> 32);
  const uint64_t hi_hi = (a >> 32) * (b >> 32);
  const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
  const uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
  const uint64_t lower = (cross << 32) | (lo_lo & 0xffffffffu);
  return lower ^ upper;
#endif
}

inline uint64_t xxh64_avalanche(uint64_t h) noexcept {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  h ^= h >> 32;
  return h;
}

inline uint64_t avalanche(uint64_t h) noexcept {
  h ^= h >> 37;
  h *= kPrimeMx1;
  h ^= h >> 32;
  return h;
}

inline uint64_t rrmxmx(uint64_t h, uint64_t len) noexcept {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  h ^= h >> 28;
  return h;
}

inline uint64_t mix16(const uint8_t* in, const uint8_t* secret) noexcept {
  return mul128_fold64(le64(in) ^ le64(secret), le64(in + 8) ^ le64(secret + 8));
}

// ---- inputs of at most 240 bytes ------------------------------------------------------

uint64_t hash_0to16(const uint8_t* in, size_t len) noexcept {
  if (len > 8) {
    const uint64_t lo = le64(in) ^ (le64(kSecret + 24) ^ le64(kSecret + 32));
    const uint64_t hi = le64(in + len - 8) ^ (le64(kSecret + 40) ^ le64(kSecret + 48));
    return avalanche(uint64_t(len) + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  if (len >= 4) {
    const uint64_t first = le32(in), last = le32(in + len - 4);
    const uint64_t keyed = (last + (first << 32)) ^ (le64(kSecret + 8) ^ le64(kSecret + 16));
    return rrmxmx(keyed, len);
  }
  if (len > 0) {
    const uint32_t combined = (uint32_t(in[0]) << 16) | (uint32_t(in[len >> 1]) << 24) | uint32_t(in[len - 1]) |
                              (uint32_t(len) << 8);
    return xxh64_avalanche(uint64_t(combined) ^ uint64_t(le32(kSecret) ^ le32(kSecret + 4)));
  }
  return xxh64_avalanche(le64(kSecret + 56) ^ le64(kSecret + 64));
}

uint64_t hash_17to128(const uint8_t* in, size_t len) noexcept {
  uint64_t acc = uint64_t(len) * kPrime64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) {
        acc += mix16(in + 48, kSecret + 96);
        acc += mix16(in + len - 64, kSecret + 112);
      }
      acc += mix16(in + 32, kSecret + 64);
      acc += mix16(in + len - 48, kSecret + 80);
    }
    acc += mix16(in + 16, kSecret + 32);
    acc += mix16(in + len - 32, kSecret + 48);
  }
  acc += mix16(in, kSecret);
  acc += mix16(in + len - 16, kSecret + 16);
  return avalanche(acc);
}

uint64_t hash_129to240(const uint8_t* in, size_t len) noexcept {
  uint64_t acc = uint64_t(len) * kPrime64_1;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, kSecret + 16 * i);
  acc = avalanche(acc);
  // Rounds 8.. use the secret from byte 3 on; the last 16 bytes use bytes 119..134.
  const size_t rounds = len / 16;
  for (size_t i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, kSecret + 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, kSecret + 136 - 17);
  return avalanche(acc);
}

uint64_t hash_short(const uint8_t* in, size_t len) noexcept {
  if (len <= 16) return hash_0to16(in, len);
  if (len <= 128) return hash_17to128(in, len);
  return hash_129to240(in, len);
}

// ---- inputs longer than 240 bytes -----------------------------------------------------
//
// Each kernel provides, over accumulators held as uint64_t[8]:
//   blocks<kStore>(acc, in, n, out): n whole 1024-byte blocks, each 16 stripes then a scramble;
//   stripes<kStore>(acc, in, n, secret, out): n stripes, stripe s keyed by secret + 8 * s.
// Unless kStore is kNone, every stripe loaded is also stored to the same offset of out:
// kStream with non-temporal stores (out 16-byte aligned; the caller fences), which a
// kernel without them treats as kPlain.

// NOTE [streaming copy]: a first read copies each value into a batch buffer that is written
// once and read later by the consumer or a DMA engine, usually memory that is not in the
// cache. Plain stores first read every destination line (read-for-ownership); non-temporal
// stores do not. Copying 150 KB records into fresh 38 MB batch buffers (shuffled, page cache
// hot): 10.0 -> 12.1 GB/s per thread (medians of six, plain memcpy-like copy_row 13.0); no
// change on 12 KB records. Short values keep plain stores (their lines stay in the cache).
enum class Store { kNone, kPlain, kStream };

inline void stripe_scalar(uint64_t* acc, const uint8_t* in, const uint8_t* secret) noexcept {
  for (size_t i = 0; i < 8; ++i) {
    const uint64_t v = le64(in + 8 * i);
    const uint64_t key = v ^ le64(secret + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (key & 0xffffffffu) * (key >> 32);
  }
}

inline void scramble_scalar(uint64_t* acc, const uint8_t* secret) noexcept {
  for (size_t i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= le64(secret + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}

struct ScalarKernel {
  template <Store kStore>
  static void stripes(uint64_t* acc, const uint8_t* in, size_t n, const uint8_t* secret, uint8_t* out) noexcept {
    for (size_t s = 0; s < n; ++s) {
      if constexpr (kStore != Store::kNone) std::memcpy(out + s * kStripeLen, in + s * kStripeLen, kStripeLen);
      stripe_scalar(acc, in + s * kStripeLen, secret + s * kSecretConsumeRate);
    }
  }
  template <Store kStore>
  static void blocks(uint64_t* acc, const uint8_t* in, size_t n, uint8_t* out) noexcept {
    for (size_t b = 0; b < n; ++b) {
      stripes<kStore>(acc, in + b * kBlockLen, kStripesPerBlock, kSecret, out ? out + b * kBlockLen : nullptr);
      scramble_scalar(acc, kSecret + kScrambleSecret);
    }
  }
};

#if PYLOADER_XXH3_X86

// SSE2: two 64-bit lanes per vector, four vectors per stripe.
template <Store kStore>
inline void stripe_sse2(__m128i* acc, const uint8_t* in, const uint8_t* secret, uint8_t* out) noexcept {
  for (int i = 0; i < 4; ++i) {
    const __m128i data = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in) + i);
    if constexpr (kStore == Store::kPlain) _mm_storeu_si128(reinterpret_cast<__m128i*>(out) + i, data);
    if constexpr (kStore == Store::kStream) _mm_stream_si128(reinterpret_cast<__m128i*>(out) + i, data);
    const __m128i key = _mm_xor_si128(data, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret) + i));
    // Each lane: low 32 bits of key times its high 32 bits; plus the other lane's input.
    const __m128i product = _mm_mul_epu32(key, _mm_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1)));
    const __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    acc[i] = _mm_add_epi64(acc[i], _mm_add_epi64(product, swapped));
  }
}

inline void scramble_sse2(__m128i* acc, const uint8_t* secret) noexcept {
  const __m128i prime = _mm_set1_epi32(int(kPrime32_1));
  for (int i = 0; i < 4; ++i) {
    __m128i a = _mm_xor_si128(acc[i], _mm_srli_epi64(acc[i], 47));
    a = _mm_xor_si128(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret) + i));
    // a * kPrime32_1 mod 2^64, from two 32x32->64 products.
    const __m128i lo = _mm_mul_epu32(a, prime);
    const __m128i hi = _mm_mul_epu32(_mm_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
    acc[i] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
  }
}

struct Sse2Kernel {
  template <Store kStore>
  static void stripes(uint64_t* acc_mem, const uint8_t* in, size_t n, const uint8_t* secret, uint8_t* out) noexcept {
    __m128i acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc_mem) + i);
    for (size_t s = 0; s < n; ++s)
      stripe_sse2<kStore>(acc, in + s * kStripeLen, secret + s * kSecretConsumeRate,
                          out ? out + s * kStripeLen : nullptr);
    for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc_mem) + i, acc[i]);
  }
  template <Store kStore>
  static void blocks(uint64_t* acc_mem, const uint8_t* in, size_t n, uint8_t* out) noexcept {
    __m128i acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc_mem) + i);
    for (size_t b = 0; b < n; ++b) {
      const uint8_t* blk = in + b * kBlockLen;
      for (size_t s = 0; s < kStripesPerBlock; ++s)
        stripe_sse2<kStore>(acc, blk + s * kStripeLen, kSecret + s * kSecretConsumeRate,
                            out ? out + b * kBlockLen + s * kStripeLen : nullptr);
      scramble_sse2(acc, kSecret + kScrambleSecret);
    }
    for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc_mem) + i, acc[i]);
  }
};

// AVX2: the same steps on four 64-bit lanes per vector, two vectors per stripe.
#define PYLOADER_AVX2 __attribute__((target("avx2")))

template <Store kStore>
PYLOADER_AVX2 inline void stripe_avx2(__m256i* acc, const uint8_t* in, const uint8_t* secret, uint8_t* out) noexcept {
  for (int i = 0; i < 2; ++i) {
    const __m256i data = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + i);
    if constexpr (kStore == Store::kPlain) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out) + i, data);
    if constexpr (kStore == Store::kStream) {  // out is 16-byte aligned: two 16-byte halves
      _mm_stream_si128(reinterpret_cast<__m128i*>(out) + 2 * i, _mm256_castsi256_si128(data));
      _mm_stream_si128(reinterpret_cast<__m128i*>(out) + 2 * i + 1, _mm256_extracti128_si256(data, 1));
    }
    const __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret) + i));
    const __m256i product = _mm256_mul_epu32(key, _mm256_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1)));
    const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, swapped));
  }
}

PYLOADER_AVX2 inline void scramble_avx2(__m256i* acc, const uint8_t* secret) noexcept {
  const __m256i prime = _mm256_set1_epi32(int(kPrime32_1));
  for (int i = 0; i < 2; ++i) {
    __m256i a = _mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret) + i));
    const __m256i lo = _mm256_mul_epu32(a, prime);
    const __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
    acc[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
  }
}

struct Avx2Kernel {
  template <Store kStore>
  PYLOADER_AVX2 static void stripes(uint64_t* acc_mem, const uint8_t* in, size_t n, const uint8_t* secret,
                                    uint8_t* out) noexcept {
    __m256i acc[2];
    for (int i = 0; i < 2; ++i) acc[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_mem) + i);
    for (size_t s = 0; s < n; ++s)
      stripe_avx2<kStore>(acc, in + s * kStripeLen, secret + s * kSecretConsumeRate,
                          out ? out + s * kStripeLen : nullptr);
    for (int i = 0; i < 2; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_mem) + i, acc[i]);
  }
  template <Store kStore>
  PYLOADER_AVX2 static void blocks(uint64_t* acc_mem, const uint8_t* in, size_t n, uint8_t* out) noexcept {
    __m256i acc[2];
    for (int i = 0; i < 2; ++i) acc[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_mem) + i);
    for (size_t b = 0; b < n; ++b) {
      const uint8_t* blk = in + b * kBlockLen;
      for (size_t s = 0; s < kStripesPerBlock; ++s)
        stripe_avx2<kStore>(acc, blk + s * kStripeLen, kSecret + s * kSecretConsumeRate,
                            out ? out + b * kBlockLen + s * kStripeLen : nullptr);
      scramble_avx2(acc, kSecret + kScrambleSecret);
    }
    for (int i = 0; i < 2; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_mem) + i, acc[i]);
  }
};

#undef PYLOADER_AVX2

bool cpu_has_avx2() noexcept {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

#endif  // PYLOADER_XXH3_X86

// Whole blocks, then the stripes of the last partial block, then the input's last 64
// bytes as one more stripe (it may overlap stripes already taken, and covers the rest).
template <typename Kernel, Store kStore>
uint64_t hash_long(const uint8_t* in, size_t len, uint8_t* out) noexcept {
  alignas(32) uint64_t acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                 kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  const size_t nb_blocks = (len - 1) / kBlockLen;
  Kernel::template blocks<kStore>(acc, in, nb_blocks, out);
  const size_t done = nb_blocks * kBlockLen;
  const size_t nb_stripes = (len - 1 - done) / kStripeLen;
  Kernel::template stripes<kStore>(acc, in + done, nb_stripes, kSecret, out ? out + done : nullptr);
  // The input's last 64 bytes: unaligned in out whenever len is not a multiple of 16, so
  // stored plainly (after the streamed stripes it may overlap: same bytes either way).
  const size_t last = len - kStripeLen;
  constexpr Store kLastStore = kStore == Store::kStream ? Store::kPlain : kStore;
  Kernel::template stripes<kLastStore>(acc, in + last, 1, kSecret + kLastStripeSecret, out ? out + last : nullptr);

  uint64_t result = uint64_t(len) * kPrime64_1;
  for (size_t i = 0; i < 4; ++i) {
    const uint8_t* s = kSecret + kMergeSecret + 16 * i;
    result += mul128_fold64(acc[2 * i] ^ le64(s), acc[2 * i + 1] ^ le64(s + 8));
  }
  return avalanche(result);
}

using LongFn = uint64_t (*)(const uint8_t*, size_t, uint8_t*) noexcept;

template <Store kStore>
LongFn long_fn(Xxh3Impl impl) noexcept {
#if PYLOADER_XXH3_X86
  if (impl == Xxh3Impl::kAuto) impl = cpu_has_avx2() ? Xxh3Impl::kAvx2 : Xxh3Impl::kSse2;
  if (impl == Xxh3Impl::kAvx2) return &hash_long<Avx2Kernel, kStore>;
  if (impl == Xxh3Impl::kSse2) return &hash_long<Sse2Kernel, kStore>;
#endif
  return &hash_long<ScalarKernel, kStore>;
}

template <Store kStore>
LongFn auto_long_fn() noexcept {
  static const LongFn fn = long_fn<kStore>(Xxh3Impl::kAuto);
  return fn;
}

// See NOTE [streaming copy]: values of at least this many bytes, into a 16-byte aligned
// destination, are copied with non-temporal stores.
constexpr size_t kStreamMin = 4096;

bool streams(const void* dst, size_t len) noexcept {
#if PYLOADER_XXH3_X86
  return len >= kStreamMin && (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
#else
  (void)dst;
  (void)len;
  return false;
#endif
}

// The long copy loop for dst; non-temporal stores are fenced before it returns, so the
// caller sees an ordinary copy (the fence costs tens of cycles against >= 4 KB copied).
uint64_t copy_long(LongFn plain, LongFn stream, const uint8_t* in, size_t len, void* dst) noexcept {
  if (!streams(dst, len)) return plain(in, len, static_cast<uint8_t*>(dst));
  const uint64_t h = stream(in, len, static_cast<uint8_t*>(dst));
#if PYLOADER_XXH3_X86
  _mm_sfence();
#endif
  return h;
}

}  // namespace

bool xxh3_impl_available(Xxh3Impl impl) noexcept {
  switch (impl) {
    case Xxh3Impl::kAuto:
    case Xxh3Impl::kScalar: return true;
#if PYLOADER_XXH3_X86
    case Xxh3Impl::kSse2: return true;
    case Xxh3Impl::kAvx2: return cpu_has_avx2();
#endif
    default: return false;
  }
}

uint64_t xxh3_64(const void* data, size_t len) noexcept {
  const auto* in = static_cast<const uint8_t*>(data);
  if (len <= kMidSizeMax) return hash_short(in, len);
  return auto_long_fn<Store::kNone>()(in, len, nullptr);
}

uint64_t xxh3_64_copy(void* dst, const void* src, size_t len) noexcept {
  const auto* in = static_cast<const uint8_t*>(src);
  if (len <= kMidSizeMax) {
    if (len != 0) std::memcpy(dst, src, len);
    return hash_short(in, len);
  }
  return copy_long(auto_long_fn<Store::kPlain>(), auto_long_fn<Store::kStream>(), in, len, dst);
}

uint64_t xxh3_64_with(Xxh3Impl impl, const void* data, size_t len) noexcept {
  const auto* in = static_cast<const uint8_t*>(data);
  if (len <= kMidSizeMax) return hash_short(in, len);
  return long_fn<Store::kNone>(impl)(in, len, nullptr);
}

uint64_t xxh3_64_copy_with(Xxh3Impl impl, void* dst, const void* src, size_t len) noexcept {
  const auto* in = static_cast<const uint8_t*>(src);
  if (len <= kMidSizeMax) {
    if (len != 0) std::memcpy(dst, src, len);
    return hash_short(in, len);
  }
  return copy_long(long_fn<Store::kPlain>(impl), long_fn<Store::kStream>(impl), in, len, dst);
}

}  // namespace pyloader
