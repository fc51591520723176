#include "core/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <mutex>

#include "core/errors.h"

namespace pyloader {
namespace cuda {
namespace {

struct Loaded {
  Driver d{};
  bool ok = false;
  std::string why;
};

template <typename Fn>
bool resolve(void* lib, const char* name, Fn* out, std::string* why) {
  void* p = ::dlsym(lib, name);
  if (!p) {
    *why = std::string("libcuda.so.1 has no symbol ") + name;
    return false;
  }
  *out = reinterpret_cast<Fn>(p);
  return true;
}

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
  std::string* w = &l.why;
  bool ok = resolve(lib, "cuInit", &d.Init, w) && resolve(lib, "cuDeviceGetCount", &d.DeviceGetCount, w) &&
            resolve(lib, "cuDeviceGet", &d.DeviceGet, w) &&
            resolve(lib, "cuDevicePrimaryCtxRetain", &d.DevicePrimaryCtxRetain, w) &&
            resolve(lib, "cuDevicePrimaryCtxRelease_v2", &d.DevicePrimaryCtxRelease, w) &&
            resolve(lib, "cuCtxPushCurrent_v2", &d.CtxPushCurrent, w) &&
            resolve(lib, "cuCtxPopCurrent_v2", &d.CtxPopCurrent, w) &&
            resolve(lib, "cuMemHostAlloc", &d.MemHostAlloc, w) && resolve(lib, "cuMemFreeHost", &d.MemFreeHost, w) &&
            resolve(lib, "cuStreamCreate", &d.StreamCreate, w) &&
            resolve(lib, "cuStreamDestroy_v2", &d.StreamDestroy, w) &&
            resolve(lib, "cuStreamSynchronize", &d.StreamSynchronize, w) &&
            resolve(lib, "cuEventCreate", &d.EventCreate, w) && resolve(lib, "cuEventDestroy_v2", &d.EventDestroy, w) &&
            resolve(lib, "cuEventRecord", &d.EventRecord, w) &&
            resolve(lib, "cuEventSynchronize", &d.EventSynchronize, w) &&
            resolve(lib, "cuStreamWaitEvent", &d.StreamWaitEvent, w) &&
            resolve(lib, "cuMemcpyHtoDAsync_v2", &d.MemcpyHtoDAsync, w) &&
            resolve(lib, "cuGetErrorName", &d.GetErrorName, w) &&
            resolve(lib, "cuGetErrorString", &d.GetErrorString, w);
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
