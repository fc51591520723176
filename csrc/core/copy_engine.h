// The copy engine: one native thread that moves batches from host memory to their
// destination (a GPU, or host memory for the CPU twin) while the training loop runs.
//
// NOTE [copy ordering]: for each job the consumer thread first submits (recording a
// marker on its current stream, after which the destination memory -- freshly taken from
// torch's caching allocator on that stream -- may be written), then later takes it
// (making its current stream wait for the copies). The issuing thread issues a job's
// copies only after that first marker, and a job's host source (a pinned batch slot or
// the engine's staging slot) is released only once its copies have completed, so a slot
// is never rewritten while a DMA engine still reads it (NOTE [slot reuse]). A job's
// marker pair lives in ring entry ticket % depth and is reused only after that job was
// taken and completed. The GPU backend implements the markers with CUDA events on a
// dedicated non-blocking stream; the CPU backend copies synchronously, so its markers are
// no-ops -- every other step, the ring and the shutdown are shared.
//
// take() itself never blocks the host on the GPU (it only orders the consumer's stream),
// but submit() does: ticket t reuses ring entry t % depth, which frees up only when job
// t - depth's copies have completed (the completion thread's wait on its done marker). Those
// copies ran after the work the consumer had queued when it submitted t - depth, so
// submit() -- and with it the loader's next() -- waits until the GPU has caught up to
// within `depth` submits of the host: the host runs at most `depth` (device_prefetch)
// steps ahead of the GPU. The bound is what keeps the markers, the staging slots and
// the pinned sources reusable without a host wait per job; submit_wait_ns counts it.
//
// NOTE [copy engine threads]: two native threads per engine. The issuing thread stages a
// job (packs its sources into a staging slot) and queues its copies; the completion
// thread waits, job by job in order, for the copies to complete and releases their host
// sources. The issuing thread never waits for the GPU, so staging job t+1 runs while job
// t's copies do: N jobs with staging time S and copy time C take about N * max(S, C), not
// N * (S + C) (with one thread that also waited in cuEventSynchronize, it was blocked there
// whenever a submit arrived, and the copy stream idled while it then staged). Both threads
// make the engine's context current once, for their whole life. Staging itself is one
// memcpy per source on the issuing thread.
//
// NOTE [copy engine shutdown]: close() stops the issuing thread from issuing further jobs,
// lets the completion thread wait for every job already issued to complete (so no copy
// still reads a slot that is about to be reused or freed), then joins both. In a forked
// child the threads do not exist and nothing is joined or synchronised.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/slot_pool.h"

namespace pyloader {

struct CopySegment {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;  // null with staging: the staged copy itself is the result
  size_t bytes = 0;
};

struct CopyJob {
  std::shared_ptr<Slot> source;  // the pinned slot the segments read from, kept until completion
  std::vector<CopySegment> segments;
  // The sources are caller memory (pageable, owned by Python until take()): the engine
  // thread first packs them into a staging slot of its own pool, then copies from there.
  bool stage = false;
};

// What a taken job hands back: for staged jobs, the staging slot and where each segment
// landed in it (offsets into its first buffer).
struct CopyResult {
  std::shared_ptr<Slot> staged;
  uint8_t* base = nullptr;
  std::vector<size_t> offsets;  // per segment
  std::vector<bool> result;     // per segment: the staged copy is the result (dst was null)
  std::vector<size_t> bytes;    // per segment
};

// What differs between a GPU and its CPU twin (NOTE [copy ordering]).
class CopyBackend {
 public:
  virtual ~CopyBackend() = default;
  virtual const char* name() const noexcept = 0;
  // On each engine thread (NOTE [copy engine threads]), once, before any other call there.
  virtual void thread_start() {}
  // Consumer thread, at submit: later copies of marker m are ordered after the work
  // already queued on `stream`.
  virtual void after_stream(size_t m, uintptr_t stream) = 0;
  // Issuing thread: queue the copies of marker m.
  virtual void issue(size_t m, const std::vector<CopySegment>& segments) = 0;
  // Completion thread: block until the copies of marker m have completed.
  virtual void complete(size_t m) = 0;
  // Either engine thread: block until every copy queued so far has completed.
  virtual void sync_all() {}
  // Consumer thread, at take: work queued on `stream` from now on runs after marker m's copies.
  virtual void before_stream(size_t m, uintptr_t stream) = 0;
};

// memcpy on the issuing thread.
std::unique_ptr<CopyBackend> make_cpu_copy_backend();
// Copies on a dedicated non-blocking stream of `device`, ordered by events. Throws
// LoaderError(kDevice) when the driver is missing or a call fails.
std::unique_ptr<CopyBackend> make_cuda_copy_backend(int device, size_t depth);

struct CopyCounters {
  std::atomic<uint64_t> jobs{0};
  std::atomic<uint64_t> bytes{0};           // bytes copied to destinations
  std::atomic<uint64_t> staged_bytes{0};    // bytes packed into staging slots
  std::atomic<uint64_t> issue_ns{0};        // issuing thread: staging and queueing copies
  std::atomic<uint64_t> complete_ns{0};     // completion thread: waiting for copies to complete
  std::atomic<uint64_t> take_wait_ns{0};    // consumer: blocked in take()
  std::atomic<uint64_t> submit_wait_ns{0};  // consumer: blocked in submit() for a free ring entry
};

class CopyEngine {
 public:
  // Starts the engine threads and waits for them to be ready: throws (LoaderError(kDevice) for
  // the CUDA backend) when one cannot start, e.g. its context cannot be made current.
  CopyEngine(std::unique_ptr<CopyBackend> backend, std::shared_ptr<SlotPool> staging, size_t depth);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  enum class Wait { kDone, kTimeout };
  // Consumer thread. Queues a job and returns its ticket (0, 1, 2, ...). Waits up to
  // timeout_ms (< 0: forever) for the ring entry of ticket - depth to be taken and
  // completed. Throws LoaderError(kState) if that job was never taken (the caller must
  // take jobs in order, at most `depth` outstanding).
  // `job` is moved from only when accepted (kDone).
  Wait submit(CopyJob& job, uintptr_t stream, int64_t timeout_ms, uint64_t* ticket);
  // Consumer thread. Waits up to timeout_ms for job `ticket` (the oldest not taken) to be
  // issued, then orders `stream` after its copies. Rethrows the job's error.
  Wait take(uint64_t ticket, uintptr_t stream, int64_t timeout_ms, CopyResult* out);
  // NOTE [copy engine shutdown]. Idempotent; called by the destructor.
  void close();

  size_t depth() const noexcept { return ring_.size(); }
  // Jobs accepted so far: the ticket the next accepted job gets.
  uint64_t submitted();
  // Jobs taken so far: a take() that threw consumed its ticket iff this passed it.
  // Both throw LoaderError(kState) in a forked child before touching the lock, which one of
  // the parent's threads may have held at the fork (NOTE [copy engine shutdown]).
  uint64_t taken();
  const char* backend_name() const noexcept { return backend_->name(); }
  const CopyCounters& counters() const noexcept { return counters_; }

 private:
  struct Entry {
    CopyJob job;
    CopyResult result;
    std::exception_ptr error;
    bool issued = false;
  };

  void thread_loop();    // the issuing thread
  void complete_loop();  // the completion thread
  // Runs backend_->thread_start(); false if it failed (then recorded in start_error_).
  bool start_thread();
  void run_job(Entry& e, size_t m);

  std::unique_ptr<CopyBackend> backend_;
  std::shared_ptr<SlotPool> staging_;
  pid_t pid_;
  std::mutex close_mu_;  // serialises close()
  std::mutex mu_;
  // Heap-allocated so that a forked child can leak them (as in BatchPipeline).
  std::unique_ptr<std::condition_variable> cv_engine_ = std::make_unique<std::condition_variable>();
  std::unique_ptr<std::condition_variable> cv_consumer_ = std::make_unique<std::condition_variable>();
  std::vector<Entry> ring_;
  uint64_t submitted_ = 0, issued_ = 0, completed_ = 0, taken_ = 0;
  bool stop_ = false;
  bool closed_ = false;
  int started_ = 0;                 // threads that ran thread_start() (under mu_)
  bool issuer_done_ = false;        // the issuing thread returned: nothing more will be issued
  std::exception_ptr start_error_;  // why a thread_start() failed: rethrown by the constructor
  std::exception_ptr async_error_;  // a completion that failed after its job was taken
  std::thread thread_;              // issues (NOTE [copy engine threads])
  std::thread completer_;           // completes
  CopyCounters counters_;
};

}  // namespace pyloader
