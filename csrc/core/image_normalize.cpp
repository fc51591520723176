#include "core/image_normalize.h"

namespace pyloader {
namespace {

// out = x * scale[k] + bias[k], with scale = 1 / (255 std), bias = -mean / std.
template <int C>
void to_chw(const uint8_t* src, float* dst, int64_t n, const float* scale, const float* bias) noexcept {
  for (int k = 0; k < C; ++k) {
    float* out = dst + k * n;
    const float s = scale[k], b = bias[k];
    const uint8_t* in = src + k;
    for (int64_t i = 0; i < n; ++i) out[i] = float(in[i * C]) * s + b;
  }
}

template <int C>
void to_hwc(const uint8_t* src, float* dst, int64_t n, const float* scale, const float* bias) noexcept {
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < C; ++k) dst[i * C + k] = float(src[i * C + k]) * scale[k] + bias[k];
}

template <int C>
void run(const uint8_t* src, float* dst, int64_t n, const float* mean, const float* std, bool chw) noexcept {
  float scale[C], bias[C];
  for (int k = 0; k < C; ++k) {
    scale[k] = 1.0f / (255.0f * std[k]);
    bias[k] = -mean[k] / std[k];
  }
  if (chw)
    to_chw<C>(src, dst, n, scale, bias);
  else
    to_hwc<C>(src, dst, n, scale, bias);
}

}  // namespace

void normalize_u8(const uint8_t* src, float* dst, int64_t h, int64_t w, int c, const float* mean, const float* std,
                  bool chw) noexcept {
  const int64_t n = h * w;
  switch (c) {
    case 1: run<1>(src, dst, n, mean, std, chw); break;
    case 2: run<2>(src, dst, n, mean, std, chw); break;
    case 3: run<3>(src, dst, n, mean, std, chw); break;
    default: run<4>(src, dst, n, mean, std, chw); break;
  }
}

}  // namespace pyloader
