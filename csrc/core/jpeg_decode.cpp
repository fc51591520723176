#include "core/jpeg_decode.h"

#ifdef PYLOADER_WITH_LIBJPEG

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>

namespace pyloader {
namespace {

thread_local char g_message[JMSG_LENGTH_MAX + 64];

// NOTE [jpeg errors]: libjpeg reports a fatal error by calling error_exit, which must not
// return: it longjmps back to the setjmp in the calling function. Those functions hold no
// C++ object with a destructor across the jump (plain buffers only). Warnings (corrupt or
// truncated data, which libjpeg would otherwise paper over with grey) are counted and make
// the decode fail: no silently wrong pixels.
struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  int warnings;
  char message[JMSG_LENGTH_MAX];
};

void on_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void on_emit_message(j_common_ptr cinfo, int level) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  if (level < 0) {  // a warning: the data is corrupt somewhere
    if (err->warnings++ == 0) (*cinfo->err->format_message)(cinfo, err->message);
  }
}

// Routes cinfo's errors and warnings to err (NOTE [jpeg errors]); setjmp stays with the caller.
void use_errors(jpeg_decompress_struct* cinfo, ErrorManager* err) {
  cinfo->err = jpeg_std_error(&err->pub);
  err->pub.error_exit = on_error_exit;
  err->pub.emit_message = on_emit_message;
  err->warnings = 0;
  err->message[0] = '\0';
}

const char* fail(const char* what, const char* detail) {
  std::snprintf(g_message, sizeof(g_message), "%s%s%s", what, detail && *detail ? ": " : "", detail ? detail : "");
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
    return fail("not a readable JPEG", err.message);
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
                               uint8_t* dst) noexcept {
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
    return fail("not a readable JPEG", err.message);
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(len));
  jpeg_read_header(&cinfo, TRUE);
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
  if (err.warnings) return fail("corrupt JPEG data", err.message);
  return nullptr;
}

}  // namespace pyloader

#else  // built without libjpeg: Python decodes with Pillow

namespace pyloader {

bool jpeg_available() noexcept { return false; }

const char* jpeg_read_header_info(const uint8_t*, size_t, JpegHeader*) noexcept {
  return "this build of pyloader has no JPEG decoder (libjpeg-turbo was not found when it was built)";
}

const char* jpeg_decode_region(const uint8_t*, size_t, int, int, int, int, int, int, uint8_t*) noexcept {
  return "this build of pyloader has no JPEG decoder (libjpeg-turbo was not found when it was built)";
}

}  // namespace pyloader

#endif
