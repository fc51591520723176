// Where batch buffers live: pageable memory, or page-locked ("pinned") memory from the
// CUDA driver, which a DMA engine reads directly so host-to-device copies run at full
// PCIe bandwidth and truly asynchronously. The slot pool and the ring logic are the same
// for both (NOTE [slot reuse] in core/slot_pool.h).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cuda_driver.h"

namespace pyloader {

// What an allocator holds and how often it went to the OS or the driver (for stats()).
struct HostMemoryStats {
  uint64_t live_bytes = 0;          // handed out and not released
  uint64_t cached_bytes = 0;        // released and kept for reuse (the pinned cache)
  uint64_t cache_limit = 0;         // the most the cache keeps
  uint64_t allocs = 0;              // buffers handed out
  uint64_t reused = 0;              // ... of them from the cache
  uint64_t driver_allocs = 0;       // system or driver allocations (cuMemHostAlloc when pinned)
  uint64_t driver_frees = 0;        // system or driver frees (cuMemFreeHost when pinned)
  uint64_t driver_alloc_bytes = 0;  // bytes of those allocations
  uint64_t driver_alloc_ns = 0;     // thread time in them (the kernel populating pages, or the driver)
};

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // The size to allocate for a buffer that must hold n bytes and now has cap (0: none):
  // rounded up, with headroom on regrowth so that rising variable lengths regrow seldom.
  // `peer` is the largest size the same buffer has in any slot of the pool. `fixed`: the
  // buffer holds the same number of bytes every batch (a fixed-shape field), so headroom
  // would only be memory the kernel populates and nothing ever writes.
  virtual size_t good_size(size_t n, size_t cap, size_t peer, bool fixed) const noexcept = 0;
  // Exactly `bytes` bytes (a good_size()) aligned to `align` (a power of two, at most
  // 2 MiB); throws std::bad_alloc or LoaderError on failure.
  virtual void* allocate(size_t bytes, size_t align) = 0;
  virtual void release(void* p, size_t bytes) noexcept = 0;
  virtual bool pinned() const noexcept = 0;
  virtual HostMemoryStats stats() const noexcept = 0;
};

// Buffers of 2 MiB and more: anonymous mappings faulted in when made (NOTE [prefaulted
// slots] in host_memory.cpp); smaller ones: aligned_alloc.
class PageableAllocator final : public HostAllocator {
 public:
  size_t good_size(size_t n, size_t cap, size_t peer, bool fixed) const noexcept override;
  void* allocate(size_t bytes, size_t align) override;
  void release(void* p, size_t bytes) noexcept override;
  bool pinned() const noexcept override { return false; }
  HostMemoryStats stats() const noexcept override;

 private:
  // A fresh anonymous mapping of n bytes (n >= 2 MiB) at a 2 MiB boundary, advised to use
  // transparent huge pages (NOTE [prefaulted slots] in host_memory.cpp).
  static void* map_huge(size_t n);
  // Faults [p, p + n) in, 2 MiB at a time (NOTE [chunked populate] in host_memory.cpp).
  static void populate(uint8_t* p, size_t n) noexcept;
  std::atomic<uint64_t> live_{0}, allocs_{0}, frees_{0}, alloc_bytes_{0}, alloc_ns_{0};
};

// cuMemHostAlloc(PORTABLE) in the primary context of one device: page-locked for every
// context, cached by size class (NOTE [pinned cache] in host_memory.cpp). The parent's
// CUDA state is not usable in a forked child: there the memory is leaked, never freed or
// cached, and allocate() throws LoaderError(kDevice) without a driver call.
class PinnedAllocator final : public HostAllocator {
 public:
  static constexpr size_t kDefaultCacheLimit = size_t(256) << 20;
  PinnedAllocator(const cuda::Driver& d, int device, size_t cache_limit = kDefaultCacheLimit);
  ~PinnedAllocator() override;
  size_t good_size(size_t n, size_t cap, size_t peer, bool fixed) const noexcept override;
  void* allocate(size_t bytes, size_t align) override;
  void release(void* p, size_t bytes) noexcept override;
  bool pinned() const noexcept override { return true; }
  HostMemoryStats stats() const noexcept override;
  // Frees every cached block through the driver (each free synchronises the device).
  void trim() noexcept;

  // The size class of n bytes: a power of two up to 1 MiB, then four classes per doubling.
  static size_t size_class(size_t n) noexcept;

 private:
  void driver_free(void* p) noexcept;

  const cuda::Driver& d_;
  cuda::PrimaryContext ctx_;
  pid_t pid_;
  size_t cache_limit_;
  mutable std::mutex mu_;                      // guards free_
  std::map<size_t, std::vector<void*>> free_;  // size class -> cached blocks
  std::atomic<uint64_t> live_{0}, cached_{0}, allocs_{0}, reused_{0}, driver_allocs_{0}, driver_frees_{0};
  std::atomic<uint64_t> alloc_bytes_{0}, alloc_ns_{0};
};

// The process-wide pageable allocator.
std::shared_ptr<HostAllocator> pageable_allocator();

}  // namespace pyloader
