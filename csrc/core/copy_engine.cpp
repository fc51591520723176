#include "core/copy_engine.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include "core/clock.h"
#include "core/cuda_driver.h"
#include "core/errors.h"

namespace pyloader {
namespace {

constexpr size_t kStageAlign = 64;

// Waits until pred() holds or timeout_ms (< 0: forever) passed; false on timeout.
template <typename Pred>
bool wait_for(std::condition_variable& cv, std::unique_lock<std::mutex>& lk, int64_t timeout_ms, Pred pred) {
  if (timeout_ms < 0) {
    cv.wait(lk, pred);
    return true;
  }
  return cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), pred);
}

class CpuCopyBackend final : public CopyBackend {
 public:
  const char* name() const noexcept override { return "cpu"; }
  void after_stream(size_t, uintptr_t) override {}
  void issue(size_t, const std::vector<CopySegment>& segments) override {
    for (const auto& s : segments)
      if (s.dst && s.bytes) std::memcpy(s.dst, s.src, s.bytes);
  }
  void complete(size_t) override {}
  void before_stream(size_t, uintptr_t) override {}
};

class CudaCopyBackend final : public CopyBackend {
 public:
  CudaCopyBackend(const cuda::Driver& d, int device, size_t depth)
      : d_(d), ctx_(d, device), pid_(::getpid()), ready_(depth, nullptr), done_(depth, nullptr) {
    cuda::ScopedContext scope(d_, ctx_.get());
    try {
      cuda::check(d_, d_.StreamCreate(&stream_, cuda::kStreamNonBlocking), "cuStreamCreate");
      for (size_t m = 0; m < depth; ++m) {
        cuda::check(d_, d_.EventCreate(&ready_[m], cuda::kEventDisableTiming), "cuEventCreate");
        // Blocking sync: the engine thread sleeps in complete() instead of spinning a core.
        cuda::check(d_, d_.EventCreate(&done_[m], cuda::kEventDisableTiming | cuda::kEventBlockingSync),
                    "cuEventCreate");
      }
    } catch (...) {
      destroy();
      throw;
    }
  }
  ~CudaCopyBackend() override { destroy(); }

  const char* name() const noexcept override { return "cuda"; }
  void thread_start() override {
    // The engine thread works in this context for its whole life.
    cuda::CUresult r = d_.CtxPushCurrent(ctx_.get());
    if (r != cuda::kSuccess)
      throw LoaderError(ErrorKind::kDevice, "", -1, "",
                        "the copy engine thread could not start: cuCtxPushCurrent of device " +
                            std::to_string(ctx_.ordinal()) + "'s primary context failed: " + cuda::error_text(d_, r));
  }
  void after_stream(size_t m, uintptr_t stream) override {
    cuda::ScopedContext scope(d_, ctx_.get());
    cuda::check(d_, d_.EventRecord(ready_[m], reinterpret_cast<cuda::CUstream>(stream)), "cuEventRecord");
  }
  void issue(size_t m, const std::vector<CopySegment>& segments) override {
    cuda::check(d_, d_.StreamWaitEvent(stream_, ready_[m], 0), "cuStreamWaitEvent");
    for (const auto& s : segments)
      if (s.dst && s.bytes)
        cuda::check(d_, d_.MemcpyHtoDAsync(reinterpret_cast<cuda::CUdeviceptr>(s.dst), s.src, s.bytes, stream_),
                    "cuMemcpyHtoDAsync");
    cuda::check(d_, d_.EventRecord(done_[m], stream_), "cuEventRecord");
  }
  void complete(size_t m) override { cuda::check(d_, d_.EventSynchronize(done_[m]), "cuEventSynchronize"); }
  void sync_all() override { cuda::check(d_, d_.StreamSynchronize(stream_), "cuStreamSynchronize"); }
  void before_stream(size_t m, uintptr_t stream) override {
    cuda::ScopedContext scope(d_, ctx_.get());
    cuda::check(d_, d_.StreamWaitEvent(reinterpret_cast<cuda::CUstream>(stream), done_[m], 0), "cuStreamWaitEvent");
  }

 private:
  void destroy() noexcept {
    if (::getpid() != pid_) return;  // forked child: the parent's handles are not ours
    try {
      cuda::ScopedContext scope(d_, ctx_.get());
      if (stream_) (void)d_.StreamSynchronize(stream_);
      for (auto e : ready_)
        if (e) (void)d_.EventDestroy(e);
      for (auto e : done_)
        if (e) (void)d_.EventDestroy(e);
      if (stream_) (void)d_.StreamDestroy(stream_);
    } catch (...) {
      // Teardown at exit: the driver may already be deinitialised.
    }
    stream_ = nullptr;
    ready_.assign(ready_.size(), nullptr);
    done_.assign(done_.size(), nullptr);
  }

  const cuda::Driver& d_;
  cuda::PrimaryContext ctx_;
  pid_t pid_;
  cuda::CUstream stream_ = nullptr;
  std::vector<cuda::CUevent> ready_;  // recorded on the consumer's stream at submit
  std::vector<cuda::CUevent> done_;   // recorded on our stream after the copies
};

}  // namespace

std::unique_ptr<CopyBackend> make_cpu_copy_backend() { return std::make_unique<CpuCopyBackend>(); }

std::unique_ptr<CopyBackend> make_cuda_copy_backend(int device, size_t depth) {
  std::string why;
  const cuda::Driver* d = cuda::driver(&why);
  if (!d) throw LoaderError(ErrorKind::kDevice, "", -1, "", why);
  return std::make_unique<CudaCopyBackend>(*d, device, depth);
}

CopyEngine::CopyEngine(std::unique_ptr<CopyBackend> backend, std::shared_ptr<SlotPool> staging, size_t depth)
    : backend_(std::move(backend)), staging_(std::move(staging)), pid_(::getpid()) {
  if (depth < 1) throw std::invalid_argument("depth must be >= 1");
  if (!staging_ || staging_->num_fields() < 1) throw std::invalid_argument("staging must be a SlotPool with a field");
  ring_.resize(depth);
  // NOTE [copy engine threads]. A thread that cannot start (its context cannot be made
  // current) fails the construction here, rather than every later job with errors that do
  // not say why.
  int threads = 0;
  std::exception_ptr err;
  try {
    thread_ = std::thread([this] { thread_loop(); });
    ++threads;
    completer_ = std::thread([this] { complete_loop(); });
    ++threads;
  } catch (const std::system_error& e) {
    // See NOTE [thread start failure] in core/errors.h; the thread that did start is stopped and joined below.
    err = std::make_exception_ptr(thread_start_error(e, threads == 0 ? "the copy engine's issuing thread"
                                                                     : "the copy engine's completion thread"));
  }
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_consumer_->wait(lk, [&] { return started_ == threads; });
    if (!err) err = start_error_;
    if (err) stop_ = true;  // the thread that did start returns (nothing was submitted)
  }
  if (err) {
    cv_engine_->notify_all();
    if (thread_.joinable()) thread_.join();
    if (completer_.joinable()) completer_.join();
    closed_ = true;
    std::rethrow_exception(err);
  }
}

CopyEngine::~CopyEngine() {
  close();
  if (::getpid() != pid_) {
    (void)cv_engine_.release();  // See NOTE [copy engine shutdown]: leaked in a forked child
    (void)cv_consumer_.release();
  }
}

void CopyEngine::close() {
  if (::getpid() != pid_) {
    auto* leaked = new std::thread(std::move(thread_));
    auto* leaked_completer = new std::thread(std::move(completer_));
    (void)leaked;
    (void)leaked_completer;
    closed_ = true;
    return;
  }
  // A second close() waits for the first: when it returns, the thread is joined and
  // every issued copy has completed, whoever closed.
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
  }
  cv_engine_->notify_all();
  cv_consumer_->notify_all();
  if (thread_.joinable()) thread_.join();
  if (completer_.joinable()) completer_.join();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : ring_) e = Entry();  // every issued job has completed: release the slots
}

uint64_t CopyEngine::submitted() {
  if (::getpid() != pid_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine used in a forked child");
  std::lock_guard<std::mutex> lk(mu_);
  return submitted_;
}

uint64_t CopyEngine::taken() {
  if (::getpid() != pid_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine used in a forked child");
  std::lock_guard<std::mutex> lk(mu_);
  return taken_;
}

CopyEngine::Wait CopyEngine::submit(CopyJob& job, uintptr_t stream, int64_t timeout_ms, uint64_t* ticket) {
  if (::getpid() != pid_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine used in a forked child");
  const uint64_t t0 = now_ns();
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine is closed");
  if (async_error_) std::rethrow_exception(async_error_);
  const uint64_t t = submitted_;
  const size_t depth = ring_.size();
  if (t >= depth && taken_ < t - depth + 1)
    throw LoaderError(ErrorKind::kState, "", -1, "",
                      "copy engine: more than " + std::to_string(depth) + " jobs outstanding (take them in order)");
  if (!wait_for(*cv_consumer_, lk, timeout_ms, [&] { return stop_ || t < completed_ + depth; })) {
    counters_.submit_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return Wait::kTimeout;
  }
  if (stop_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine was closed while waiting");
  if (async_error_) std::rethrow_exception(async_error_);
  const size_t m = size_t(t % depth);
  // Order the copies after the consumer's work so far (its destination allocations).
  // Called under mu_: the engine thread cannot issue marker m before it is recorded.
  backend_->after_stream(m, stream);
  Entry& e = ring_[m];
  e = Entry();
  e.job = std::move(job);
  ++submitted_;
  *ticket = t;
  lk.unlock();
  cv_engine_->notify_all();
  counters_.submit_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  return Wait::kDone;
}

CopyEngine::Wait CopyEngine::take(uint64_t ticket, uintptr_t stream, int64_t timeout_ms, CopyResult* out) {
  if (::getpid() != pid_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine used in a forked child");
  const uint64_t t0 = now_ns();
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine is closed");
  if (ticket != taken_ || ticket >= submitted_)
    throw LoaderError(ErrorKind::kState, "", -1, "",
                      "copy engine: take(" + std::to_string(ticket) + ") out of order (next is " +
                          std::to_string(taken_) + ", submitted " + std::to_string(submitted_) + ")");
  if (!wait_for(*cv_consumer_, lk, timeout_ms, [&] { return stop_ || issued_ > ticket; })) {
    counters_.take_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return Wait::kTimeout;
  }
  if (stop_) throw LoaderError(ErrorKind::kState, "", -1, "", "copy engine was closed while waiting");
  Entry& e = ring_[size_t(ticket % ring_.size())];
  ++taken_;
  std::exception_ptr err = e.error;
  if (!err) {
    *out = std::move(e.result);
    e.result = CopyResult();
    try {
      backend_->before_stream(size_t(ticket % ring_.size()), stream);
    } catch (...) {
      err = std::current_exception();
    }
  }
  lk.unlock();
  cv_consumer_->notify_all();
  counters_.take_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  if (err) std::rethrow_exception(err);
  return Wait::kDone;
}

void CopyEngine::run_job(Entry& e, size_t m) {
  CopyJob& job = e.job;
  uint64_t copied = 0;
  if (job.stage) {
    // Pack every source into one staging buffer (64-byte aligned pieces), then copy
    // from there: the sources may be pageable, the staging slot is pinned when the pool is.
    size_t total = 0;
    const size_t n = job.segments.size();
    e.result.offsets.resize(n);
    e.result.result.resize(n);
    e.result.bytes.resize(n);
    for (size_t i = 0; i < n; ++i) {
      e.result.offsets[i] = total;
      e.result.result[i] = job.segments[i].dst == nullptr;
      e.result.bytes[i] = job.segments[i].bytes;
      total += (job.segments[i].bytes + kStageAlign - 1) / kStageAlign * kStageAlign;
    }
    std::shared_ptr<Slot> slot = staging_->acquire();
    slot->data[0].reserve(std::max<size_t>(total, 1));
    uint8_t* base = slot->data[0].data();
    for (size_t i = 0; i < job.segments.size(); ++i) {
      CopySegment& s = job.segments[i];
      if (s.bytes) std::memcpy(base + e.result.offsets[i], s.src, s.bytes);
      s.src = base + e.result.offsets[i];
      counters_.staged_bytes.fetch_add(s.bytes, std::memory_order_relaxed);
    }
    e.result.base = base;
    e.result.staged = slot;
    job.source = std::move(slot);  // the copies below read it: keep it until they complete
  }
  backend_->issue(m, job.segments);
  for (const auto& s : job.segments)
    if (s.dst) copied += s.bytes;
  counters_.bytes.fetch_add(copied, std::memory_order_relaxed);
  counters_.jobs.fetch_add(1, std::memory_order_relaxed);
}

bool CopyEngine::start_thread() {
  std::exception_ptr start_error;
  try {
    backend_->thread_start();
  } catch (...) {
    start_error = std::current_exception();
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++started_;
  if (start_error && !start_error_) start_error_ = start_error;
  cv_consumer_->notify_all();
  return !start_error;  // on failure the constructor stops the other thread and rethrows
}

void CopyEngine::thread_loop() {
  const bool ok = start_thread();
  std::unique_lock<std::mutex> lk(mu_);
  // See NOTE [copy engine threads]: this thread only issues; it never waits for the GPU.
  while (ok) {
    cv_engine_->wait(lk, [&] { return stop_ || issued_ < submitted_; });
    if (stop_) break;  // jobs submitted and not issued are dropped (their copies never run)
    const uint64_t t = issued_;
    const size_t m = size_t(t % ring_.size());
    Entry& e = ring_[m];
    lk.unlock();
    const uint64_t t0 = now_ns();
    std::exception_ptr err;
    try {
      run_job(e, m);
    } catch (...) {
      err = std::current_exception();
      // Copies queued before the failing one may still run: let them finish before
      // the consumer hears of the error and releases the destinations.
      try {
        backend_->sync_all();
      } catch (...) {
      }
    }
    counters_.issue_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    lk.lock();
    e.error = err;
    e.issued = true;
    ++issued_;
    cv_consumer_->notify_all();
    cv_engine_->notify_all();  // the completion thread
  }
  issuer_done_ = true;
  cv_engine_->notify_all();
}

void CopyEngine::complete_loop() {
  const bool ok = start_thread();
  std::unique_lock<std::mutex> lk(mu_);
  if (!ok) {
    // The constructor fails: the issuing thread stops before issuing anything.
    cv_engine_->wait(lk, [&] { return issuer_done_; });
    return;
  }
  for (;;) {
    cv_engine_->wait(lk, [&] { return completed_ < issued_ || (stop_ && issuer_done_); });
    if (completed_ == issued_) return;  // See NOTE [copy engine shutdown]: all issued jobs have completed
    const uint64_t t = completed_;
    const size_t m = size_t(t % ring_.size());
    Entry& e = ring_[m];
    const bool failed = bool(e.error);
    lk.unlock();
    const uint64_t t0 = now_ns();
    std::exception_ptr err;
    try {
      // A job that failed part way may have queued some copies but not its marker.
      if (failed)
        backend_->sync_all();
      else
        backend_->complete(m);
    } catch (...) {
      err = std::current_exception();
    }
    counters_.complete_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    lk.lock();
    if (err && !async_error_) async_error_ = err;
    e.job = CopyJob();  // See NOTE [copy ordering]: the source slot returns only now
    if (failed) e.result = CopyResult();
    ++completed_;
    cv_consumer_->notify_all();
  }
}

}  // namespace pyloader
