// The native counters' clock.
#pragma once

#include <chrono>
#include <cstdint>

namespace pyloader {

// Nanoseconds on the steady clock, from an arbitrary start: for intervals only.
inline uint64_t now_ns() noexcept {
  return uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace pyloader
