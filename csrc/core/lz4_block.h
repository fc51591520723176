// Decoder for one raw LZ4 block (the block format only: no frame header, no checksum).
// Written from the public format description (lz4/lz4 doc/lz4_Block_format.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// Decodes one raw LZ4 block from src[0, src_size) into dst, which must receive exactly
// dst_size bytes. Returns nullptr on success, or a static, human-readable C string saying
// why the block is malformed. The input is treated as hostile: for any bytes, the decoder
// reads only [src, src + src_size) and writes only [dst, dst + dst_size). On error, the
// contents of dst are unspecified. src and dst must not overlap. dst may be null when
// dst_size is 0.
//
// Accepted: any sequence of well-formed sequences whose last one holds only literals and
// ends exactly at the end of src, having produced exactly dst_size bytes. The optional
// end-of-block restrictions of the format (last 5 bytes literals, last match 12 bytes
// before the end) are not enforced, so every block liblz4 produces is accepted.
const char* lz4_decode_block(const uint8_t* src, size_t src_size, uint8_t* dst, size_t dst_size) noexcept;

// The most bytes an LZ4 block of `src_size` bytes can decode to. A sequence's token and
// offset (3 bytes) produce at most 19 bytes, a literal byte one, and each length byte at
// most 255 (a match or literal length continued by 255; literals also need their own input
// bytes): no input byte adds more than 255 bytes of output. A declared decoded size above
// this is a forgery, refused before anything is allocated for it (NOTE [value bounds] in
// shard_reader.h).
inline constexpr uint64_t kLz4MaxExpansion = 255;
constexpr uint64_t lz4_max_decoded_size(uint64_t src_size) noexcept { return src_size * kLz4MaxExpansion; }

}  // namespace pyloader
