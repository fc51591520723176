// Where batch buffers live: pageable memory, or page-locked ("pinned") memory from the
// CUDA driver, which a DMA engine reads directly so host-to-device copies run at full
// PCIe bandwidth and truly asynchronously. The slot pool and the ring logic are the same
// for both (NOTE [slot reuse] in core/slot_pool.h).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>

#include "core/cuda_driver.h"

namespace pyloader {

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  // At least `bytes` bytes aligned to `align` (a power of two, at most 2 MiB); throws
  // std::bad_alloc or LoaderError on failure.
  virtual void* allocate(size_t bytes, size_t align) = 0;
  virtual void release(void* p, size_t bytes) noexcept = 0;
  virtual bool pinned() const noexcept = 0;
};

// Buffers of 2 MiB and more: anonymous mappings faulted in when made (NOTE [prefaulted
// slots] in host_memory.cpp); smaller ones: aligned_alloc.
class PageableAllocator final : public HostAllocator {
 public:
  void* allocate(size_t bytes, size_t align) override;
  void release(void* p, size_t bytes) noexcept override;
  bool pinned() const noexcept override { return false; }
};

// cuMemHostAlloc(PORTABLE) in the primary context of one device: page-locked for every
// context. The parent's CUDA state is not usable in a forked child: there the memory is
// leaked, never freed, and allocate() throws LoaderError(kDevice) without a driver call.
class PinnedAllocator final : public HostAllocator {
 public:
  PinnedAllocator(const cuda::Driver& d, int device);
  void* allocate(size_t bytes, size_t align) override;
  void release(void* p, size_t bytes) noexcept override;
  bool pinned() const noexcept override { return true; }

 private:
  const cuda::Driver& d_;
  cuda::PrimaryContext ctx_;
  pid_t pid_;
};

// The process-wide pageable allocator.
std::shared_ptr<HostAllocator> pageable_allocator();

}  // namespace pyloader
