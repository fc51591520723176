// The CUDA driver API, loaded at run time from libcuda.so.1 and never linked, so one
// build of pyloader runs on machines with and without a GPU. Only the handful of entry
// points the pinned allocator and the copy engine use are declared, from the driver API's
// documented signatures (types are the driver's: opaque handles and int status codes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyloader {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUdeviceptr = unsigned long long;

constexpr CUresult kSuccess = 0;
constexpr CUresult kNotReady = 600;
constexpr unsigned kHostAllocPortable = 0x01;  // CU_MEMHOSTALLOC_PORTABLE
constexpr unsigned kStreamNonBlocking = 0x1;   // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING
constexpr unsigned kEventBlockingSync = 0x1;   // CU_EVENT_BLOCKING_SYNC

struct Driver {
  CUresult (*Init)(unsigned flags);
  CUresult (*DeviceGetCount)(int* count);
  CUresult (*DeviceGet)(CUdevice* dev, int ordinal);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext* ctx, CUdevice dev);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice dev);  // _v2
  CUresult (*CtxPushCurrent)(CUcontext ctx);          // _v2
  CUresult (*CtxPopCurrent)(CUcontext* ctx);          // _v2
  CUresult (*MemHostAlloc)(void** p, size_t bytes, unsigned flags);
  CUresult (*MemFreeHost)(void* p);
  CUresult (*StreamCreate)(CUstream* s, unsigned flags);
  CUresult (*StreamDestroy)(CUstream s);  // _v2
  CUresult (*StreamSynchronize)(CUstream s);
  CUresult (*EventCreate)(CUevent* e, unsigned flags);
  CUresult (*EventDestroy)(CUevent e);  // _v2
  CUresult (*EventRecord)(CUevent e, CUstream s);
  CUresult (*EventSynchronize)(CUevent e);
  CUresult (*StreamWaitEvent)(CUstream s, CUevent e, unsigned flags);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr dst, const void* src, size_t bytes, CUstream s);  // _v2
  CUresult (*GetErrorName)(CUresult r, const char** s);
  CUresult (*GetErrorString)(CUresult r, const char** s);
};

// The process's driver, loaded and initialised once; null when libcuda.so.1 is absent or
// cuInit fails, with the reason in *why (when given).
const Driver* driver(std::string* why = nullptr);

// "CUDA_ERROR_X (description)" for a status code.
std::string error_text(const Driver& d, CUresult r);

// Throws LoaderError(kDevice) naming `what` unless r is kSuccess. For calls whose failure
// must reach the caller; destructors ignore failures instead (teardown may already have
// unloaded the driver's state).
void check(const Driver& d, CUresult r, const char* what);

// The primary context of `ordinal`, retained for the lifetime of this object. It is the
// context torch's runtime uses, so streams and device pointers from torch are valid here.
class PrimaryContext {
 public:
  PrimaryContext(const Driver& d, int ordinal);
  ~PrimaryContext();
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  CUcontext get() const noexcept { return ctx_; }
  int ordinal() const noexcept { return ordinal_; }

 private:
  const Driver& d_;
  int ordinal_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  int pid_;
};

// Makes a context current on this thread for a scope and restores the caller's after,
// so a consumer thread's own current context (torch's) is never changed.
class ScopedContext {
 public:
  ScopedContext(const Driver& d, CUcontext ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  const Driver& d_;
  bool pushed_ = false;
};

}  // namespace cuda
}  // namespace pyloader
