#include "core/jpeg_decode.h"

#ifdef PYLOADER_WITH_LIBJPEG

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>

namespace pyloader {
namespace {

thread_local char g_message[JMSG_LENGTH_MAX + 64];

// NOTE [jpeg errors]: libjpeg reports a fatal error by calling error_exit, which must not
// return: it longjmps back to the setjmp in the calling function. Those functions hold no
// C++ object with a destructor across the jump (plain buffers only). A warning (corrupt or
// truncated data, which libjpeg would otherwise paper over with grey for every row left)
// jumps back the same way at once: the decode fails there, with no silently wrong pixels
// and no work or memory spent on the rest of a damaged image (NOTE [pixel limit]).
struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  bool warning;  // the jump came from a warning, not an error
  char message[JMSG_LENGTH_MAX];
};

void on_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void on_emit_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  // A warning: the data is corrupt somewhere. Stop now (NOTE [jpeg errors]).
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  err->warning = true;
  std::longjmp(err->jump, 1);
}

// Routes cinfo's errors and warnings to err (NOTE [jpeg errors]); setjmp stays with the caller.
void use_errors(jpeg_decompress_struct* cinfo, ErrorManager* err) {
  cinfo->err = jpeg_std_error(&err->pub);
  err->pub.error_exit = on_error_exit;
  err->pub.emit_message = on_emit_message;
  err->warning = false;
  err->message[0] = '\0';
}

// Caps libjpeg's memory manager at what an image of max_pixels pixels can need: at full
// scale, its DCT coefficients (2 bytes per sample, at most 4 components: a progressive or
// multi-scan image buffers all of them) plus 16 MiB of tables and rows (NOTE [pixel limit]).
void limit_memory(jpeg_decompress_struct* cinfo, uint64_t max_pixels) {
  const uint64_t cap = max_pixels < (uint64_t(1) << 56) ? max_pixels * 8 + (uint64_t(16) << 20) : ~uint64_t(0);
  cinfo->mem->max_memory_to_use = long(std::min<uint64_t>(cap, uint64_t(std::numeric_limits<long>::max())));
}

// The message of a failed decode, saying whether a warning stopped it.
const char* failure(const ErrorManager& err);

const char* fail(const char* what, const char* detail) {
  std::snprintf(g_message, sizeof(g_message), "%s%s%s", what, detail && *detail ? ": " : "", detail ? detail : "");
  return g_message;
}

const char* failure(const ErrorManager& err) {
  std::snprintf(g_message, sizeof(g_message), "not a readable JPEG: %s%s", err.message,
                err.warning ? " (the decode stopped at this first warning)" : "");
  return g_message;
}

}  // namespace

bool jpeg_available() noexcept { return true; }

const char* jpeg_read_header_info(const uint8_t* data, size_t len, JpegHeader* out) noexcept {
  jpeg_decompress_struct cinfo;
  ErrorManager err;
  use_errors(&cinfo, &err);
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return failure(err);
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(len));
  jpeg_read_header(&cinfo, TRUE);
  out->width = int(cinfo.image_width);
  out->height = int(cinfo.image_height);
  out->components = cinfo.num_components;
  out->progressive = jpeg_has_multiple_scans(&cinfo) != 0;
  jpeg_destroy_decompress(&cinfo);
  return nullptr;
}

const char* jpeg_decode_region(const uint8_t* data, size_t len, int denom, int x0, int y0, int w, int h, int channels,
                               uint8_t* dst, uint64_t max_pixels) noexcept {
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) return fail("denom must be 1, 2, 4 or 8", nullptr);
  if (channels != 1 && channels != 3) return fail("channels must be 1 or 3", nullptr);
  if (w <= 0 || h <= 0 || x0 < 0 || y0 < 0) return fail("empty or negative region", nullptr);
  jpeg_decompress_struct cinfo;
  ErrorManager err;
  use_errors(&cinfo, &err);
  // The row buffer is a plain allocation freed on every path (no destructor across longjmp).
  unsigned char* volatile row = nullptr;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    std::free(row);
    return failure(err);
  }
  jpeg_create_decompress(&cinfo);
  limit_memory(&cinfo, max_pixels);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(len));
  jpeg_read_header(&cinfo, TRUE);
  // See NOTE [pixel limit]: from the header, before libjpeg sizes anything by the image.
  if (const uint64_t pixels = uint64_t(cinfo.image_width) * cinfo.image_height; pixels > max_pixels) {
    jpeg_destroy_decompress(&cinfo);
    std::snprintf(g_message, sizeof(g_message),
                  "image of %ux%u = %llu pixels is more than max_pixels (%llu): refused before decoding "
                  "(a decompression bomb, or raise max_pixels)",
                  unsigned(cinfo.image_width), unsigned(cinfo.image_height), static_cast<unsigned long long>(pixels),
                  static_cast<unsigned long long>(max_pixels));
    return g_message;
  }
  cinfo.scale_num = 1;
  cinfo.scale_denom = unsigned(denom);
  cinfo.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const int full_w = int(cinfo.output_width), full_h = int(cinfo.output_height);
  if (x0 + w > full_w || y0 + h > full_h || cinfo.output_components != channels) {
    jpeg_destroy_decompress(&cinfo);
    std::snprintf(g_message, sizeof(g_message),
                  "region %dx%d at (%d, %d) outside the %dx%d image at scale 1/%d (or %d channels, not %d)", w, h, x0,
                  y0, full_w, full_h, denom, int(cinfo.output_components), channels);
    return g_message;
  }
  // Columns: libjpeg widens the crop to whole iMCUs; xoff/cw say where it landed.
  JDIMENSION xoff = JDIMENSION(x0), cw = JDIMENSION(w);
  if (x0 != 0 || w != full_w) jpeg_crop_scanline(&cinfo, &xoff, &cw);
  const size_t skip_cols = size_t(x0) - size_t(xoff);
  row = static_cast<unsigned char*>(std::malloc(size_t(cw) * size_t(channels)));
  if (row == nullptr) {
    jpeg_destroy_decompress(&cinfo);
    return fail("out of memory", nullptr);
  }
  if (y0 > 0 && jpeg_skip_scanlines(&cinfo, JDIMENSION(y0)) != JDIMENSION(y0)) {
    jpeg_destroy_decompress(&cinfo);
    std::free(row);
    return fail("not a readable JPEG", "could not skip to the region");
  }
  const size_t row_bytes = size_t(w) * size_t(channels);
  for (int r = 0; r < h; ++r) {
    JSAMPROW rows[1] = {row};
    if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
      jpeg_destroy_decompress(&cinfo);
      std::free(row);
      return fail("not a readable JPEG", "fewer rows than the header says");
    }
    std::memcpy(dst + size_t(r) * row_bytes, row + skip_cols * size_t(channels), row_bytes);
  }
  // The rest of the image is not needed: stop without decoding it.
  jpeg_abort_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  std::free(row);
  return nullptr;
}

}  // namespace pyloader

#else  // built without libjpeg: Python decodes with Pillow

namespace pyloader {

bool jpeg_available() noexcept { return false; }

const char* jpeg_read_header_info(const uint8_t*, size_t, JpegHeader*) noexcept {
  return "this build of pyloader has no JPEG decoder (libjpeg-turbo was not found when it was built)";
}

const char* jpeg_decode_region(const uint8_t*, size_t, int, int, int, int, int, int, uint8_t*, uint64_t) noexcept {
  return "this build of pyloader has no JPEG decoder (libjpeg-turbo was not found when it was built)";
}

}  // namespace pyloader

#endif
