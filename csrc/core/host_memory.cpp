#include "core/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <new>

#include "core/errors.h"

namespace pyloader {
namespace {
constexpr size_t kPopulateMin = size_t(2) << 20;
}

// NOTE [prefaulted slots]: a batch buffer is written in full by every batch, so all of its
// pages are touched at once in the first epoch. Buffers of 2 MiB and more are mapped with
// MAP_POPULATE: the kernel faults the whole range in one call instead of taking one fault
// (an exception, and under a hypervisor often an exit) per page as the first batch writes
// it. Measured on a 2-core VM: fresh memory came in at ~3 GB/s populated against ~1.7 GB/s
// touched page by page (with or without transparent huge pages), which halved the time to
// the first batch of 150 KB records (38 MB slots) and doubled their first epoch's rate;
// the steady state (slots reused) was unchanged. Smaller buffers come from aligned_alloc.
void* PageableAllocator::allocate(size_t bytes, size_t align) {
  size_t n = (bytes + align - 1) / align * align;
  if (n >= kPopulateMin) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  void* p = std::aligned_alloc(align, n);
  if (!p) throw std::bad_alloc();
  return p;
}

void PageableAllocator::release(void* p, size_t bytes) noexcept {
  if (bytes >= kPopulateMin) {
    ::munmap(p, bytes);
    return;
  }
  std::free(p);
}

PinnedAllocator::PinnedAllocator(const cuda::Driver& d, int device) : d_(d), ctx_(d, device), pid_(::getpid()) {}

void* PinnedAllocator::allocate(size_t bytes, size_t align) {
  // cuMemHostAlloc returns page-aligned memory; larger alignments are not needed for DMA.
  (void)align;
  // A forked child must not touch the parent's CUDA state (as release() and PrimaryContext):
  // a pinned pool made before the fork cannot grow here. It fails rather than falls back to
  // pageable memory, so a pool's buffers are all of the kind its pinned() says.
  if (::getpid() != pid_)
    throw LoaderError(ErrorKind::kDevice, "", -1, "",
                      "cannot allocate " + std::to_string(bytes) +
                          " bytes of pinned memory in a forked child: the pinned pool was created before this "
                          "process forked, and the parent's CUDA context cannot be used after fork (create the "
                          "loader or its pool in the child, or use the spawn start method)");
  cuda::ScopedContext scope(d_, ctx_.get());
  void* p = nullptr;
  cuda::CUresult r = d_.MemHostAlloc(&p, bytes, cuda::kHostAllocPortable);
  if (r != cuda::kSuccess || !p)
    throw LoaderError(ErrorKind::kDevice, "", -1, "",
                      "cuMemHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cuda::error_text(d_, r));
  return p;
}

void PinnedAllocator::release(void* p, size_t) noexcept {
  if (!p || ::getpid() != pid_) return;
  try {
    cuda::ScopedContext scope(d_, ctx_.get());
    (void)d_.MemFreeHost(p);
  } catch (...) {
    // Teardown: the driver may already be shutting down; the process is exiting.
  }
}

std::shared_ptr<HostAllocator> pageable_allocator() {
  static auto* a = new std::shared_ptr<HostAllocator>(std::make_shared<PageableAllocator>());
  return *a;
}

}  // namespace pyloader
