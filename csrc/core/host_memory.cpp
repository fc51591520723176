#include "core/host_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <new>

#include "core/clock.h"
#include "core/errors.h"

namespace pyloader {
namespace {
constexpr size_t kPopulateMin = size_t(2) << 20;
constexpr size_t kPage = 4096;
// A 2 MiB chunk that took more of the thread's CPU time than this to populate (a huge page
// takes ~0.2 ms, 512 small ones ~0.7 ms here) met a slow huge page (NOTE [prefaulted
// slots]). CPU time, not wall time: a thread preempted on a busy machine is not waiting
// for its pages.
constexpr uint64_t kSlowChunkNs = 2000000;

// Set once a chunk was slow: later buffers of this process use small pages from the start.
std::atomic<bool> slow_huge_pages{false};

uint64_t thread_cpu_ns() noexcept {
  struct timespec ts;
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14's value, for older headers
#endif
}  // namespace

// NOTE [prefaulted slots]: a batch buffer is written in full by every batch, so all of its
// pages are touched at once in the first epoch. Buffers of 2 MiB and more are mapped and
// populated when made (NOTE [chunked populate]): the kernel faults the range in with a few
// calls instead of taking one fault (an exception, and under a hypervisor often an exit)
// per page as the first batch writes it. They are mapped at a 2 MiB boundary and advised
// MADV_HUGEPAGE (transparent huge pages, `enabled` = madvise on most distributions), so
// each 2 MiB chunk is one huge page: one fault, one zeroing, and no 512 page-table
// entries. Measured on the 2-core VM (256 MiB of fresh memory, 3 runs each, 2026-12-06):
// touched page by page 100-124 ms (2.2-2.7 GB/s), MADV_POPULATE_WRITE by 2 MiB 86-98 ms
// (2.7-3.1 GB/s), aligned + MADV_HUGEPAGE + the same 22-25 ms (10.4-12.0 GB/s) when free
// huge pages exist. (An earlier note found no gain from THP: it was measured on unaligned
// ranges without MADV_HUGEPAGE.) But a huge page can be slow to come: the same 256 MiB
// took 210-875 ms at other times (up to 5 ms per huge page; /proc/vmstat counted no
// compaction stall and no fallback, so the hypervisor backing guest memory it had taken
// back, most likely; elsewhere the kernel's direct compaction, defrag = madvise). So a
// chunk that takes more than kSlowChunkNs of the thread's CPU turns the rest of the buffer
// to small pages (MADV_NOHUGEPAGE), and every later buffer of the process too: one slow
// chunk per process, not one per slot (per slot, 7 slots of 40 MiB for 150 KB records
// took 120-235 ms against 96-152 ms without THP, measured side by side on a busy machine).
// The steady state (slots reused) is unchanged. Smaller buffers come from aligned_alloc.
// NOTE [chunked populate]: the kernel populates a range holding the process's mmap lock
// for reading, and mmap()/munmap() elsewhere in the process (a worker opening a shard)
// waits for it, with later faults queued behind that writer: one MAP_POPULATE of a 40 MiB
// slot holds it for 13-20 ms. So the range is populated 2 MiB at a time
// (MADV_POPULATE_WRITE, Linux 5.14+; on a kernel without it, or a chunk it could not
// populate, by writing a byte per page).
void* PageableAllocator::map_huge(size_t n) {
  // See NOTE [prefaulted slots]: 2 MiB-aligned, so every whole 2 MiB of it can be a huge page.
  const size_t len = (n + kPage - 1) / kPage * kPage;
  void* raw = ::mmap(nullptr, len + kPopulateMin, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kPopulateMin - 1) / kPopulateMin * kPopulateMin;
  if (aligned > start) ::munmap(raw, aligned - start);  // the head before the boundary
  const uintptr_t end = start + len + kPopulateMin;
  if (end > aligned + len) ::munmap(reinterpret_cast<void*>(aligned + len), end - aligned - len);  // the tail
  void* p = reinterpret_cast<void*>(aligned);
  // EINVAL: a kernel built without transparent huge pages; the range stays small pages.
  if (!slow_huge_pages.load(std::memory_order_relaxed)) (void)::madvise(p, len, MADV_HUGEPAGE);
  return p;
}

void PageableAllocator::populate(uint8_t* p, size_t n) noexcept {
  static std::atomic<bool> no_madvise{false};
  bool huge = !slow_huge_pages.load(std::memory_order_relaxed);  // See NOTE [prefaulted slots]
  for (size_t off = 0; off < n; off += kPopulateMin) {
    const size_t len = std::min(kPopulateMin, n - off);
    const uint64_t t0 = huge ? thread_cpu_ns() : 0;
    if (!no_madvise.load(std::memory_order_relaxed)) {
      if (::madvise(p + off, len, kMadvPopulateWrite) == 0) {
        if (huge && thread_cpu_ns() - t0 > kSlowChunkNs && off + len < n) {
          huge = false;  // small pages for the rest, and for every later buffer
          slow_huge_pages.store(true, std::memory_order_relaxed);
          (void)::madvise(p + off + len, n - off - len, MADV_NOHUGEPAGE);
        }
        continue;
      }
      if (errno == EINVAL) no_madvise.store(true, std::memory_order_relaxed);  // not in this kernel
    }
    for (size_t q = 0; q < len; q += kPage) static_cast<volatile uint8_t*>(p)[off + q] = 0;
  }
}

size_t PageableAllocator::good_size(size_t n, size_t, size_t peer, bool fixed) const noexcept {
  // Grow by at least 1/8 so that slowly rising variable lengths do not reallocate every
  // batch. A fixed-shape field's buffer holds the same bytes every batch: no headroom (38 MB
  // batches of 150 KB records: 40 MiB mapped and populated per slot instead of 44), but at
  // least its size in the pool's other slots, so a slot first used by a short last batch is
  // not regrown by the next full one.
  size_t want = fixed ? std::max(n, peer) : n + n / 8;
  // Large buffers are sized in whole 2 MiB (prefaulted mappings).
  const size_t round = want >= kPopulateMin ? kPopulateMin : kPage;
  return (want + round - 1) / round * round;
}

void* PageableAllocator::allocate(size_t bytes, size_t align) {
  size_t n = (bytes + align - 1) / align * align;
  void* p = nullptr;
  const uint64_t t0 = now_ns();
  if (n >= kPopulateMin) {
    p = map_huge(n);
    populate(static_cast<uint8_t*>(p), n);
  } else {
    p = std::aligned_alloc(align, n);
    if (!p) throw std::bad_alloc();
  }
  alloc_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  alloc_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  live_.fetch_add(bytes, std::memory_order_relaxed);
  allocs_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void PageableAllocator::release(void* p, size_t bytes) noexcept {
  live_.fetch_sub(bytes, std::memory_order_relaxed);
  frees_.fetch_add(1, std::memory_order_relaxed);
  if (bytes >= kPopulateMin) {
    ::munmap(p, bytes);
    return;
  }
  std::free(p);
}

HostMemoryStats PageableAllocator::stats() const noexcept {
  HostMemoryStats s;
  s.live_bytes = live_.load(std::memory_order_relaxed);
  s.allocs = s.driver_allocs = allocs_.load(std::memory_order_relaxed);
  s.driver_frees = frees_.load(std::memory_order_relaxed);
  s.driver_alloc_bytes = alloc_bytes_.load(std::memory_order_relaxed);
  s.driver_alloc_ns = alloc_ns_.load(std::memory_order_relaxed);
  return s;
}

// NOTE [pinned cache]: cuMemFreeHost synchronises the whole device (it waits for every
// stream of the context, the training loop's included), and cuMemHostAlloc maps and locks
// pages in the driver: either, on a collation or copy engine thread mid-training, stalls
// that thread for as long as the GPU is busy. So pinned blocks are cached, as torch's
// caching host allocator does:
//  - sizes are rounded to size classes (powers of two up to 1 MiB, then four classes per
//    doubling: at most 25% unused), and a buffer that must grow at least doubles, and at
//    least to the size the same buffer has in the pool's largest slot, so a rising
//    variable-length field regrows O(log(max / first)) times in the slot that meets the new
//    lengths first and once in each of the others, not every few batches;
//  - a released block (the smaller buffer a growing one left, or a slot's buffers when its
//    pool drops it) is kept in its class's free list and handed to the next allocation of
//    that class without a driver call;
//  - the cache keeps at most `cache_limit` bytes: a block released beyond it is freed at
//    once (counted in driver_frees), so the pinned memory of a pool is bounded by the
//    buffers its slots hold plus the limit. Once the slots have their steady-state sizes
//    nothing is allocated or freed at all (NOTE [slot reuse]); the cache is emptied
//    when the pool is destroyed (trim()).
// The free lists live in this object, never in the blocks: a forked child, which must not
// touch the parent's pinned memory (the driver does not map it into children), leaks its
// blocks without a lock or a write.
size_t PinnedAllocator::size_class(size_t n) noexcept {
  if (n <= kPage) return kPage;
  size_t p = kPage;
  while (p < n && p < (size_t(1) << 20)) p <<= 1;
  if (p >= n) return p;
  // n > 1 MiB: the largest power of two below n, in quarter steps.
  p = size_t(1) << 20;
  while (p <= n / 2) p <<= 1;
  const size_t step = p / 4;
  return (n + step - 1) / step * step;
}

PinnedAllocator::PinnedAllocator(const cuda::Driver& d, int device, size_t cache_limit)
    : d_(d), ctx_(d, device), pid_(::getpid()), cache_limit_(cache_limit) {}

PinnedAllocator::~PinnedAllocator() {
  if (::getpid() == pid_) trim();
  // In a forked child the cached blocks are leaked with the rest (see release()).
}

size_t PinnedAllocator::good_size(size_t n, size_t cap, size_t peer, bool) const noexcept {
  // At least the largest size of the same buffer in the pool's other slots: a slot made or
  // grown late is sized for the longest batches seen so far at once.
  return size_class(std::max({n, 2 * cap, peer}));
}

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
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = free_.find(bytes);
    if (it != free_.end() && !it->second.empty()) {  // See NOTE [pinned cache]: no driver call
      void* p = it->second.back();
      it->second.pop_back();
      cached_.fetch_sub(bytes, std::memory_order_relaxed);
      live_.fetch_add(bytes, std::memory_order_relaxed);
      allocs_.fetch_add(1, std::memory_order_relaxed);
      reused_.fetch_add(1, std::memory_order_relaxed);
      return p;
    }
  }
  cuda::ScopedContext scope(d_, ctx_.get());
  void* p = nullptr;
  const uint64_t t0 = now_ns();
  cuda::CUresult r = d_.MemHostAlloc(&p, bytes, cuda::kHostAllocPortable);
  if (r != cuda::kSuccess || !p)
    throw LoaderError(ErrorKind::kDevice, "", -1, "",
                      "cuMemHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cuda::error_text(d_, r));
  alloc_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  alloc_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  live_.fetch_add(bytes, std::memory_order_relaxed);
  allocs_.fetch_add(1, std::memory_order_relaxed);
  driver_allocs_.fetch_add(1, std::memory_order_relaxed);
  return p;
}

void PinnedAllocator::release(void* p, size_t bytes) noexcept {
  if (!p || ::getpid() != pid_) return;
  live_.fetch_sub(bytes, std::memory_order_relaxed);
  try {
    std::lock_guard<std::mutex> lk(mu_);
    if (cached_.load(std::memory_order_relaxed) + bytes <= cache_limit_) {
      free_[bytes].push_back(p);
      cached_.fetch_add(bytes, std::memory_order_relaxed);
      return;
    }
  } catch (...) {
    // No memory for the free list: free the block instead.
  }
  driver_free(p);
}

void PinnedAllocator::driver_free(void* p) noexcept {
  driver_frees_.fetch_add(1, std::memory_order_relaxed);
  try {
    cuda::ScopedContext scope(d_, ctx_.get());
    (void)d_.MemFreeHost(p);
  } catch (...) {
    // Teardown: the driver may already be shutting down; the process is exiting.
  }
}

void PinnedAllocator::trim() noexcept {
  if (::getpid() != pid_) return;
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& kv : free_)
      for (void* p : kv.second) {
        blocks.push_back(p);
        cached_.fetch_sub(kv.first, std::memory_order_relaxed);
      }
    free_.clear();
  }
  for (void* p : blocks) driver_free(p);
}

HostMemoryStats PinnedAllocator::stats() const noexcept {
  HostMemoryStats s;
  s.live_bytes = live_.load(std::memory_order_relaxed);
  s.cached_bytes = cached_.load(std::memory_order_relaxed);
  s.cache_limit = cache_limit_;
  s.allocs = allocs_.load(std::memory_order_relaxed);
  s.reused = reused_.load(std::memory_order_relaxed);
  s.driver_allocs = driver_allocs_.load(std::memory_order_relaxed);
  s.driver_frees = driver_frees_.load(std::memory_order_relaxed);
  s.driver_alloc_bytes = alloc_bytes_.load(std::memory_order_relaxed);
  s.driver_alloc_ns = alloc_ns_.load(std::memory_order_relaxed);
  return s;
}

std::shared_ptr<HostAllocator> pageable_allocator() {
  static auto* a = new std::shared_ptr<HostAllocator>(std::make_shared<PageableAllocator>());
  return *a;
}

}  // namespace pyloader
