// LZ4 block decoder. See lz4_block.h for the contract.
//
// Every sequence is bounds-checked exactly (lengths against the bytes left in src and
// dst, offsets against the bytes already written). Once a sequence is known to be valid,
// its copies use fixed-size 8- and 16-byte moves that may run past the sequence's end
// ("wild" copies) when, and only when, both buffers have enough slack beyond it; near
// either end an exact copy is used instead. Matches that overlap their own output
// (offset < 16) are written from a register-held copy of the repeating pattern.
#include "lz4_block.h"

#include <cstring>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define PYLOADER_LZ4_SSE2 1
#endif

#if defined(__GNUC__)
#define PYLOADER_LIKELY(x) __builtin_expect(!!(x), 1)
#define PYLOADER_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define PYLOADER_LIKELY(x) (x)
#define PYLOADER_UNLIKELY(x) (x)
#endif

namespace pyloader {
namespace {

// Slack a wild copy needs past the end of what it must produce (and past what it reads).
constexpr size_t kWildSlack = 32;
constexpr size_t kMinMatch = 4;

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__)
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
#else
constexpr bool kLittleEndian = true;  // MSVC targets are little-endian
#endif

inline void copy16(uint8_t* d, const uint8_t* s) noexcept { std::memcpy(d, s, 16); }
inline void copy8(uint8_t* d, const uint8_t* s) noexcept { std::memcpy(d, s, 8); }

inline uint64_t load64(const uint8_t* p) noexcept {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline size_t load_le16(const uint8_t* p) noexcept {
  uint16_t v;
  std::memcpy(&v, p, 2);
  if constexpr (!kLittleEndian) v = static_cast<uint16_t>((v >> 8) | (v << 8));
  return v;
}

inline void store64(uint8_t* p, uint64_t v) noexcept { std::memcpy(p, &v, 8); }

enum class LengthStatus { kOk, kPastInput, kTooLong };

// Adds the 255-continued length bytes that follow a length nibble of 15. Stops when the
// input ends first or the length exceeds `limit`; the limit also keeps the sum far from
// overflowing size_t.
inline LengthStatus read_extra_length(const uint8_t*& ip, const uint8_t* iend, size_t limit, size_t& len) noexcept {
  for (;;) {
    if (PYLOADER_UNLIKELY(ip == iend)) return LengthStatus::kPastInput;
    const unsigned b = *ip++;
    len += b;
    if (PYLOADER_UNLIKELY(len > limit)) return LengthStatus::kTooLong;
    if (b != 255) return LengthStatus::kOk;
  }
}

// Mask of the low `n` bytes, n in [0, 7].
constexpr uint64_t low_bytes_mask(unsigned n) noexcept { return (uint64_t{1} << (8 * n)) - 1; }

// Per-distance constants for matches that overlap their own output (distance d < 16).
// They let copy_short_distance build the 16-byte period-d pattern without branching on d
// or dividing by it.
struct ShortDistance {
  uint64_t mask;   // d < 8: low d bytes; d >= 8: low d - 8 bytes
  uint64_t mul;    // d < 8: replicates a d-byte value across 8 bytes (copies never overlap,
                   // so the product has no carries)
  unsigned shift;  // d < 8: 8 * (8 % d), the pattern's phase at byte 8; d >= 8: 8 * (d - 8)
  unsigned step;   // largest multiple of d that is <= 16: stores this far apart stay in phase
};

constexpr ShortDistance short_distance(unsigned d) noexcept {
  ShortDistance e{0, 0, 0, 0};
  if (d == 0) return e;
  if (d < 8) {
    e.mask = low_bytes_mask(d);
    for (unsigned k = 0; k < 8; k += d) e.mul |= uint64_t{1} << (8 * k);
    e.shift = 8 * (8 % d);
  } else {
    e.mask = low_bytes_mask(d - 8);
    e.mul = 1;
    e.shift = 8 * (d - 8);
  }
  e.step = 16 - 16 % d;
  return e;
}

struct ShortDistanceTable {
  ShortDistance e[16];
  constexpr ShortDistanceTable() : e{} {
    for (unsigned d = 0; d < 16; ++d) e[d] = short_distance(d);
  }
};
constexpr ShortDistanceTable kShortDistance{};

// Bytes 0..7 and 8..15 of the period-d pattern that starts at m (d in [1, 15]). Reads
// m[0, 16) at most, of which only m[0, d) matter. Little-endian only.
inline void short_distance_pattern(const uint8_t* m, unsigned d, uint64_t& lo, uint64_t& hi) noexcept {
  const ShortDistance& e = kShortDistance.e[d];
  if (d < 8) {
    lo = (load64(m) & e.mask) * e.mul;
    // Byte 8 of the pattern is byte 8 % d of its period; d + 8 % d <= 8 holds for every
    // d < 8, so lo still holds a whole period starting there.
    hi = ((lo >> e.shift) & e.mask) * e.mul;
  } else {
    lo = load64(m);
    // Bytes 8..15: the rest of the period, m[8, d), then a restart at m[0].
    hi = (load64(m + 8) & e.mask) | (lo << e.shift);
  }
}

inline void store_pattern(uint8_t* p, uint64_t lo, uint64_t hi) noexcept {
#ifdef PYLOADER_LZ4_SSE2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
#else
  store64(p, lo);
  store64(p + 8, hi);
#endif
}

// Copies `count` bytes of an overlapping match with distance d < 16 to op by storing the
// pattern, kept in registers, every `step` bytes: no store waits on an earlier one.
// Writes up to op + count + 15; reads op - d up to op + 8.
inline void copy_short_distance(uint8_t* op, size_t count, unsigned d) noexcept {
  uint64_t lo;
  uint64_t hi;
  short_distance_pattern(op - d, d, lo, hi);
  const size_t step = kShortDistance.e[d].step;
  uint8_t* const end = op + count;
  uint8_t* p = op;
  do {
    store_pattern(p, lo, hi);
    p += step;
  } while (p < end);
}

// Copies a match of `count` bytes from op - d to op, where the caller guarantees kWildSlack
// writable bytes past op + count. Writes at most op + count + 31.
inline void copy_match_wild(uint8_t* op, size_t count, size_t d) noexcept {
  const uint8_t* m = op - d;
  if (PYLOADER_LIKELY(d >= 16)) {
    // With d >= 16 every 16-byte chunk reads only bytes that earlier chunks (or earlier
    // sequences) already wrote, so chunks must run in order but need no special casing.
    copy16(op, m);
    copy16(op + 16, m + 16);
    for (size_t i = 32; i < count; i += 16) copy16(op + i, m + i);
  } else if (kLittleEndian) {
    copy_short_distance(op, count, static_cast<unsigned>(d));
  } else {
    for (size_t i = 0; i < count; ++i) op[i] = m[i];
  }
}

}  // namespace

const char* lz4_decode_block(const uint8_t* src, size_t src_size, uint8_t* dst, size_t dst_size) noexcept {
  if (src_size == 0) return "empty input (a block holds at least one token)";
  if (dst_size > lz4_max_decoded_size(src_size)) return "the declared size is more than the block can decode to";
  const uint8_t* ip = src;
  const uint8_t* const iend = src + src_size;
  uint8_t* op = dst;
  uint8_t* const oend = dst + dst_size;

  // While ip < in_fast and op < out_fast, a sequence whose token has both nibbles below 15
  // (at most 14 literals, a match of at most 18) cannot cross either end: token, 16-byte
  // literal read and offset fit in the 32-byte input margin, and the 16-byte literal copy
  // plus at most 32 bytes of match stores fit in the 64-byte output margin. Such sequences
  // only need their offset validated. The limits sit at the start of a too-small buffer so
  // the test is always false there.
  constexpr size_t kFastIn = 32;
  constexpr size_t kFastOut = 64;
  const uint8_t* const in_fast = src_size >= kFastIn ? iend - kFastIn : src;
  uint8_t* const out_fast = dst_size >= kFastOut ? oend - kFastOut : dst;

  // Invariant at the top of the loop: ip < iend (a token byte is available).
  for (;;) {
    if (PYLOADER_LIKELY(ip < in_fast && op < out_fast)) {
      const unsigned t = *ip;
      if (PYLOADER_LIKELY((t >> 4) != 15 && (t & 15) != 15)) {
        const size_t lit = t >> 4;
        // Stepping past the token apart from the literals keeps the loop-carried chain
        // (token load -> shift -> add -> next token load) free of a 3-operand LEA, which
        // the empty asm stops the compiler from re-forming.
        const uint8_t* lit_start = ip + 1;
#if defined(__GNUC__)
        __asm__("" : "+r"(lit_start));
#endif
        copy16(op, lit_start);
        ip = lit_start + lit;
        op += lit;
        const size_t offset = load_le16(ip);
        ip += 2;
        // One unsigned compare rejects both offset 0 and offsets before dst.
        if (PYLOADER_UNLIKELY(offset - 1 >= static_cast<size_t>(op - dst))) {
          return offset == 0 ? "match offset is zero" : "match offset before start of output";
        }
        const size_t len = (t & 15) + kMinMatch;
        if (PYLOADER_LIKELY(offset >= 8)) {
          // 8-byte moves, in order: with offset >= 8 each reads only bytes already written.
          // Small loads also tend to be served from a single earlier store.
          const uint8_t* m = op - offset;
          copy8(op, m);
          copy8(op + 8, m + 8);
          copy8(op + 16, m + 16);
        } else if (kLittleEndian) {
          // len <= 18 and step >= 9, so two stores cover the match without a loop.
          const unsigned d = static_cast<unsigned>(offset);
          uint64_t lo;
          uint64_t hi;
          short_distance_pattern(op - d, d, lo, hi);
          store_pattern(op, lo, hi);
          store_pattern(op + kShortDistance.e[d].step, lo, hi);
        } else {
          for (size_t i = 0; i < len; ++i) op[i] = op[i - offset];
        }
        op += len;
        continue;
      }
    }

    const unsigned token = *ip++;

    // Literals.
    size_t lit = token >> 4;
    if (lit == 15) {
      const LengthStatus st = read_extra_length(ip, iend, dst_size, lit);
      if (st == LengthStatus::kPastInput) return "literal length runs past end of input";
      if (st == LengthStatus::kTooLong) return "literal length exceeds output size";
    }
    const size_t in_left = static_cast<size_t>(iend - ip);
    const size_t out_left = static_cast<size_t>(oend - op);
    if (PYLOADER_LIKELY(lit <= 16 && in_left >= 16 && out_left >= 16)) {
      copy16(op, ip);
    } else {
      if (lit > in_left) return "literal run past end of input";
      if (lit > out_left) return "literal run past end of output";
      if (in_left - lit >= kWildSlack && out_left - lit >= kWildSlack) {
        for (size_t i = 0; i < lit; i += 32) {
          copy16(op + i, ip + i);
          copy16(op + i + 16, ip + i + 16);
        }
      } else if (lit != 0) {
        std::memcpy(op, ip, lit);
      }
    }
    ip += lit;
    op += lit;

    // The last sequence stops right after its literals.
    if (ip == iend) return op == oend ? nullptr : "input ends before output is full";

    // Match.
    if (PYLOADER_UNLIKELY(iend - ip < 2)) return "truncated match offset";
    const size_t offset = load_le16(ip);
    ip += 2;
    size_t len = token & 15;
    if (len == 15) {
      const LengthStatus st = read_extra_length(ip, iend, dst_size, len);
      if (st == LengthStatus::kPastInput) return "match length runs past end of input";
      if (st == LengthStatus::kTooLong) return "match length exceeds output size";
    }
    len += kMinMatch;
    if (PYLOADER_UNLIKELY(offset == 0)) return "match offset is zero";
    if (PYLOADER_UNLIKELY(offset > static_cast<size_t>(op - dst))) {
      return "match offset before start of output";
    }
    const size_t room = static_cast<size_t>(oend - op);
    if (PYLOADER_UNLIKELY(len > room)) return "match runs past end of output";

    if (PYLOADER_LIKELY(room - len >= kWildSlack)) {
      copy_match_wild(op, len, offset);
    } else {
      // Near the end of dst: wild-copy the bulk of a long match, then finish exactly.
      // Byte order matters when the match overlaps its own output (offset < len).
      size_t done = 0;
      if (len >= 2 * kWildSlack) {
        done = len - kWildSlack;
        copy_match_wild(op, done, offset);
      }
      const uint8_t* m = op - offset;
      if (offset >= len) {
        std::memcpy(op + done, m + done, len - done);
      } else {
        for (size_t i = done; i < len; ++i) op[i] = m[i];
      }
    }
    op += len;

    if (PYLOADER_UNLIKELY(ip == iend)) return "input ends with a match (missing last literals)";
  }
}

}  // namespace pyloader
