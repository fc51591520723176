#include "core/batch_pipeline.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>

#include "core/clock.h"
#include "core/errors.h"
#include "core/lz4_block.h"

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define PYLOADER_PIPELINE_SSE2 1
#endif

// For the per-value steps of collate_records(): they run once per field of every record,
// so they are inlined into its loop whatever the compiler's size heuristics say.
#if defined(__GNUC__)
#define PYLOADER_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PYLOADER_ALWAYS_INLINE inline
#endif

namespace pyloader {
namespace {

#ifdef PYLOADER_PIPELINE_SSE2
// Copies a large value into a batch row with non-temporal stores: the batch is written
// once and read later (by the consumer or a DMA engine), so streaming it past the cache
// saves the read-for-ownership of every destination line. Small or unaligned copies use
// memcpy. Callers issue finish_streaming_stores() before publishing the batch to another thread.
inline void copy_row(uint8_t* dst, const uint8_t* src, size_t n) {
  if (n < 4096 || (reinterpret_cast<uintptr_t>(dst) & 15) != 0) {
    std::memcpy(dst, src, n);
    return;
  }
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
}

// Orders the streaming stores of copy_row() before the batch is published.
inline void finish_streaming_stores() noexcept { _mm_sfence(); }
#else
// Without SSE2: plain stores, which the release of the ring's mutex publishes.
inline void copy_row(uint8_t* dst, const uint8_t* src, size_t n) { std::memcpy(dst, src, n); }
inline void finish_streaming_stores() noexcept {}
#endif

constexpr uint32_t kNoBatch = 0xffffffffu;
// See NOTE [cold read-ahead]: records closer than this in a shard are read ahead as one
// range, and a worker claiming batch b queues batches up to b + kAdviseBatches.
constexpr uint64_t kAdviseGap = 64 << 10;
constexpr size_t kAdviseBatches = 2;
// See NOTE [cold spans].
constexpr size_t kSpanMinRows = 16;
constexpr size_t kMaxSpans = 4;
// A batch of more is read through the mapping, with read-ahead: one worker's synchronous
// read of it overlaps nothing (150 KB records, 38 MB batches: 0.9x the mapping's rate).
constexpr uint64_t kMaxSpanBytes = 16 << 20;
// A shard's columns of at most this many bytes are queued whole by its first span-shaped
// batch; larger ones, each batch's blocks.
constexpr uint64_t kColumnsWhole = 1 << 20;

// Thrown by fill() when the batch must be collated again once a shard was fetched anew.
struct RetryBatch {};

// See NOTE [paired wake-ups]: how long a batch that is in waits for the one after it.
constexpr int64_t kPairWaitMs = 2;
// ... and tried only while batches come in less than this apart: a wait that ends without
// the pair costs a wake-up more (its timer), where batches take long (38 MB ones: 3 ms).
constexpr uint64_t kPairGapNs = 500'000;
// ... measured over this many gaps first: an epoch of a few large batches (its first
// consumer waits included) never waits for a pair on a guess.
constexpr size_t kPairAfterGaps = 8;

// Set on a pipeline's worker threads (NOTE [hand-over gate]).
thread_local bool on_worker = false;
std::atomic<uint64_t> destroyed_on_worker{0};

// collate_records()'s tallies, added to the counters once per batch.
struct ValueTotals {
  uint64_t stored = 0, decoded = 0, lz4_stored = 0, verified = 0;
};

// A value whose bytes failed their checksum: what was hashed, and the two digests.
struct Mismatch {
  const char* what = nullptr;
  uint64_t got = 0, want = 0;
};

// Starts loading what the next records of the visit order need, while record k is copied:
// the index entry of the record after next (read one record from now) and the next
// record's bytes.
PYLOADER_ALWAYS_INLINE void prefetch_next_records(const Shard* const* shard_of, const uint32_t* visit,
                                                  const int64_t* record_of_row, size_t k, size_t rows) noexcept {
  if (k + 2 < rows) {  // the index entry of the record after next: read below one record from now
    const Shard& n2 = *shard_of[visit[k + 2]];
    if (const int32_t f0 = n2.first_indexed(); f0 >= 0)
      __builtin_prefetch(n2.entry_address(uint64_t(record_of_row[visit[k + 2]]), size_t(f0)));
  }
  if (k + 1 < rows) {  // start fetching the next record's bytes
    const Shard& nx = *shard_of[visit[k + 1]];
    const uint64_t nrec = uint64_t(record_of_row[visit[k + 1]]);
    if (const int32_t nf0 = nx.first_indexed(); nf0 >= 0) {
      const IndexEntry ne = nx.entry(nrec, size_t(nf0));
      // Every page of it: a shuffled batch's next record is on pages the TLB has not
      // seen, and the hardware prefetcher stops at each page boundary; touching each
      // page now starts those walks while this record is copied.
      const uint8_t* np = nx.payload() + ne.offset;
      const uint8_t* end = np + ne.stored_size;
      for (const uint8_t* q = np; q < end; q += 4096) __builtin_prefetch(q);
      if (ne.stored_size > 4096) __builtin_prefetch(end - 1);
    } else {
      const ColumnSpec& nc = nx.column(0);
      __builtin_prefetch(nc.data + nrec * nc.row_bytes);
    }
  }
}

// Copies record rec's value of column c to dst. False (and *bad set) when the value's
// block fails its checksum.
PYLOADER_ALWAYS_INLINE bool place_column_value(const Shard& sh, size_t c, uint64_t rec, uint8_t* dst, ValueTotals* t,
                                               Mismatch* bad) noexcept {
  // See NOTE [column layout]: the value's block is checked once, then the value is copied.
  const ColumnSpec& col = sh.column(c);
  const uint64_t block = rec >> col.block_shift;
  if (!sh.block_verified(col.first_block + block)) {
    uint64_t got, want;
    if (!sh.check_block(c, block, &got, &want)) {
      *bad = Mismatch{"column block", got, want};
      return false;
    }
    sh.mark_block_verified(col.first_block + block);
    t->verified += std::min<uint64_t>(uint64_t(1) << col.block_shift, sh.num_records() - (block << col.block_shift)) *
                   col.row_bytes;
  }
  std::memcpy(dst, col.data + rec * col.row_bytes, col.row_bytes);
  t->stored += col.row_bytes;
  t->decoded += col.row_bytes;
  return true;
}

// Places an indexed value (entry e, stored bytes at src) at dst: raw bytes are copied (and
// hashed in the same pass when `verify`), LZ4 bytes hashed when `verify`, then decoded.
// False (and *bad set) on a checksum mismatch; *malformed is the decoder's error, if any.
PYLOADER_ALWAYS_INLINE bool place_indexed_value(const Shard& sh, const IndexEntry& e, const uint8_t* src, bool verify,
                                                uint8_t* dst, Mismatch* bad, const char** malformed) {
  if (e.codec == kCodecRaw) {
    if (!verify) {
      copy_row(dst, src, e.stored_size);
    } else if (uint64_t got = shard_checksum_copy(sh.version(), dst, src, e.stored_size); got != e.checksum) {
      *bad = Mismatch{"payload", got, e.checksum};
      return false;
    }
    return true;
  }
  if (verify) {
    if (uint64_t got = shard_checksum(sh.version(), src, e.stored_size); got != e.checksum) {
      *bad = Mismatch{"payload", got, e.checksum};
      return false;
    }
  }
  *malformed = lz4_decode_block(src, e.stored_size, dst, e.decoded_size);
  return true;
}

}  // namespace

struct BatchPipeline::MapAhead {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<const Shard>> queue;
  std::atomic<bool> stop{false};
  std::thread thread;
  bool off = false;                 // the thread could not start, or the kernel cannot map ahead
  uint64_t budget = 0;              // file bytes it may still be handed this epoch
  std::atomic<uint64_t> mapped{0};  // bytes it mapped (stats: mapped_ahead_bytes)
};

namespace {
// Set once a kernel without MADV_POPULATE_READ said so: no pipeline starts a mapper again.
std::atomic<bool> cannot_map_ahead{false};
}  // namespace

BatchPipeline::BatchPipeline(std::shared_ptr<ShardSet> shards, std::shared_ptr<SlotPool> pool,
                             std::vector<int32_t> shard_idx, std::vector<int64_t> record_idx, PipelineConfig cfg)
    : shards_(std::move(shards)),
      pool_(std::move(pool)),
      shard_idx_(std::move(shard_idx)),
      record_idx_(std::move(record_idx)),
      cfg_(cfg),
      pid_(::getpid()),
      gate_(std::make_shared<Gate>()) {
  gate_->target = this;
  if (shard_idx_.size() != record_idx_.size())
    throw std::invalid_argument("shard and record index arrays differ in length");
  if (cfg_.batch_size == 0) throw std::invalid_argument("batch_size must be >= 1");
  if (cfg_.num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  if (cfg_.prefetch < 1) throw std::invalid_argument("prefetch must be >= 1");
  if (cfg_.ahead < -1 || cfg_.ahead > cfg_.prefetch) throw std::invalid_argument("ahead must be -1 or in 0..prefetch");
  if (cfg_.active_threads < 0 || cfg_.active_threads > cfg_.num_threads)
    throw std::invalid_argument("active_threads must be in 0..num_threads");
  ahead_ = size_t(cfg_.ahead < 0 ? cfg_.prefetch : cfg_.ahead);
  active_threads_ = size_t(cfg_.active_threads == 0 ? cfg_.num_threads : cfg_.active_threads);
  no_grow_.store(cfg_.early, std::memory_order_release);
  if (!pool_ || pool_->num_fields() != shards_->fields().size())
    throw std::invalid_argument("the slot pool has " + std::to_string(pool_ ? pool_->num_fields() : 0) +
                                " fields but the dataset has " + std::to_string(shards_->fields().size()));
  if (shard_idx_.size() / cfg_.batch_size >= kNoBatch) throw std::invalid_argument("too many batches");
  // Plans come from Python; check them here once so workers can index without checks.
  for (size_t i = 0; i < shard_idx_.size(); ++i) {
    int32_t s = shard_idx_[i];
    if (s < 0 || size_t(s) >= shards_->size() || record_idx_[i] < 0 ||
        uint64_t(record_idx_[i]) >= shards_->records(size_t(s)))
      throw std::invalid_argument("plan entry " + std::to_string(i) + " is out of range");
  }
  size_t n = shard_idx_.size();
  num_batches_ = cfg_.drop_last ? n / cfg_.batch_size : (n + cfg_.batch_size - 1) / cfg_.batch_size;
  ring_.resize(size_t(cfg_.prefetch));
  // See NOTE [working set]: every planned batch holds its shards until it is collated.
  {
    std::vector<uint32_t> all, mark(shards_->size(), kNoBatch);
    all.reserve(std::min(n, size_t(1) << 20));
    for (size_t b = 0; b < num_batches_; ++b) {
      const size_t end = std::min(n, (b + 1) * cfg_.batch_size);
      for (size_t i = b * cfg_.batch_size; i < end; ++i) {
        uint32_t s = uint32_t(shard_idx_[i]);
        if (mark[s] != uint32_t(b)) {
          mark[s] = uint32_t(b);
          all.push_back(s);
        }
      }
    }
    shards_->retain(all);
    last_batch_ = std::move(mark);  // each shard's last batch: the last that marked it
  }
  spans_of_.reset(new std::atomic<uint8_t>[shards_->size()]());
  released_.assign(num_batches_, 0);
  map_ahead_ = std::make_shared<MapAhead>();
  {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    map_ahead_->budget = pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) / 2 : 0;
  }
  int nthreads = std::min<int>(cfg_.num_threads, int(std::max<size_t>(num_batches_, 1)));
  threads_.reserve(size_t(nthreads));
  workers_left_ = size_t(nthreads);
  try {
    for (int t = 0; t < nthreads; ++t) threads_.emplace_back([this, t] { worker_loop(size_t(t)); });
  } catch (const std::system_error& e) {
    const size_t started = threads_.size();
    abandon_start();  // NOTE [thread start failure]
    throw thread_start_error(e, "collation thread " + std::to_string(started + 1) + " of " + std::to_string(nthreads) +
                                    " (num_workers)");
  }
}

std::thread BatchPipeline::stop_mapper(std::deque<std::shared_ptr<const Shard>>* unmapped) noexcept {
  // The mapper (NOTE [map ahead]) stops within one piece; what it was still handed is let go
  // (by the caller, after this lock).
  std::thread mapper;
  if (!map_ahead_) return mapper;
  {
    std::lock_guard<std::mutex> lk(map_ahead_->mu);
    map_ahead_->stop.store(true, std::memory_order_relaxed);
    unmapped->swap(map_ahead_->queue);
    mapper = std::move(map_ahead_->thread);
  }
  map_ahead_->cv.notify_all();
  return mapper;
}

void BatchPipeline::abandon_start() noexcept {
  // A worker that started may have started the mapper too.
  std::deque<std::shared_ptr<const Shard>> unmapped;
  std::thread mapper = stop_mapper(&unmapped);
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    stop_ = true;
    cancel_.store(true, std::memory_order_release);
  }
  cv_work_->notify_all();
  for (auto& t : threads_) t.join();  // each finishes the batch it may have claimed
  threads_.clear();
  if (mapper.joinable()) mapper.join();
  for (size_t b = 0; b < num_batches_; ++b) release_batch(b);  // what the constructor retained
  for (auto& p : ring_) p = Pending();
}

uint64_t BatchPipeline::destroyed_on_workers() noexcept { return destroyed_on_worker.load(); }

BatchPipeline::~BatchPipeline() {
  if (on_worker) destroyed_on_worker.fetch_add(1);
  if (::getpid() == pid_) {
    // See NOTE [hand-over gate]: a predecessor's worker raising this pipeline finishes first.
    std::lock_guard<std::mutex> g(gate_->mu);
    gate_->target = nullptr;
  }
  close();
  if (::getpid() != pid_) {
    // Forked child: destroying a condition variable the parent's threads were waiting on
    // blocks forever in glibc, so the child leaks them (NOTE [pipeline shutdown]).
    (void)cv_work_.release();
    (void)cv_ready_.release();
  }
}

void BatchPipeline::close() {
  if (::getpid() != pid_) {
    // Forked child: the worker threads and possibly-held locks belong to the parent. So
    // does the mapper, with the mutex and condition variable it may have held or waited on.
    auto* leaked = new std::vector<std::thread>(std::move(threads_));
    (void)leaked;
    if (map_ahead_) (void)new std::shared_ptr<MapAhead>(std::move(map_ahead_));
    closed_ = true;
    return;
  }
  // A second close() waits for the first: when any close() returns, every thread is joined
  // or detached, so the destructor that may follow never destroys a joinable std::thread.
  std::lock_guard<std::mutex> closing(close_mu_);
  bool finished;
  std::pair<std::shared_ptr<Gate>, int> next;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    cancel_.store(true, std::memory_order_release);
    finished = workers_left_ == 0;
    // Every batch taken while a worker had yet to leave (the consumer was quicker): no
    // worker hands over now, so the close does (hand_over()); nothing of this pipeline
    // needs a slot any more.
    next = take_successor();
    if (consumed_ < num_batches_) next.first.reset();  // closed mid-epoch: nothing to hand over
  }
  // NOTE [no join at the end]: once every worker has left its loop (the epoch was
  // collated; each decremented workers_left_ under mu_ and touches nothing of this
  // pipeline after releasing it), the threads are only exiting: they are detached, not
  // joined. A join here waits for each to be scheduled once more, which on a busy machine
  // (the next epoch's workers running) cost the training loop 0.5-1.7 ms at every epoch
  // boundary. Otherwise (closed mid-epoch, or before the last worker left) they are woken
  // and joined.
  std::deque<std::shared_ptr<const Shard>> unmapped;
  std::thread mapper = stop_mapper(&unmapped);
  cv_work_->notify_all();
  cv_ready_->notify_all();
  // The mapper is ended beside the workers, not appended to threads_: that append allocated,
  // and a bad_alloc there destroyed the joinable mapper (std::terminate).
  auto end_thread = [finished](std::thread& t) {
    if (!t.joinable()) return;
    if (finished)
      t.detach();
    else
      t.join();
  };
  for (auto& t : threads_) end_thread(t);
  end_thread(mapper);
  threads_.clear();
  unmapped.clear();
  raise(next.first, next.second);
  // Workers released every batch they claimed; the rest will never be collated.
  for (size_t b = next_claim_; b < num_batches_; ++b) release_batch(b);
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& p : ring_) p = Pending();  // drop slot references so they return to the pool
}

void BatchPipeline::set_ahead(int n, bool later) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    const size_t v = size_t(std::clamp(n, 1, cfg_.prefetch));
    if (later) {
      ahead_later_ = v;
      return;
    }
    ahead_ = v;
    ahead_later_ = 0;
  }
  cv_work_->notify_all();
}

void BatchPipeline::hand_over(const std::shared_ptr<BatchPipeline>& next, int ahead) {
  if (!next || next.get() == this) throw std::invalid_argument("hand_over needs another pipeline");
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (workers_left_ > 0 && !closed_) {
      successor_ = next->gate_;
      successor_ahead_ = ahead;
      return;
    }
  }
  next->set_ahead(ahead);
}

void BatchPipeline::adopt(int ahead) {
  no_grow_.store(false, std::memory_order_release);
  pool_->wake_waiters();  // a worker waiting for a free slot may now make one
  bool idle;
  {
    std::lock_guard<std::mutex> lk(mu_);
    idle = ahead_ == 0;
  }
  // Raised at the next take when batches are under way (that take wakes the workers
  // anyway); at once when none may be claimed yet, or the next take would wait forever.
  set_ahead(ahead, /*later=*/!idle);
}

std::pair<std::shared_ptr<BatchPipeline::Gate>, int> BatchPipeline::take_successor() {
  // An epoch that failed does not push the next one ahead (its read-ahead stays low until
  // the next iter() adopts it): the same storage fault would hit it too.
  std::shared_ptr<Gate> next = failed_ ? nullptr : std::move(successor_);
  successor_.reset();
  return {std::move(next), successor_ahead_};
}

void BatchPipeline::raise(const std::shared_ptr<Gate>& gate, int ahead) {
  if (!gate) return;
  std::lock_guard<std::mutex> lk(gate->mu);
  if (gate->target) gate->target->set_ahead(ahead);
}

void BatchPipeline::set_threads(int n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    active_threads_ = size_t(std::clamp(n, 1, cfg_.num_threads));
  }
  cv_work_->notify_all();
}

int BatchPipeline::threads() const {
  std::lock_guard<std::mutex> lk(mu_);
  return int(active_threads_);
}

int BatchPipeline::ahead() const {
  std::lock_guard<std::mutex> lk(mu_);
  return int(ahead_);
}

std::vector<uint32_t> BatchPipeline::batch_shards(size_t b) const {
  const size_t begin = b * cfg_.batch_size;
  const size_t end = std::min(shard_idx_.size(), begin + cfg_.batch_size);
  std::vector<uint32_t> out(shard_idx_.begin() + std::ptrdiff_t(begin), shard_idx_.begin() + std::ptrdiff_t(end));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void BatchPipeline::release_batch(size_t b) {
  if (released_[b]) return;
  released_[b] = 1;
  const std::vector<uint32_t> shards = batch_shards(b);
  // See NOTE [span descriptor] in shard_reader.cpp: the last batch of a shard read in spans.
  for (uint32_t s : shards)
    if (last_batch_[s] == b && spans_of_[s].load(std::memory_order_relaxed)) shards_->drop_span_file(s);
  shards_->release(shards);
}

void BatchPipeline::map_ahead(std::shared_ptr<const Shard> shard) {
  if (cannot_map_ahead.load(std::memory_order_relaxed)) return;
  MapAhead& m = *map_ahead_;
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.off || m.stop.load(std::memory_order_relaxed) || shard->file_bytes() > m.budget) return;
  m.budget -= shard->file_bytes();
  if (!m.thread.joinable()) {
    try {
      m.thread = std::thread(map_loop, map_ahead_);
    } catch (const std::system_error&) {
      m.off = true;  // an optimisation only: the workers fault the pages in themselves
      return;
    }
  }
  m.queue.push_back(std::move(shard));
  m.cv.notify_one();
}

uint64_t BatchPipeline::mapped_ahead_bytes() const noexcept {
  return map_ahead_ ? map_ahead_->mapped.load(std::memory_order_relaxed) : 0;
}

void BatchPipeline::map_loop(std::shared_ptr<MapAhead> m) {
  for (;;) {
    std::shared_ptr<const Shard> sh;  // released outside the lock (its last reference unmaps it)
    {
      std::unique_lock<std::mutex> lk(m->mu);
      m->cv.wait(lk, [&] { return m->stop.load(std::memory_order_relaxed) || !m->queue.empty(); });
      if (m->stop.load(std::memory_order_relaxed)) return;
      sh = std::move(m->queue.front());
      m->queue.pop_front();
    }
    const int64_t mapped = sh->map_pages(m->stop);
    if (mapped >= 0) {
      m->mapped.fetch_add(uint64_t(mapped), std::memory_order_relaxed);
    } else {
      cannot_map_ahead.store(true, std::memory_order_relaxed);
      std::deque<std::shared_ptr<const Shard>> drop;
      std::lock_guard<std::mutex> lk(m->mu);
      m->off = true;
      drop.swap(m->queue);
      return;
    }
  }
}

void BatchPipeline::advise_batches(size_t from, size_t to, bool whole_files) {
  const size_t n = shard_idx_.size();
  const size_t begin = from * cfg_.batch_size, end = std::min(n, to * cfg_.batch_size);
  if (begin >= end) return;
  // Nothing is queued where every shard the batches read is mapped and queued whole already
  // (every epoch after a first that queued them): the passes below would skip every record
  // and claim nothing, after sorting them all (2.5% of a warm 8 KB loader's CPU samples).
  thread_local std::vector<uint64_t> seen_in_call;  // the call that last looked at shard i
  thread_local uint64_t call = 0;
  ++call;
  if (seen_in_call.size() < shards_->size()) seen_in_call.resize(shards_->size(), 0);
  bool all_queued = true;
  for (size_t i = begin; i < end && all_queued; ++i) {
    const auto s = size_t(shard_idx_[i]);
    if (s >= seen_in_call.size()) {  // not a shard of the set: the full pass below says so
      all_queued = false;
      break;
    }
    if (seen_in_call[s] == call) continue;
    seen_in_call[s] = call;
    const std::shared_ptr<const Shard> h = shards_->peek(s);
    all_queued = h && h->whole_file_queued();
  }
  if (all_queued) return;
  std::vector<std::pair<int32_t, int64_t>> rows;
  rows.reserve(end - begin);
  // See NOTE [cold spans]: a span-shaped batch reads its runs itself; queued, they would
  // come in as small requests and be read through page faults.
  for (size_t b = from; b < to; ++b) {
    if (span_shaped(b)) continue;
    for (size_t i = b * cfg_.batch_size; i < std::min(n, (b + 1) * cfg_.batch_size); ++i)
      rows.emplace_back(shard_idx_[i], record_idx_[i]);
  }
  if (rows.empty()) return;
  std::sort(rows.begin(), rows.end());
  const size_t nf = shards_->fields().size();
  // Phase 1: every distinct shard, opened now without its whole-file read-ahead if it is not
  // mapped yet and is a regular file (a FIFO or device would block its open: the batch
  // that reads it opens it, once). A pending set's shards only if mapped already, as a
  // download is never waited for here; a bounded set's too when opening them would unmap
  // others.
  std::vector<int32_t> ids;  // the distinct shards, ascending
  for (size_t k = 0; k < rows.size(); ++k)
    if (k == 0 || rows[k].first != rows[k - 1].first) ids.push_back(rows[k].first);
  const bool mapped_only = shards_->pending_set() || shards_->room() < ids.size();
  std::vector<std::shared_ptr<const Shard>> held(ids.size());
  // NOTE [open apart]: the first batches of a shuffled epoch each read records of every
  // shard, and the workers that claim them at once would open the same shards in the same
  // (ascending) order: the second worker waiting for each shard the first is opening
  // (See NOTE [one open per shard] in shard_reader.cpp; before it, opening it again), and the
  // first batch waiting for every shard opened one after another. So a worker starts its opens at
  // its own share of the list (batch b at (b mod threads) / threads of it) and wraps around:
  // the workers open different shards at once, then find the rest open. Measured on 400 MB
  // of 12 KB records in 7 shards, page cache dropped before each fresh process, 8 runs
  // alternated with the ascending order: the first batch of a globally shuffled epoch came
  // after 15-17 ms against 27-31 ms (the opens of a cold cache read each shard's header and
  // metadata from the device). The epoch's time is the device's either way.
  const size_t workers = std::max<size_t>(1, size_t(cfg_.num_threads));
  const size_t first = ids.size() * (from % workers) / workers;
  for (size_t j = 0; j < ids.size(); ++j) {
    const size_t at = (first + j) % ids.size();
    const size_t id = size_t(ids[at]);
    try {
      std::shared_ptr<const Shard> h = shards_->peek(id);
      struct stat st{};
      if (!h && !mapped_only && ::stat(shards_->path(id).c_str(), &st) == 0 && S_ISREG(st.st_mode))
        h = shards_->get(id, &cancel_, /*read_ahead=*/false);
      held[at] = std::move(h);
    } catch (...) {
      held[at] = nullptr;  // the batch that reads it raises the error
    }
  }
  // A shard already queued whole needs nothing per record: its records' small reads would
  // only cut into that sequential stream.
  std::vector<uint8_t> queued(held.size());
  for (size_t j = 0; j < held.size(); ++j) queued[j] = held[j] && held[j]->whole_file_queued();
  std::shared_ptr<const Shard> sh;
  size_t k = 0;
  int32_t last = -1;
  // The pending range of sh's payload, and one per column (a column's blocks lie apart from
  // the payload the records' other fields read, so the two would break each other's runs).
  std::vector<std::pair<uint64_t, uint64_t>> pend(nf + 1, {0, 0});
  auto add = [&](size_t p, uint64_t a, uint64_t z) {
    auto& [lo, hi] = pend[p];
    if (hi > lo && a <= hi + kAdviseGap && z >= lo) {
      lo = std::min(lo, a);
      hi = std::max(hi, z);
      return;
    }
    if (sh && hi > lo) sh->advise_range(lo, hi - lo);
    lo = a;
    hi = z;
  };
  auto flush = [&] {
    for (auto& [lo, hi] : pend) {
      if (sh && hi > lo) sh->advise_range(lo, hi - lo);
      lo = hi = 0;
    }
  };
  for (const auto& [s, rec] : rows) {
    if (s != last) {
      flush();
      sh = queued[k] ? nullptr : held[k];
      ++k;
      last = s;
    }
    if (!sh || sh->seen(uint64_t(rec))) continue;  // read already: its pages were in memory
    for (size_t f = 0; f < nf; ++f) {
      if (const int32_t c = sh->column_of(f); c >= 0) {
        // A column's value is read with its whole checksum block (NOTE [column layout]):
        // the block comes in, not just the row (else its check faulted, NOTE [metadata first]).
        const auto [off, len] = sh->column_block_range(size_t(c), uint64_t(rec));
        add(size_t(c) + 1, off, off + len);
      } else {
        const IndexEntry e = sh->entry(uint64_t(rec), f);
        const uint64_t a = sh->payload_offset() + e.offset;
        add(0, a, a + e.stored_size);
      }
    }
  }
  flush();
  // Phase 3: then each shard whole, behind the records needed first; a cold one is mapped
  // ahead too (NOTE [map ahead]; told before the claim, whose queued pages count as present).
  if (whole_files)
    for (const auto& h : held) {
      if (!h) continue;
      double resident = 1.0;  // before the claim, whose queued pages count as present
      if (h->claim_read_ahead(&resident) && resident < 0.5) map_ahead(h);
    }
}

void BatchPipeline::worker_loop(size_t index) {
  on_worker = true;
  for (;;) {
    size_t b, adv_from = 0, adv_to = 0;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_->wait(lk, [&] {
        return stop_ || next_claim_ >= num_batches_ || (index < active_threads_ && next_claim_ < consumed_ + ahead_);
      });
      if (stop_) return;
      if (next_claim_ >= num_batches_) {
        if (--workers_left_ > 0) return;  // the last worker out hands over (hand_over())
        auto [next, n] = take_successor();
        lk.unlock();
        raise(next, n);  // hand_over(): this thread wakes the next pipeline's workers
        return;
      }
      b = next_claim_++;
      adv_from = advised_;  // batch b's records now; the later batches' after b (NOTE [cold read-ahead])
      adv_to = std::min(num_batches_, b + 1);
      if (adv_to > advised_) advised_ = adv_to;
    }
    // See NOTE [cold read-ahead]: batch b's own records before it is filled; the later
    // batches' only once b is delivered, so that a shard of theirs that cannot be opened
    // (a stalled mount, a missing file) never holds back a batch that does not read it.
    if (adv_to > adv_from) advise_batches(adv_from, adv_to, /*whole_files=*/false);
    // The last claim: workers asleep for room in the ring have nothing left to claim;
    // woken now they leave, so the last one out hands over (hand_over()) without waiting
    // for close().
    if (b + 1 == num_batches_) cv_work_->notify_all();
    Pending done;
    for (;;) {
      try {
        fill(b, &done.batch);
      } catch (const RetryBatch&) {
        continue;  // See NOTE [self-healing]: the shard is being fetched again; get() waits for it
      } catch (...) {
        done.batch = Batch();
        done.error = std::current_exception();
      }
      break;
    }
    done.ready = true;
    // Each batch is released by the one worker that claimed it (released_[b] is its own).
    release_batch(b);
    bool wake;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (done.error) failed_ = true;
      ring_[b % ring_.size()] = std::move(done);
      const uint64_t t = now_ns();  // See NOTE [paired wake-ups]: the gap between batches
      if (last_in_ns_ != 0) gap_ns_ = gaps_++ == 0 ? t - last_in_ns_ : gap_ns_ - gap_ns_ / 8 + (t - last_in_ns_) / 8;
      last_in_ns_ = t;
      wake = consumer_waits_ && consumer_wakes();
    }
    if (wake) cv_ready_->notify_all();
    {
      std::lock_guard<std::mutex> lk(mu_);
      adv_from = std::max(advised_, b + 1);
      adv_to = std::min(num_batches_, b + 1 + kAdviseBatches);
      if (adv_to > advised_) advised_ = adv_to;
    }
    if (adv_to > adv_from) advise_batches(adv_from, adv_to, /*whole_files=*/true);
  }
}

// fill()'s working state for one batch: what its steps hand on to the next.
struct BatchPipeline::FillState {
  size_t rows = 0;                                 // rows in the batch
  const int32_t* shard_of_row = nullptr;           // row i's shard in the plan
  const int64_t* record_of_row = nullptr;          // row i's record in the plan
  std::vector<uint32_t> visit;                     // rows in storage order (order_rows_by_storage())
  std::vector<std::shared_ptr<const Shard>> held;  // each distinct shard once (NOTE [working set])
  std::vector<const Shard*> shard_of;              // row i's shard
  std::vector<uint32_t> max_len;                   // per variable field: its longest value's length
  // See NOTE [ragged batches]: each variable field's row offsets (in rows of the field), row order.
  std::vector<std::vector<uint64_t>> row_off;
  std::vector<size_t> stride;  // padded rows: bytes per row
  ValueTotals totals;
  // See NOTE [cold spans]: row i's stored bytes from span_base[i], which holds the payload
  // from offset span_off[i] on; empty (or a null entry) where rows read the mapping.
  std::vector<const uint8_t*> span_base;
  std::vector<uint64_t> span_off;
};

void BatchPipeline::fill(size_t b, Batch* out) {
  const size_t begin = b * cfg_.batch_size;
  FillState st;
  st.rows = std::min(cfg_.batch_size, shard_idx_.size() - begin);
  st.shard_of_row = shard_idx_.data() + begin;  // row i is plan entry begin + i
  st.record_of_row = record_idx_.data() + begin;
  order_rows_by_storage(&st);

  const uint64_t t_open = now_ns();
  // See NOTE [cold spans]: a shard a span-shaped batch opens is not queued whole either.
  hold_shards(&st, /*read_ahead=*/!span_shaped(b));
  read_cold_spans(&st);
  const uint64_t t_fill = now_ns();
  counters_.shard_wait_ns.fetch_add(t_fill - t_open, std::memory_order_relaxed);
  out->index = b;
  out->rows = st.rows;
  take_slot_and_shape(&st, out);
  collate_records(&st, out);
  finish_streaming_stores();  // order the streaming stores of copy_row() before the batch is published
  count_batch(st, t_fill);
}

void BatchPipeline::order_rows_by_storage(FillState* st) const {
  // Rows are visited in storage order (shard, then record), not batch order: a shuffled
  // batch then reads its sources at ascending addresses, which the TLB and the hardware
  // prefetcher handle far better. Each record still lands in its own row.
  const int32_t* shard = st->shard_of_row;
  const int64_t* record = st->record_of_row;
  const size_t rows = st->rows;
  st->visit.resize(rows);
  // (shard, record) packed into one key beside its row, sorted without a lookup per
  // comparison; a record number past 32 bits (never in practice) takes the general sort.
  thread_local std::vector<std::pair<uint64_t, uint32_t>> keyed;
  keyed.resize(rows);
  bool packed = true;
  for (size_t i = 0; i < rows && packed; ++i) {
    packed = shard[i] >= 0 && record[i] >= 0 && uint64_t(record[i]) <= UINT32_MAX;
    keyed[i] = {uint64_t(uint32_t(shard[i])) << 32 | uint64_t(record[i]), uint32_t(i)};
  }
  if (packed) {
    std::sort(keyed.begin(), keyed.end());
    for (size_t k = 0; k < rows; ++k) st->visit[k] = keyed[k].second;
    return;
  }
  for (size_t i = 0; i < rows; ++i) st->visit[i] = uint32_t(i);
  std::sort(st->visit.begin(), st->visit.end(), [&](uint32_t a, uint32_t c) {
    int32_t sa = shard[a], sc = shard[c];
    return sa != sc ? sa < sc : record[a] < record[c];
  });
}

void BatchPipeline::hold_shards(FillState* st, bool read_ahead) {
  // Pass 1: hold each distinct shard once (NOTE [working set]) and find each variable
  // field's max length.
  const auto& fields = shards_->fields();
  const size_t nf = fields.size();
  const size_t rows = st->rows;
  st->shard_of.resize(rows);
  st->max_len.assign(nf, 0);
  st->row_off.resize(cfg_.ragged ? nf : 0);
  for (auto& o : st->row_off) o.assign(rows + 1, 0);
  int32_t last = -1;
  for (size_t k = 0; k < rows; ++k) {
    const size_t i = st->visit[k];
    const int32_t s = st->shard_of_row[i];
    if (s != last) {
      st->held.push_back(shards_->get(size_t(s), &cancel_, read_ahead));
      last = s;
    }
    st->shard_of[i] = st->held.back().get();
    for (size_t f = 0; f < nf; ++f)
      if (fields[f].variable) {
        const uint32_t len = st->shard_of[i]->entry(uint64_t(st->record_of_row[i]), f).leading;
        st->max_len[f] = std::max(st->max_len[f], len);
        if (cfg_.ragged) st->row_off[f][i + 1] = len;
      }
  }
  for (auto& o : st->row_off)
    for (size_t i = 0; i < rows; ++i) o[i + 1] += o[i];
}

bool BatchPipeline::span_shaped(size_t b) const {
  const size_t n = shard_idx_.size(), begin = b * cfg_.batch_size, end = std::min(n, begin + cfg_.batch_size);
  if (end < begin + kSpanMinRows) return false;
  size_t runs = 0;
  uint64_t bytes = 0;  // the batch's share of its shards' bytes, by the manifest's averages
  for (size_t i = begin; i < end; ++i) {
    if (i == begin || shard_idx_[i] != shard_idx_[i - 1] || record_idx_[i] != record_idx_[i - 1] + 1)
      if (++runs > kMaxSpans) return false;
    const size_t s = size_t(shard_idx_[i]);
    bytes += shards_->file_bytes(s) / std::max<uint64_t>(1, shards_->records(s));
  }
  return bytes <= kMaxSpanBytes;
}

void BatchPipeline::read_cold_spans(FillState* st) {
  // See NOTE [cold spans]: the runs of consecutive records, in storage order.
  const size_t rows = st->rows;
  if (rows < kSpanMinRows) return;
  const auto& fields = shards_->fields();
  const size_t nf = fields.size();
  const uint32_t* visit = st->visit.data();
  struct Run {
    size_t k0, k1;
    uint64_t lo, hi;  // payload offsets of its stored bytes
  };
  std::vector<Run> runs;
  uint64_t span = 0, stored = 0;
  for (size_t k = 0; k < rows;) {
    const Shard* sh = st->shard_of[visit[k]];
    size_t k1 = k + 1;
    while (k1 < rows && st->shard_of[visit[k1]] == sh &&
           st->record_of_row[visit[k1]] == st->record_of_row[visit[k1 - 1]] + 1)
      ++k1;
    if (runs.size() == kMaxSpans) return;
    uint64_t lo = ~uint64_t(0), hi = 0;
    for (size_t j = k; j < k1; ++j)
      for (size_t f = 0; f < nf; ++f) {
        if (sh->column_of(f) >= 0) continue;
        const IndexEntry e = sh->entry(uint64_t(st->record_of_row[visit[j]]), f);
        lo = std::min(lo, e.offset);
        hi = std::max(hi, e.offset + e.stored_size);
        stored += e.stored_size;
      }
    if (hi > lo) {
      runs.push_back(Run{k, k1, lo, hi});
      span += hi - lo;
    }
    k = k1;
  }
  if (runs.empty() || span > kMaxSpanBytes || span > 2 * stored) return;
  // A shard this pipeline reads in spans goes on being read so, whatever the read-ahead behind
  // the spans brought in already (NOTE [span descriptor] in shard_reader.cpp). A shard wholly
  // in the page cache when it was mapped counts as in memory without asking the kernel page
  // by page (NOTE [whole file cached] in shard_reader.cpp): mincore() looks up every page of
  // a run not mapped yet in the page cache, which was 11-12% of a warm first epoch's samples
  // (480 MB of 12 KB records in order: every batch asked it of its run).
  double cold = 0;
  bool streaming = true;
  for (const Run& r : runs) {
    const Shard* sh = st->shard_of[visit[r.k0]];
    if (spans_of_[uint32_t(st->shard_of_row[visit[r.k0]])].load(std::memory_order_relaxed)) continue;
    streaming = false;
    if (sh->mostly_cached()) continue;  // wholly or mostly cached (NOTE [mostly cached] in shard_reader.cpp)
    cold += (1.0 - resident_share(sh->payload() + r.lo, r.hi - r.lo)) * double(r.hi - r.lo);
  }
  if (!streaming && 2 * cold < double(span)) return;  // mostly in memory: the mapping is the cheaper read
  // The runs' column values are read through the mapping by collate_records(): queued now,
  // ahead of the spans, they are in memory when it reaches them (NOTE [cold spans]).
  for (const Run& r : runs) {
    const Shard* sh = st->shard_of[visit[r.k0]];
    if (sh->claim_columns_read_ahead(kColumnsWhole)) continue;
    const uint64_t rec0 = uint64_t(st->record_of_row[visit[r.k0]]);
    const uint64_t rec1 = uint64_t(st->record_of_row[visit[r.k1 - 1]]);
    for (size_t f = 0; f < nf; ++f)
      if (const int32_t c = sh->column_of(f); c >= 0) {
        const uint64_t lo = sh->column_block_range(size_t(c), rec0).first;
        const auto [off, len] = sh->column_block_range(size_t(c), rec1);
        sh->advise_range(lo, off + len - lo);
      }
  }
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < span) buffer.resize(size_t(span));
  st->span_base.assign(rows, nullptr);
  st->span_off.assign(rows, 0);
  uint64_t at = 0;
  for (const Run& r : runs) {
    const Shard* sh = st->shard_of[visit[r.k0]];
    if (!sh->read_span(sh->payload_offset() + r.lo, r.hi - r.lo, buffer.data() + at)) {
      st->span_base.clear();  // the mapping then, as for a warm batch
      st->span_off.clear();
      return;
    }
    spans_of_[uint32_t(st->shard_of_row[visit[r.k0]])].store(1, std::memory_order_relaxed);
    for (size_t j = r.k0; j < r.k1; ++j) {
      st->span_base[visit[j]] = buffer.data() + at;
      st->span_off[visit[j]] = r.lo;
    }
    at += r.hi - r.lo;
  }
}

void BatchPipeline::take_slot_and_shape(FillState* st, Batch* out) {
  const auto& fields = shards_->fields();
  const size_t nf = fields.size();
  const size_t rows = st->rows;
  out->slot = pool_->acquire(&no_grow_, &cancel_);
  if (!out->slot) throw LoaderError(ErrorKind::kState, "", -1, "", "cancelled while waiting for a free batch slot");
  Slot& slot = *out->slot;
  out->fields.resize(nf);
  st->stride.assign(nf, 0);
  std::vector<size_t> field_bytes(nf);  // the field's whole buffer
  for (size_t f = 0; f < nf; ++f) {
    const FieldSpec& spec = fields[f];
    FieldView& v = out->fields[f];
    v.shape.assign(1, int64_t(rows));
    if (spec.variable && cfg_.ragged) {
      v.shape.assign(1, int64_t(st->row_off[f][rows]));
      v.shape.insert(v.shape.end(), spec.dims.begin() + 1, spec.dims.end());
      field_bytes[f] = size_t(st->row_off[f][rows]) * spec.row_bytes;
      slot.lengths[f].reserve(rows * sizeof(int64_t));
      v.lengths = reinterpret_cast<int64_t*>(slot.lengths[f].data());
    } else if (spec.variable) {
      v.shape.push_back(int64_t(st->max_len[f]));
      v.shape.insert(v.shape.end(), spec.dims.begin() + 1, spec.dims.end());
      st->stride[f] = size_t(st->max_len[f]) * spec.row_bytes;
      slot.lengths[f].reserve(rows * sizeof(int64_t));
      v.lengths = reinterpret_cast<int64_t*>(slot.lengths[f].data());
    } else {
      v.shape.insert(v.shape.end(), spec.dims.begin(), spec.dims.end());
      st->stride[f] = spec.row_bytes;
      v.lengths = nullptr;
    }
    if (!(spec.variable && cfg_.ragged)) field_bytes[f] = rows * st->stride[f];
    size_t before = slot.data[f].capacity();
    // A fixed-shape field: batch_size rows of row_bytes every batch (fewer in the last).
    slot.data[f].reserve(std::max<size_t>(field_bytes[f], 1), !spec.variable);
    if (slot.data[f].capacity() != before) ++slot.allocations;
    v.data = slot.data[f].data();
  }
}

void BatchPipeline::collate_records(FillState* st, Batch* out) {
  // Pass 2: verify, decode and place every record's fields into its row, in visit order.
  // A value whose bytes fail their checksum: a cached copy is healed (NOTE [self-healing]),
  // anything else raised.
  const auto& fields = shards_->fields();
  const size_t nf = fields.size();
  const size_t rows = st->rows;
  const uint32_t* visit = st->visit.data();
  const Shard* const* shard_of = st->shard_of.data();
  const int64_t* record_of_row = st->record_of_row;
  const size_t* stride = st->stride.data();
  ValueTotals t;
  Mismatch bad;  // set by a step that returns false, then raised
  for (size_t k = 0; k < rows; ++k) {
    const size_t i = visit[k];
    prefetch_next_records(shard_of, visit, record_of_row, k, rows);
    const Shard& sh = *shard_of[i];
    const uint64_t rec = uint64_t(record_of_row[i]);
    // See NOTE [cold spans]: the stored bytes from the batch's buffer, or through the mapping.
    const bool spanned = !st->span_base.empty() && st->span_base[i];
    const uint8_t* src = spanned ? st->span_base[i] : sh.payload();
    const uint64_t src_off = spanned ? st->span_off[i] : 0;
    const bool verify = !sh.verified(rec);  // NOTE [verify once] in shard_reader.h
    for (size_t f = 0; f < nf; ++f) {
      const bool ragged = cfg_.ragged && fields[f].variable;
      uint8_t* dst = out->fields[f].data + (ragged ? st->row_off[f][i] * fields[f].row_bytes : i * stride[f]);
      if (const int32_t c = sh.column_of(f); c >= 0) {
        if (!place_column_value(sh, size_t(c), rec, dst, &t, &bad))
          raise_corrupt(*st, i, rec, f, bad.what, bad.got, bad.want);
        continue;
      }
      const IndexEntry e = sh.entry(rec, f);
      const char* malformed = nullptr;
      if (!place_indexed_value(sh, e, src + (e.offset - src_off), verify, dst, &bad, &malformed))
        raise_corrupt(*st, i, rec, f, bad.what, bad.got, bad.want);
      if (malformed)
        throw LoaderError(ErrorKind::kFormat, sh.path(), int64_t(rec), fields[f].name,
                          std::string("LZ4 block is malformed: ") + malformed);
      if (fields[f].variable) {
        // Zero the padding so no bytes of an earlier batch leak into this one.
        if (!ragged) std::memset(dst + e.decoded_size, 0, stride[f] - e.decoded_size);
        out->fields[f].lengths[i] = int64_t(e.leading);
      }
      t.stored += e.stored_size;
      t.decoded += e.decoded_size;
      if (e.codec == kCodecLZ4) t.lz4_stored += e.stored_size;
      if (verify) t.verified += e.stored_size;
    }
    if (verify) sh.mark_verified(rec);
    if (!sh.seen(rec)) sh.mark_seen(rec);
  }
  st->totals = t;
}

void BatchPipeline::raise_corrupt(const FillState& st, size_t i, uint64_t rec, size_t f, const char* what, uint64_t got,
                                  uint64_t want) {
  const auto& fields = shards_->fields();
  const Shard& sh = *st.shard_of[i];
  char digests[200];
  std::snprintf(digests, sizeof digests, "%s checksum mismatch (corrupt data): %s %016llx, %s says %016llx", what,
                shard_checksum_name(sh.version()), static_cast<unsigned long long>(got),
                sh.column_of(f) >= 0 ? "column table" : "index", static_cast<unsigned long long>(want));
  LoaderError err(ErrorKind::kChecksum, sh.path(), int64_t(rec), fields[f].name, digests);
  std::string earlier;
  if (shards_->pending_set() && shards_->report_corrupt(size_t(st.shard_of_row[i]), &sh, err.what(), &earlier))
    throw RetryBatch{};
  if (earlier.empty()) throw err;
  throw LoaderError(ErrorKind::kChecksum, sh.path(), int64_t(rec), fields[f].name,
                    std::string(digests) +
                        "; the cached copy was discarded and fetched again after an earlier "
                        "failure (" +
                        earlier + "), and failed again");
}

void BatchPipeline::count_batch(const FillState& st, uint64_t t_fill) {
  counters_.records.fetch_add(st.rows, std::memory_order_relaxed);
  counters_.stored_bytes.fetch_add(st.totals.stored, std::memory_order_relaxed);
  counters_.decoded_bytes.fetch_add(st.totals.decoded, std::memory_order_relaxed);
  counters_.lz4_stored_bytes.fetch_add(st.totals.lz4_stored, std::memory_order_relaxed);
  counters_.verified_bytes.fetch_add(st.totals.verified, std::memory_order_relaxed);
  counters_.collate_ns.fetch_add(now_ns() - t_fill, std::memory_order_relaxed);
  counters_.batches.fetch_add(1, std::memory_order_relaxed);
}

// NOTE [paired wake-ups]: a consumer faster than the workers (the loader binds) slept and was
// woken once per batch: each wake-up is two context switches, and on a machine with no idle
// core the woken consumer preempts a worker, whose caches it then cools. Asleep, the consumer
// is now woken when the batch it waits for and the batch after it are both in (or the batch
// alone: when it failed, when it is the last, or when no worker is making the next one), so
// it takes two batches per wake-up; a next batch that takes longer (a stalled read) holds
// the one that is in at most until kPairWaitMs after the consumer fell asleep; a consumer
// still asleep then is woken by its batch alone (a slow batch, a stall: no periodic
// wake-ups while it waits). Pairs are waited for only while batches come in less than
// kPairGapNs apart (a moving average of the gaps, from the epoch's kPairAfterGaps-th gap on):
// otherwise the wait would end on its timer more often than not, one wake-up more per batch,
// and a batch that is in would wait up to kPairWaitMs for a pair that does not come soon. A consumer that finds its
// batch in takes it at once, as before: only a sleep waits for a pair, so a training loop that the loader keeps ahead
// of is unchanged, and one that waits gets its batches in pairs at the same rate.
bool BatchPipeline::consumer_wakes() const noexcept {
  const Pending& p = ring_[consumed_ % ring_.size()];
  if (!p.ready) return false;
  if (!pairs_ || p.error) return true;
  const size_t after = consumed_ + 1;
  if (after >= num_batches_ || after >= next_claim_) return true;  // none after it, or none being made
  return ring_[after % ring_.size()].ready;
}

BatchPipeline::Next BatchPipeline::next(Batch* out, int64_t timeout_ms) {
  if (::getpid() != pid_)
    throw LoaderError(ErrorKind::kState, "", -1, "",
                      "iterator used in a forked child; create a new iterator after fork");
  uint64_t t0 = now_ns();
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError(ErrorKind::kState, "", -1, "", "iterator is closed");
  if (consumed_ >= num_batches_) return Next::kEnd;
  Pending& p = ring_[consumed_ % ring_.size()];
  if (!p.ready && !stop_) {
    // See NOTE [paired wake-ups]: woken by the pair for kPairWaitMs, then by the batch alone.
    const auto now = std::chrono::steady_clock::now();
    const auto deadline = now + std::chrono::milliseconds(timeout_ms);
    auto pair_until = now + std::chrono::milliseconds(kPairWaitMs);
    if (timeout_ms >= 0 && pair_until > deadline) pair_until = deadline;
    auto woken = [&] { return stop_ || consumer_wakes(); };
    consumer_waits_ = true;
    if (gaps_ >= kPairAfterGaps && gap_ns_ < kPairGapNs) {  // two batches usually come in well within the wait
      pairs_ = true;
      cv_ready_->wait_until(lk, pair_until, woken);
      pairs_ = false;
    }
    if (timeout_ms < 0)
      cv_ready_->wait(lk, woken);
    else
      cv_ready_->wait_until(lk, deadline, woken);
    consumer_waits_ = false;
    if (!p.ready && !stop_) {
      counters_.wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      return Next::kTimeout;
    }
  }
  if (!p.ready) throw LoaderError(ErrorKind::kState, "", -1, "", "iterator was closed while waiting");
  Pending taken = std::move(p);
  p = Pending();
  ++consumed_;
  if (ahead_later_ != 0) {
    ahead_ = ahead_later_;
    ahead_later_ = 0;
  }
  // NOTE [batched wake-ups]: a worker that is awake claims the next batch by itself when it
  // finishes one; only sleeping workers need waking, and they sleep only when the ring is
  // full, i.e. the loader is ahead of the consumer. Waking one per taken batch would cost the
  // consumer a context switch per batch (on a machine with few idle cores the woken worker
  // preempts the consumer's thread), so they are woken once half the read-ahead is free,
  // and then each claims a batch. The consumer still never waits for an unclaimed batch:
  // when every claimed batch is taken, all of the read-ahead is free.
  const size_t room = consumed_ + ahead_ > next_claim_ ? consumed_ + ahead_ - next_claim_ : 0;
  const bool wake = next_claim_ < num_batches_ && room >= std::max<size_t>(1, ahead_ / 2);
  lk.unlock();
  if (wake) cv_work_->notify_all();
  counters_.wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  if (taken.error) {
    // The failed batch ends the iteration: later batches are not delivered.
    close();
    std::rethrow_exception(taken.error);
  }
  *out = std::move(taken.batch);
  return Next::kBatch;
}

}  // namespace pyloader
