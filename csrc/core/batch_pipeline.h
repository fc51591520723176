// The native hot path: worker threads read records from mapped shards, verify them,
// decode LZ4 and collate straight into a pooled batch slot; the consumer takes batches
// in plan order. No Python is touched on these threads.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/shard_reader.h"
#include "core/slot_pool.h"

namespace pyloader {

struct PipelineConfig {
  size_t batch_size = 1;
  bool drop_last = false;
  int num_threads = 1;     // worker threads started (the most that may collate)
  int active_threads = 0;  // of those, how many collate (1..num_threads; 0: all), see set_threads()
  int prefetch = 2;        // batches collated ahead of the consumer (ready or in progress), at most
  // The read-ahead limit at the start, 0..prefetch (-1: prefetch), see set_ahead().
  int ahead = -1;
  // A pipeline made ahead of its epoch (NOTE [epoch ahead] in pyloader/loader/dataloader.py):
  // it collates only into slots others return to the pool, until adopt().
  bool early = false;
  // NOTE [ragged batches]: variable fields are collated without padding: row i's values
  // start at the sum of the lengths of rows 0..i-1, and the field's shape is [sum of
  // lengths, ...]. For a consumer that cuts the rows apart itself (the Packer), so that a
  // batch of documents with a long tail of lengths costs its tokens, not rows x the longest.
  bool ragged = false;
};

struct FieldView {
  std::vector<int64_t> shape;  // [rows, ...]; the variable dim is the batch's max length
  uint8_t* data = nullptr;
  int64_t* lengths = nullptr;  // variable fields only: [rows]
};

struct Batch {
  size_t index = 0;
  size_t rows = 0;
  std::shared_ptr<Slot> slot;
  std::vector<FieldView> fields;
};

// Counters kept by the workers, read by stats(). Relaxed atomics: they are statistics.
struct PipelineCounters {
  std::atomic<uint64_t> records{0};
  std::atomic<uint64_t> stored_bytes{0};
  std::atomic<uint64_t> decoded_bytes{0};
  std::atomic<uint64_t> lz4_stored_bytes{0};  // compressed bytes decoded
  std::atomic<uint64_t> verified_bytes{0};    // bytes hashed (first read of a record)
  std::atomic<uint64_t> shard_wait_ns{0};     // worker time opening shards / waiting for fetches
  std::atomic<uint64_t> collate_ns{0};        // worker time verifying, decoding, copying
  std::atomic<uint64_t> wait_ns{0};           // consumer time blocked in next()
  std::atomic<uint64_t> batches{0};
};

class BatchPipeline {
 public:
  BatchPipeline(std::shared_ptr<ShardSet> shards, std::shared_ptr<SlotPool> pool, std::vector<int32_t> shard_idx,
                std::vector<int64_t> record_idx, PipelineConfig cfg);
  ~BatchPipeline();
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  enum class Next { kBatch, kEnd, kTimeout };
  // Waits up to timeout_ms (< 0: forever) for the next batch in plan order. Rethrows (as
  // LoaderError) the error of a batch that failed. The bounded wait lets the bindings
  // check for signals (Ctrl-C) between waits.
  Next next(Batch* out, int64_t timeout_ms = -1);
  // Stops the workers and joins them. Idempotent. Called by the destructor.
  void close();
  // How many batches the workers may collate ahead of the consumer from now on, clamped
  // to 1..prefetch (the ring's size). Lowering it never drops a claimed batch; raising it
  // wakes the workers. A pipeline made ahead of its epoch starts low (NOTE [epoch ahead]
  // in pyloader/loader/dataloader.py) and is raised when its epoch begins.
  // `later`: from the consumer's next take on (next() wakes the workers then anyway), so
  // the call itself wakes no thread.
  void set_ahead(int n, bool later = false);
  int ahead() const;
  // How many of the started workers collate from now on, clamped to 1..num_threads; the
  // others wait (a worker mid-batch finishes it first). For online tuning.
  void set_threads(int n);
  int threads() const;
  // Once every batch of this pipeline is collated (its last worker finds nothing left to
  // claim), that worker raises `next`'s read-ahead to `ahead` -- from a worker thread, so
  // the consumer is not the thread that wakes `next`'s workers. Not earlier: `next` takes
  // the slots the consumer frees, and a worker of this pipeline still to take a slot would
  // then find none free and grow the pool past its budget (NOTE [autotune]). Applied at
  // once if that moment has passed. Held weakly: a `next` already dropped is skipped;
  // nothing is raised if a batch of this pipeline failed.
  void hand_over(const std::shared_ptr<BatchPipeline>& next, int ahead);
  // The epoch of a pipeline made ahead (cfg.ahead >= 0) begins: read-ahead `ahead` from the
  // consumer's next take on, and the slot pool may grow again.
  void adopt(int ahead);
  size_t num_batches() const noexcept { return num_batches_; }
  bool ragged() const noexcept { return cfg_.ragged; }
  const PipelineCounters& counters() const noexcept { return counters_; }
  // Bytes of cold shards the mapper mapped into the process ahead of the workers (NOTE [map ahead]).
  uint64_t mapped_ahead_bytes() const noexcept;
  const std::vector<FieldSpec>& fields() const noexcept { return shards_->fields(); }
  // How many pipelines of this process were destroyed on a pipeline's worker thread: none
  // may be (NOTE [hand-over gate]). For tests.
  static uint64_t destroyed_on_workers() noexcept;

 private:
  struct Pending {
    bool ready = false;
    Batch batch;
    std::exception_ptr error;
  };

  void worker_loop(size_t index);
  // Collates batch b into *out. The shards it reads are held only for the call (NOTE
  // [working set] in shard_reader.h): one lookup per distinct shard, none per record.
  // Throws RetryBatch when a corrupt cached shard is being fetched again (NOTE [self-healing]).
  void fill(size_t b, Batch* out);
  // fill()'s steps, in order. FillState (batch_pipeline.cpp) is one batch's working state.
  struct FillState;
  // Sorts the batch's rows into storage order (shard, then record): the order they are read in.
  void order_rows_by_storage(FillState* st) const;
  // Pass 1: holds each distinct shard once and finds each variable field's max length
  // (and, for a ragged batch, its row offsets).
  void hold_shards(FillState* st, bool read_ahead);
  // NOTE [cold spans]: a batch that reads a few runs of consecutive records (an epoch in
  // order) from a cold page cache reads them with pread() into a buffer of the worker's, and
  // collate_records() verifies and copies from there, not through the mapping. Through the
  // mapping, the read-ahead that brought the pages in (MADV_WILLNEED, whole files) makes
  // single-page folios, read in requests of at most max_segments pages (~0.5-1 MiB here,
  // 450-700 requests per 400 MB, against ~250 of 1.5-2 MiB for read()), and every page was
  // then a page fault. A cold in-order epoch of 12 KB records (400 MB, 2 threads) read,
  // as medians of 8 rounds alternated with one of the other, 1.09 GB/s that way and 1.22
  // read with pread(), with no major page fault (7-157 before); benchmarks/bench_cold_read.py
  // measured 0.82 against 1.61 in one run and 1.19 against 0.99 in the next, where `cat` of
  // the same files read 1.7-2.0: this machine's run-to-run noise is as large as the gain.
  // So such a batch is not queued for read-ahead (advise_batches() leaves it out), the
  // shards it opens are not queued whole either (the workers' reads, and the kernel's
  // read-ahead behind them, are the stream), and fill()
  // reads its runs when less than half of their pages are in memory (mincore), through the
  // shard's span descriptor (NOTE [span descriptor] in shard_reader.cpp), which must still be
  // the mapped file (Shard::read_span(): device, inode and size; else, and on any read error,
  // the batch reads through the mapping as before). Once a pipeline reads a shard's runs so,
  // it reads every later batch of that shard so too, whatever the read-ahead behind the
  // spans brought in already. Pages in memory already (a warm first epoch, later epochs) are
  // read through the mapping.
  // Column values are always read through the mapping, so such a batch queues them before
  // it reads its runs: its shards' columns whole the first time
  // (Shard::claim_columns_read_ahead(), up to kColumnsWhole bytes), else its runs' blocks. Reached
  // cold, they were a page fault reading the device's read-around window (8 MiB here)
  // behind the batches' reads: the first batch of 64 MB shards of 12 KB records took 21-27
  // ms, and 11-14 ms (torch's batched gather: 10-12) with them queued.
  // A batch is span shaped when it has at least kSpanMinRows rows in at most kMaxSpans runs
  // (plan order: a shuffled batch never is) and, by the manifest's average record size, at
  // most kMaxSpanBytes; its runs' stored bytes must be at least half of their span.
  bool span_shaped(size_t b) const;
  void read_cold_spans(FillState* st);
  // Takes a slot from the pool and gives every field its shape, stride and buffer.
  void take_slot_and_shape(FillState* st, Batch* out);
  // Pass 2: verifies, decodes and places every record's fields into its row.
  void collate_records(FillState* st, Batch* out);
  // A value of row i (record rec, field f) failed its checksum: throws RetryBatch when the
  // shard is fetched again (NOTE [self-healing]), else the LoaderError.
  [[noreturn]] void raise_corrupt(const FillState& st, size_t i, uint64_t rec, size_t f, const char* what, uint64_t got,
                                  uint64_t want);
  // Adds the batch's tallies and collation time to counters_.
  void count_batch(const FillState& st, uint64_t t_fill);
  // The distinct shards batch b reads, ascending.
  std::vector<uint32_t> batch_shards(size_t b) const;
  void release_batch(size_t b);
  // NOTE [cold read-ahead]: from a cold page cache a shuffled batch reads records spread over
  // every shard, and each page fault on a page not yet read waits for a synchronous read of
  // the device's read-around window (8 MiB here) -- or, with the whole files queued for
  // read-ahead at open (NOTE [read-ahead at open] in shard_reader.cpp), for the queue ahead
  // of it. So the worker that claims batch b queues the records of the batches up to
  // b + kAdviseBatches not queued yet (batch b's before it fills it, the later ones once b
  // is delivered) in their shards, opened now without the whole-file read-ahead if they
  // are regular files (the open of a FIFO or device could block: only the batch that reads
  // a shard may wait on it): each record's stored bytes and the checksum block of each of
  // its column values (MADV_WILLNEED, ranges less than kAdviseGap apart merged; NOTE
  // [metadata first]), then, for the later batches only, each of those shards whole.
  // The records the next batches read come in first; the rest of the files stream in behind
  // them. A batch's own records are never queued behind whole files: the device's elevator
  // sorts reads by offset, so the first batch of a global shuffle waited for the whole
  // stream (239-272 ms against 71-162 ms with records only, 400 MB cold). Records of a shard
  // already queued whole are not queued again: on 8-12 KB records their small reads, mixed
  // into the sequential stream, cost a third to a half of the epoch's rate. Records already
  // read by this process (Shard::seen()) are skipped, so later epochs queue nothing. (Their
  // being verified is no sign of that: a file an earlier process verified is trusted whole
  // at open (NOTE [verified files] in shard_reader.cpp), and so nothing was queued for the
  // restarted job's cold epoch: its first batch of a global shuffle read the files through
  // one page fault of the device's read-around window after another, 157-164 ms of a
  // 185-195 ms epoch, 200 MB in 3 shards.) A
  // pending (remote) set queues only shards it has mapped, never waiting for a download, and
  // so does a bounded set without room for them (NOTE [mapping bound] in shard_reader.h).
  // Batches in order are left out: they read their records themselves (NOTE [cold spans]).
  void advise_batches(size_t from, size_t to, bool whole_files);
  // NOTE [map ahead]: a shuffled epoch from a cold page cache delivers almost every batch
  // only once the device has read almost every shard (a batch's records lie all over the
  // dataset), so the epoch ends with both workers collating ~all of it at once, and they
  // spent 15% of that time in page faults that map file pages already read (34,000
  // faults for 1.6 GB; fault-around maps 16 pages at a time). So each shard that
  // advise_batches queues whole while most of it is not in memory is also handed to one
  // mapper thread, which maps its pages into the process in file order
  // (Shard::map_pages: MADV_POPULATE_READ waits for pages still being read) while the
  // device reads and the workers wait anyway: the workers then find every page mapped.
  // Measured on 1.6 GB of 12 KB records, one globally shuffled epoch per fresh process
  // (perf, 2 runs each): the tail after the device's last read took 0.21-0.23 s against
  // 0.27-0.28 s without, with 10-21 of its ~850 samples in page faults against 141-165,
  // and the epoch 1.06-1.11 s against 1.14-1.19 s. (Hashing ahead too, in the same thread,
  // gained nothing more: the copy then reads the records from memory instead, and the
  // tail is bound by memory bandwidth either way.)
  // Shards mostly in memory already get no mapper (nothing waits for the device), nor do
  // more than half of the machine's memory in one epoch (pages mapped must not push out
  // pages read ahead and not yet used). The mapper is started with the first such shard;
  // it holds one shard at a time and no reference to the pipeline, stops at close()
  // within one 1 MiB piece, and is joined or detached with the workers.
  void map_ahead(std::shared_ptr<const Shard> shard);
  struct MapAhead;
  static void map_loop(std::shared_ptr<MapAhead> m);
  // Tells the mapper to stop and returns its thread (to join or detach) and, in *unmapped,
  // the shards it was still handed.
  std::thread stop_mapper(std::deque<std::shared_ptr<const Shard>>* unmapped) noexcept;
  // NOTE [hand-over gate]: hand_over() keeps the successor through its gate, never a
  // reference to it. A worker that raised the successor from a shared_ptr could hold the last
  // one when Python dropped it meanwhile (the loader closed, or the epoch made ahead was not
  // adopted), and the successor's destructor -- joining its threads, freeing its slots and,
  // for a pinned pool, calling cuMemFreeHost -- then ran on that worker, which close() may
  // already have detached (NOTE [no join at the end]), possibly while the interpreter exits.
  // Through the gate the worker raises the successor under the gate's mutex, and the
  // successor's destructor first clears the gate under that mutex: the successor is alive
  // for the whole raise, and only its owner ever destroys it.
  struct Gate {
    std::mutex mu;
    BatchPipeline* target = nullptr;  // null once that pipeline's destructor began
  };
  // hand_over(), with mu_ held: the successor's gate and its read-ahead (null after a
  // failed batch, or when none is registered); the registration is dropped either way.
  std::pair<std::shared_ptr<Gate>, int> take_successor();
  // Raises the read-ahead of the gate's pipeline to `ahead`, if it is still alive.
  static void raise(const std::shared_ptr<Gate>& gate, int ahead);
  // The constructor could not start every worker: stops and joins those it started and
  // releases the plan's shards (NOTE [thread start failure] in core/errors.h).
  void abandon_start() noexcept;
  // See NOTE [paired wake-ups]: whether the consumer, asleep in next(), is woken now (mu_ held).
  bool consumer_wakes() const noexcept;

  std::shared_ptr<ShardSet> shards_;
  std::shared_ptr<SlotPool> pool_;
  std::vector<int32_t> shard_idx_;
  std::vector<int64_t> record_idx_;
  PipelineConfig cfg_;
  size_t num_batches_ = 0;
  pid_t pid_;

  // NOTE [pipeline shutdown]: workers claim batch numbers in order, at most `prefetch`
  // ahead of the consumer, and poll `stop_` whenever they wait. close() sets stop_,
  // wakes everyone and joins. A worker mid-batch finishes that batch (bounded work)
  // before it sees stop_. In a forked child the threads do not exist: close() leaks
  // them instead of joining (joining or locking there could hang forever).
  std::mutex close_mu_;  // serialises close()
  mutable std::mutex mu_;
  // Heap-allocated so that a forked child can leak them instead of destroying them.
  // Workers wait on cv_work_ for room; the consumer waits on cv_ready_ for a batch.
  std::unique_ptr<std::condition_variable> cv_work_ = std::make_unique<std::condition_variable>();
  std::unique_ptr<std::condition_variable> cv_ready_ = std::make_unique<std::condition_variable>();
  bool stop_ = false;
  std::atomic<bool> cancel_{false};   // stop_, readable without mu_ (shard waits)
  std::atomic<bool> no_grow_{false};  // made ahead and not adopted: take only free slots
  bool closed_ = false;
  size_t next_claim_ = 0;
  size_t advised_ = 0;  // batches before it were queued for read-ahead (NOTE [cold read-ahead])
  size_t consumed_ = 0;
  size_t active_threads_ = 1;        // workers with index < active_threads_ claim batches
  size_t ahead_ = 1;                 // workers claim batch b only while b < consumed_ + ahead_
  size_t ahead_later_ = 0;           // set_ahead(n, later=true): ahead_ becomes n at the next take
  size_t workers_left_ = 0;          // workers still collating; 0: every batch has its slot
  bool consumer_waits_ = false;      // next() sleeps on cv_ready_ (NOTE [paired wake-ups])
  bool pairs_ = false;               // ... and is woken by two batches, not one
  uint64_t last_in_ns_ = 0;          // when the latest batch came in
  uint64_t gap_ns_ = 0;              // the time between batches coming in (a moving average)
  size_t gaps_ = 0;                  // gaps measured
  bool failed_ = false;              // a batch failed (hand_over() then raises nothing)
  std::shared_ptr<Gate> gate_;       // this pipeline's, for the predecessor (NOTE [hand-over gate])
  std::shared_ptr<Gate> successor_;  // hand_over()
  int successor_ahead_ = 0;
  std::vector<Pending> ring_;      // batch b lives at ring_[b % prefetch]
  std::vector<uint8_t> released_;  // batch b's shards were released (NOTE [working set])
  // See NOTE [span descriptor] in shard_reader.cpp: per shard of the set, the last batch of the
  // plan that reads it, and whether this pipeline reads its batches' runs with pread().
  std::vector<uint32_t> last_batch_;
  std::unique_ptr<std::atomic<uint8_t>[]> spans_of_;
  std::vector<std::thread> threads_;
  std::shared_ptr<MapAhead> map_ahead_;  // NOTE [map ahead]; its thread is started with the first shard
  PipelineCounters counters_;
};

}  // namespace pyloader
