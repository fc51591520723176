// Normalising decoded images: uint8 pixels to float, (x / 255 - mean[c]) / std[c], in one pass.
#pragma once

#include <cstdint>

namespace pyloader {

// src: h x w x c uint8 pixels (HWC, rows contiguous). dst: c x h x w floats (chw = true) or
// h x w x c (chw = false). mean and std have c entries each, in units of 1/255 of a pixel
// (torchvision's Normalize after ToTensor). c is 1..4. One read of src, one write of dst:
// torch's x.permute().float().div_().sub_().div_() makes four passes over the floats.
void normalize_u8(const uint8_t* src, float* dst, int64_t h, int64_t w, int c, const float* mean, const float* std,
                  bool chw) noexcept;

}  // namespace pyloader
