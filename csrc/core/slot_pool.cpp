#include "core/slot_pool.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <new>

namespace pyloader {

namespace {
constexpr size_t kAlign = 4096;
}  // namespace

HostBuffer::~HostBuffer() {
  if (data_) alloc_->release(data_, cap_);
}

void HostBuffer::reserve(size_t n, bool fixed) {
  if (n <= cap_) return;
  // The allocator's sizes: headroom for rising variable lengths (none for a pageable fixed
  // field's buffer), whole 2 MiB for pageable
  // prefaulted mappings (NOTE [prefaulted slots]), size classes when pinned (NOTE [pinned cache]).
  const size_t want = alloc_->good_size(n, cap_, peer_ ? peer_->load(std::memory_order_relaxed) : 0, fixed);
  void* p = alloc_->allocate(want, kAlign);
  if (data_) alloc_->release(data_, cap_);
  data_ = static_cast<uint8_t*>(p);
  cap_ = want;
  if (peer_) {
    size_t seen = peer_->load(std::memory_order_relaxed);
    while (seen < want && !peer_->compare_exchange_weak(seen, want, std::memory_order_relaxed)) {
    }
  }
}

SlotPool::~SlotPool() {
  for (Slot* s : free_) delete s;
  if (::getpid() != pid_) (void)returned_.release();
}

std::shared_ptr<Slot> SlotPool::acquire(const std::atomic<bool>* no_grow, const std::atomic<bool>* cancel) {
  Slot* s = nullptr;
  {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!free_.empty()) {
        s = free_.back();
        free_.pop_back();
        break;
      }
      if (!no_grow || !no_grow->load(std::memory_order_acquire)) break;
      if (cancel && cancel->load(std::memory_order_acquire)) return nullptr;
      // Slices: the flags are set without this mutex.
      returned_->wait_for(lk, std::chrono::milliseconds(20));
    }
  }
  if (!s) {
    s = new Slot();
    s->data.reserve(num_fields_);
    s->lengths.reserve(num_fields_);
    for (size_t f = 0; f < num_fields_; ++f) {
      s->data.emplace_back(alloc_.get(), &peak_data_[f]);
      s->lengths.emplace_back(alloc_.get(), &peak_lengths_[f]);
    }
    std::lock_guard<std::mutex> lk(mu_);
    ++created_;
  }
  // The deleter keeps the pool alive, so a batch may outlive the loader that made it.
  std::shared_ptr<SlotPool> self = shared_from_this();
  return std::shared_ptr<Slot>(s, [self](Slot* p) { self->give_back(p); });
}

void SlotPool::give_back(Slot* s) noexcept {
  // In a forked child the pool mutex may have been held by a parent thread at fork time;
  // never lock it there: just free the memory.
  if (::getpid() != pid_) {
    delete s;
    return;
  }
  try {
    {
      std::lock_guard<std::mutex> lk(mu_);
      free_.push_back(s);
    }
    returned_->notify_one();
  } catch (...) {
    delete s;
  }
}

size_t SlotPool::created() const {
  std::lock_guard<std::mutex> lk(mu_);
  return created_;
}

size_t SlotPool::free_count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return free_.size();
}

}  // namespace pyloader
