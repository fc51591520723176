#include "core/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <mutex>

#include "core/dynamic_library.h"
#include "core/errors.h"

namespace pyloader {
namespace cuda {
namespace {

struct Loaded {
  Driver d{};
  bool ok = false;
  std::string why;
};

Loaded load() {
  Loaded l;
  // RTLD_NODELETE: the library stays mapped at exit, so late destructors may still call it.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) {
    const char* e = ::dlerror();
    l.why = std::string("cannot load libcuda.so.1 (no NVIDIA driver): ") + (e ? e : "unknown error");
    return l;
  }
  Driver& d = l.d;
  const SymbolResolver resolve(lib, "libcuda.so.1", &l.why);
  bool ok = resolve("cuInit", &d.Init) && resolve("cuDeviceGetCount", &d.DeviceGetCount) &&
            resolve("cuDeviceGet", &d.DeviceGet) && resolve("cuDevicePrimaryCtxRetain", &d.DevicePrimaryCtxRetain) &&
            resolve("cuDevicePrimaryCtxRelease_v2", &d.DevicePrimaryCtxRelease) &&
            resolve("cuCtxPushCurrent_v2", &d.CtxPushCurrent) && resolve("cuCtxPopCurrent_v2", &d.CtxPopCurrent) &&
            resolve("cuMemHostAlloc", &d.MemHostAlloc) && resolve("cuMemFreeHost", &d.MemFreeHost) &&
            resolve("cuStreamCreate", &d.StreamCreate) && resolve("cuStreamDestroy_v2", &d.StreamDestroy) &&
            resolve("cuStreamSynchronize", &d.StreamSynchronize) && resolve("cuEventCreate", &d.EventCreate) &&
            resolve("cuEventDestroy_v2", &d.EventDestroy) && resolve("cuEventRecord", &d.EventRecord) &&
            resolve("cuEventSynchronize", &d.EventSynchronize) && resolve("cuStreamWaitEvent", &d.StreamWaitEvent) &&
            resolve("cuMemcpyHtoDAsync_v2", &d.MemcpyHtoDAsync) && resolve("cuGetErrorName", &d.GetErrorName) &&
            resolve("cuGetErrorString", &d.GetErrorString);
  if (!ok) return l;
  CUresult r = d.Init(0);
  if (r != kSuccess) {
    l.why = "cuInit failed: " + error_text(d, r);
    return l;
  }
  int n = 0;
  r = d.DeviceGetCount(&n);
  if (r != kSuccess || n < 1) {
    l.why = r != kSuccess ? "cuDeviceGetCount failed: " + error_text(d, r) : std::string("no CUDA device");
    return l;
  }
  l.ok = true;
  return l;
}

}  // namespace

const Driver* driver(std::string* why) {
  static Loaded* loaded = new Loaded(load());  // leaked: usable by destructors at exit
  static const pid_t loaded_pid = ::getpid();
  if (loaded->ok && ::getpid() != loaded_pid) {
    if (why) *why = "the CUDA driver was initialised before this process forked; it cannot be used in a forked child";
    return nullptr;
  }
  if (!loaded->ok) {
    if (why) *why = loaded->why;
    return nullptr;
  }
  return &loaded->d;
}

std::string error_text(const Driver& d, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.GetErrorName(r, &name) != kSuccess || !name) name = "CUDA_ERROR_UNKNOWN";
  if (d.GetErrorString(r, &text) != kSuccess || !text) text = "unknown error";
  return std::string(name) + " (" + text + ", code " + std::to_string(r) + ")";
}

void check(const Driver& d, CUresult r, const char* what) {
  if (r != kSuccess)
    throw LoaderError(ErrorKind::kDevice, "", -1, "", std::string(what) + " failed: " + error_text(d, r));
}

PrimaryContext::PrimaryContext(const Driver& d, int ordinal) : d_(d), ordinal_(ordinal), pid_(::getpid()) {
  check(d, d.DeviceGet(&dev_, ordinal), "cuDeviceGet");
  check(d, d.DevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
}

PrimaryContext::~PrimaryContext() {
  // A forked child must not touch the parent's CUDA state.
  if (ctx_ && ::getpid() == pid_) (void)d_.DevicePrimaryCtxRelease(dev_);
}

ScopedContext::ScopedContext(const Driver& d, CUcontext ctx) : d_(d) {
  check(d, d.CtxPushCurrent(ctx), "cuCtxPushCurrent");
  pushed_ = true;
}

ScopedContext::~ScopedContext() {
  CUcontext popped = nullptr;
  if (pushed_) (void)d_.CtxPopCurrent(&popped);
}

}  // namespace cuda
}  // namespace pyloader
