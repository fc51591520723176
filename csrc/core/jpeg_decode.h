// JPEG decoding through the system's libjpeg-turbo (its libjpeg API), when the extension was
// built with it (PYLOADER_WITH_LIBJPEG): the header, then a region of the image at a DCT
// scale, rows above and below the region skipped and columns outside it mostly not decoded.
// Runs without Python; the bindings release the GIL around it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// NOTE [pixel limit]: an image header can claim up to 65535 x 65535 pixels in a few hundred
// bytes, and a decoder sizes its output (and libjpeg its coefficient buffers) from the
// header. So every decode path (the native JPEG path here, Pillow's for everything else in
// pyloader/transform/image.py) refuses an image of more than `max_pixels` pixels from its
// header, before allocating anything for it; ImageDecode's default is Pillow's default
// limit (Image.MAX_IMAGE_PIXELS, 89,478,485: ~256 MiB of RGB). libjpeg's own memory
// manager is capped (max_memory_to_use) at what an image of max_pixels can need, and a
// corrupt-data warning stops the decode at once, so a damaged image never has the rest of
// its rows filled in (and its buffers touched) first.
inline constexpr uint64_t kDefaultMaxPixels = 89478485;

// Whether this build can decode JPEG (it found libjpeg-turbo's headers and library).
bool jpeg_available() noexcept;

struct JpegHeader {
  int width = 0;
  int height = 0;
  int components = 0;  // as stored: 1 grey, 3 YCbCr/RGB, 4 CMYK/YCCK
  bool progressive = false;
};

// Reads the header of data[0, len). Returns nullptr on success, else why not (a static or
// thread-local message, valid until the next call on this thread).
const char* jpeg_read_header_info(const uint8_t* data, size_t len, JpegHeader* out) noexcept;

// Decodes the region x0, y0, w x h of the image scaled by 1/denom (denom 1, 2, 4 or 8:
// ceil(width / denom) x ceil(height / denom)) into dst, h rows of w pixels of `channels`
// bytes (3: RGB, 1: grey), rows contiguous. An image of more than max_pixels pixels (its
// full size, from the header) is refused before decoding (NOTE [pixel limit]); any libjpeg
// warning (corrupt or truncated data) stops the decode as an error. Returns nullptr on
// success, else why not (as above).
const char* jpeg_decode_region(const uint8_t* data, size_t len, int denom, int x0, int y0, int w, int h, int channels,
                               uint8_t* dst, uint64_t max_pixels = kDefaultMaxPixels) noexcept;

}  // namespace pyloader
