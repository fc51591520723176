// Reusable batch buffers. NOTE [slot reuse]: a Slot leaves the pool when a worker starts
// collating a batch into it and returns only when the last reference to it is dropped --
// the pipeline's own reference and every Python view created from it (each view holds a
// shared_ptr). So Python can keep a batch as long as it likes; the pool then simply grows,
// and in the steady state (batches dropped after use) no buffer is allocated per batch.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/host_memory.h"

namespace pyloader {

// Page-aligned host memory from the pool's allocator (pageable or pinned).
class HostBuffer {
 public:
  // `peer`: the pool's largest size of this buffer over its slots (updated by reserve()).
  explicit HostBuffer(HostAllocator* alloc = nullptr, std::atomic<size_t>* peer = nullptr)
      : alloc_(alloc), peer_(peer) {}
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept : alloc_(o.alloc_), peer_(o.peer_), data_(o.data_), cap_(o.cap_) {
    o.data_ = nullptr;
    o.cap_ = 0;
  }
  HostBuffer& operator=(HostBuffer&&) = delete;

  // Grows (never shrinks) to at least n bytes; contents are not preserved. `fixed`: n is
  // the same every time the buffer is filled (HostAllocator::good_size).
  void reserve(size_t n, bool fixed = false);
  uint8_t* data() noexcept { return data_; }
  size_t capacity() const noexcept { return cap_; }

 private:
  HostAllocator* alloc_;       // owned by the pool, which outlives its slots
  std::atomic<size_t>* peer_;  // owned by the pool too
  uint8_t* data_ = nullptr;
  size_t cap_ = 0;
};

struct Slot {
  std::vector<HostBuffer> data;     // one per field: [rows, ...] (padded for variable fields)
  std::vector<HostBuffer> lengths;  // one per field: int64 [rows] (used by variable fields)
  size_t allocations = 0;           // how many times a buffer had to grow (for stats/tests)
};

class SlotPool : public std::enable_shared_from_this<SlotPool> {
 public:
  explicit SlotPool(size_t num_fields, std::shared_ptr<HostAllocator> alloc = pageable_allocator())
      : num_fields_(num_fields),
        alloc_(std::move(alloc)),
        pid_(::getpid()),
        peak_data_(new std::atomic<size_t>[num_fields]()),
        peak_lengths_(new std::atomic<size_t>[num_fields]()) {
    track();
  }
  ~SlotPool();

  // A free slot, or a new one when all are in use. The returned pointer returns the
  // slot to this pool when its last copy is dropped. While *no_grow is true, waits for a
  // slot to come back instead of making one (NOTE [epoch ahead] in
  // pyloader/loader/dataloader.py: a pipeline made ahead of its epoch uses only the slots
  // the current epoch frees); returns null if *cancel becomes true meanwhile.
  std::shared_ptr<Slot> acquire(const std::atomic<bool>* no_grow = nullptr, const std::atomic<bool>* cancel = nullptr);

  // Makes slots until the pool has `count`, on a thread of its own, each with buffer f
  // reserved for field_bytes[f] bytes (0: left for its first batch) as a fixed-shape
  // field's, and puts each in the free list as soon as it is ready (NOTE [prepared slots]
  // in slot_pool.cpp). Returns at once; a second call while the first runs does nothing.
  // The thread stops after its current slot at the first acquire() and when the pool is
  // destroyed (which joins it). The system refusing the thread (NOTE [thread start failure]
  // in core/errors.h) only means no slot is prepared.
  void prepare(size_t count, std::vector<size_t> field_bytes);
  // Wakes every acquire() waiting for a slot, to look again at its flags (an early pipeline
  // adopted: it may now make slots of its own). The mutex orders the wake after a waiter's
  // look, so none sleeps on through its 20 ms slice.
  void wake_waiters();
  // Whether a prepare() thread is still making slots.
  bool preparing() const noexcept { return preparing_.load(std::memory_order_acquire); }
  size_t created() const;
  size_t free_count() const;
  bool pinned() const noexcept { return alloc_->pinned(); }
  // The pool's host memory: held by slots, cached, and the allocator's calls (NOTE [pinned cache]).
  HostMemoryStats memory() const noexcept { return alloc_->stats(); }
  size_t num_fields() const noexcept { return num_fields_; }

 private:
  friend struct PoolForkHandlers;  // NOTE [slot pools across fork] in slot_pool.cpp
  void track();                    // enters the pool in the fork handlers' registry
  void give_back(Slot* s) noexcept;
  std::unique_ptr<Slot> new_slot();  // with empty buffers, one per field

  size_t num_fields_;
  std::shared_ptr<HostAllocator> alloc_;
  pid_t pid_;
  mutable std::mutex mu_;
  // Heap-allocated so that a forked child can leak it (a parent thread may have waited on it)
  // and wait on a new one (NOTE [slot pools across fork]).
  std::unique_ptr<std::condition_variable> returned_ = std::make_unique<std::condition_variable>();
  std::vector<Slot*> free_;
  size_t created_ = 0;
  // prepare(): heap-allocated so that a forked child (where the thread does not exist) can
  // leak it instead of joining it.
  std::unique_ptr<std::thread> preparer_;
  size_t making_ = 0;    // slots prepare() is making now (not yet in created_)
  size_t awaiting_ = 0;  // acquire() calls waiting for one of those
  std::atomic<bool> preparing_{false}, stop_preparing_{false};
  // Per field: the largest data and lengths buffer of any slot (HostBuffer's peer).
  std::unique_ptr<std::atomic<size_t>[]> peak_data_, peak_lengths_;
};

}  // namespace pyloader
