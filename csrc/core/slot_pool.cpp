#include "core/slot_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <unordered_set>

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

// NOTE [slot pools across fork]: a program may build a DataLoader -- whose constructor starts
// preparing its slots (NOTE [prepared slots]) -- and fork, at any moment. A child forked
// while the preparing thread makes a slot inherits a pool that counts that slot as in the
// making, but has no thread to finish it: a worker of the child would wait for it forever;
// and a child forked while any thread of the parent held the pool's mutex inherits it locked
// for good. So every pool is entered in a registry, and pthread_atfork handlers, around
// every fork(), take each pool's mutex in the forking thread before the fork (no other
// thread holds one then; none is held for long) and release it after, in the parent and in
// the child. In the child they also bring the pool to what it has: no preparing thread
// (leaked, not joined: it does not exist), no slot in the making, nobody waiting, a new
// condition variable (parent threads may have waited on the old one, which is leaked), and
// the child's pid, so the pool is the child's own: its free slots and the slots its batches
// return serve the child's epochs. Slots held by parent threads at the fork never come back.
struct PoolForkHandlers {
  static std::mutex& mu() {
    static auto* m = new std::mutex;  // leaked: fork handlers may run during exit
    return *m;
  }
  static std::unordered_set<SlotPool*>& pools() {
    static auto* s = new std::unordered_set<SlotPool*>;
    return *s;
  }
  static void before() {
    mu().lock();
    for (SlotPool* p : pools()) p->mu_.lock();
  }
  static void parent() {
    for (SlotPool* p : pools()) p->mu_.unlock();
    mu().unlock();
  }
  static void child() {
    const pid_t pid = ::getpid();
    for (SlotPool* p : pools()) {
      (void)p->preparer_.release();
      (void)p->returned_.release();
      p->returned_ = std::make_unique<std::condition_variable>();
      p->making_ = 0;
      p->awaiting_ = 0;
      p->preparing_.store(false, std::memory_order_relaxed);
      p->stop_preparing_.store(false, std::memory_order_relaxed);
      p->pid_ = pid;
      p->mu_.unlock();
    }
    mu().unlock();
  }
};

void SlotPool::track() {
  static const int installed = ::pthread_atfork(PoolForkHandlers::before, PoolForkHandlers::parent,
                                                PoolForkHandlers::child);
  (void)installed;
  std::lock_guard<std::mutex> lk(PoolForkHandlers::mu());
  PoolForkHandlers::pools().insert(this);
}

SlotPool::~SlotPool() {
  {
    std::lock_guard<std::mutex> lk(PoolForkHandlers::mu());
    PoolForkHandlers::pools().erase(this);
  }
  if (::getpid() != pid_) {
    (void)preparer_.release();
    (void)returned_.release();
  } else if (preparer_) {
    stop_preparing_.store(true, std::memory_order_release);
    preparer_->join();
  }
  for (Slot* s : free_) delete s;
}

// NOTE [prepared slots]: a new slot's buffers cost their size in fresh pages, which the
// kernel zeroes and maps at a few GB/s per thread: for 256 records of 150 KB a batch slot
// is 40 MiB, ~13 ms of a thread, and a first epoch makes one per collating thread and one
// for the consumer, while the steady epoch over 480 MB of such records takes ~22 ms. A
// training script builds its loader, then its model, optimizer and CUDA state before the
// first batch is asked for: the DataLoader prepares its slots in that time, from its
// constructor, so the first epoch reads into memory that is already there. If batches are
// asked for before it is done, the first worker to want a slot stops it after the slot it
// is making (it would only compete with the workers for the CPU), and a worker that finds
// no slot free waits for that slot rather than populate one of its own beside it -- one
// worker per slot in the making; the others make their own, as before.
void SlotPool::prepare(size_t count, std::vector<size_t> field_bytes) {
  if (field_bytes.size() != num_fields_)
    throw std::invalid_argument("field_bytes must have one entry per field (" + std::to_string(num_fields_) + ")");
  std::lock_guard<std::mutex> lk(mu_);
  if (preparing_.load(std::memory_order_acquire) || created_ >= count) return;
  if (preparer_) preparer_->join();  // a finished earlier run
  stop_preparing_.store(false, std::memory_order_release);
  preparing_.store(true, std::memory_order_release);
  try {
    preparer_ = std::make_unique<std::thread>([this, count, fb = std::move(field_bytes)] {
      while (!stop_preparing_.load(std::memory_order_acquire)) {
        {
          std::lock_guard<std::mutex> g(mu_);
          if (created_ + making_ >= count) break;
          ++making_;
        }
        try {
          std::unique_ptr<Slot> s = new_slot();
          for (size_t f = 0; f < num_fields_; ++f)
            if (fb[f]) s->data[f].reserve(fb[f], /*fixed=*/true);
          {
            std::lock_guard<std::mutex> g(mu_);
            free_.push_back(s.get());
            --making_;
            ++created_;  // counted when free: created() == free_count() whenever no slot is in use
          }
          (void)s.release();
          returned_->notify_all();  // a worker waiting for this slot may be among other waiters
        } catch (...) {
          // Out of memory here is no batch's error: the workers make their slots as before
          // and meet the same condition where it is reported with its batch.
          {
            std::lock_guard<std::mutex> g(mu_);
            --making_;
          }
          returned_->notify_all();
          break;
        }
      }
      preparing_.store(false, std::memory_order_release);
    });
  } catch (const std::system_error&) {
    // See NOTE [thread start failure] in core/errors.h: no thread, no prepared slots; the workers make theirs
    // (and a pipeline that cannot start its own threads says why).
    preparer_.reset();
    preparing_.store(false, std::memory_order_release);
  }
}

std::unique_ptr<Slot> SlotPool::new_slot() {
  auto s = std::make_unique<Slot>();
  s->data.reserve(num_fields_);
  s->lengths.reserve(num_fields_);
  for (size_t f = 0; f < num_fields_; ++f) {
    s->data.emplace_back(alloc_.get(), &peak_data_[f]);
    s->lengths.emplace_back(alloc_.get(), &peak_lengths_[f]);
  }
  return s;
}

std::shared_ptr<Slot> SlotPool::acquire(const std::atomic<bool>* no_grow, const std::atomic<bool>* cancel) {
  // See NOTE [prepared slots]: batches are being collated; the preparing thread stops after the
  // slot it is making -- unless they are collated by a pipeline made ahead (no_grow set),
  // which only takes the slots others make (NOTE [first epoch ahead] in
  // pyloader/loader/native_epoch.py: the constructor's epoch 0 waits for prepared slots).
  if (preparing_.load(std::memory_order_relaxed) && !(no_grow && no_grow->load(std::memory_order_acquire)))
    stop_preparing_.store(true, std::memory_order_release);
  Slot* s = nullptr;
  {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      if (!free_.empty()) {
        s = free_.back();
        free_.pop_back();
        break;
      }
      const bool held = no_grow && no_grow->load(std::memory_order_acquire);
      // See NOTE [prepared slots]: a slot in the making that no other worker waits for.
      const bool coming = making_ > awaiting_;
      if (!held && !coming) break;
      if (cancel && cancel->load(std::memory_order_acquire)) return nullptr;
      // Slices: the flags are set without this mutex.
      if (coming) ++awaiting_;
      returned_->wait_for(lk, std::chrono::milliseconds(20));
      if (coming) --awaiting_;
    }
  }
  if (!s) {
    s = new_slot().release();
    std::lock_guard<std::mutex> lk(mu_);
    ++created_;
  }
  // The deleter keeps the pool alive, so a batch may outlive the loader that made it.
  std::shared_ptr<SlotPool> self = shared_from_this();
  return std::shared_ptr<Slot>(s, [self](Slot* p) { self->give_back(p); });
}

void SlotPool::wake_waiters() {
  {
    std::lock_guard<std::mutex> lk(mu_);
  }
  returned_->notify_all();
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
