/* A stand-in libcuda.so.1 for pyloader's tests on machines without a GPU.
 *
 * It implements exactly the driver entry points csrc/core/cuda_driver.cpp resolves, with
 * real semantics on the CPU, and checks the *call protocol* pyloader follows: which thread
 * has a context current, which allocations are live, what a stream has queued and when an
 * event completes. It does not model a GPU (a "device pointer" is ordinary host memory and
 * cuMemcpyHtoDAsync is a delayed memcpy); the real driver is exercised by tests/cuda on a
 * GPU machine. Built by tests/native/fake_cuda/build.py; used by tests/native/test_fake_driver.py,
 * whose scenarios are the functions of tests/native/fake_cuda/children.py.
 *
 * Model:
 *  - Contexts: $FAKE_CUDA_DEVICES devices (default 1, at most 4), each with one primary
 *    context. Each thread has its own context stack (cuCtxPushCurrent_v2 /
 *    cuCtxPopCurrent_v2). Every call except cuInit, cuDeviceGetCount, cuDeviceGet,
 *    cuDevicePrimaryCtxRetain/Release and cuGetError* fails with CUDA_ERROR_INVALID_CONTEXT
 *    (201) when the calling thread has no current context; such calls are counted
 *    ("no_ctx_calls").
 *  - Handles belong to the context current when they were made. A stream used while another
 *    context is current, or an event recorded on another context's stream, is rejected with
 *    CUDA_ERROR_INVALID_HANDLE and counted ("foreign_handles", also in "bad_handles");
 *    cuStreamWaitEvent accepts an event of any context, as the driver does.
 *  - Streams are FIFO queues, each drained by its own worker thread. Stream 0 and the legacy
 *    handle 1 (and, approximated, the per-thread handle 2) are the context's legacy default
 *    stream: also a queue with a worker, so work ordered on it is asynchronous to the host,
 *    as on a GPU. Stream flags are honoured: work queued on the legacy stream waits for
 *    all work queued before it on the context's blocking streams (created without
 *    CU_STREAM_NON_BLOCKING), and work queued on a blocking stream waits for the legacy
 *    stream's earlier work; non-blocking streams never wait for it ("legacy_waits" counts
 *    the implicit waits queued).
 *    cuMemcpyHtoDAsync_v2 queues a copy that the worker performs after a short sleep
 *    (FAKE_CUDA_COPY_DELAY_US, default 300 us), so a protocol that reads a destination or
 *    frees a source too early sees stale or poisoned bytes. cuEventRecord queues a marker;
 *    cuStreamWaitEvent makes the stream wait for the event's latest record at call time;
 *    cuEventSynchronize / cuStreamSynchronize block the caller.
 *  - cuMemHostAlloc / cuMemFreeHost track every allocation. Both synchronise the device, as
 *    the driver's do: they return only once every stream of every context has drained
 *    ("host_syncs" counts them, "host_syncs_busy" those that found work queued, and
 *    "host_sync_us" the time they waited). Allocations are whole-page mappings marked
 *    MADV_DONTFORK, as the driver's pinned memory: a forked child that reads one faults.
 *    Freed memory is poisoned (0xDB) and never unmapped, so a late copy from it is detected
 *    ("copies_from_freed") instead of crashing; a copy still queued when its source is
 *    freed is counted ("free_while_pending": with the synchronising free, only a copy queued
 *    by another thread meanwhile); double or unknown frees are counted ("bad_frees").
 *  - fork: a process other than the one that called cuInit gets CUDA_ERROR_NOT_INITIALIZED
 *    for every call, touches no lock, and appends "<pid> <function>" to the file named by
 *    $FAKE_CUDA_LOG (if set), so the parent can see what a forked child called.
 *  - Test hooks (not driver API): fake_cuda_stats() (a JSON object of counters and the
 *    first errors), fake_cuda_ctx_depth() (the calling thread's stack depth),
 *    fake_cuda_is_pinned(p), fake_cuda_pending(include_default), fake_cuda_set_copy_delay_us(us),
 *    fake_cuda_fail_copies(n, code) (the next n cuMemcpyHtoDAsync_v2 calls return `code`),
 *    fake_cuda_fail_pushes_elsewhere(n, code) (the next n cuCtxPushCurrent_v2 calls made by
 *    threads other than the caller of the hook return `code`: a copy engine thread that
 *    cannot start), fake_cuda_stream_flags(h) (a live stream's creation flags, -1 if none).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_UNKNOWN = 999,
};

#define EXPORT __attribute__((visibility("default")))
#define MAX_ERRORS 16
#define MAX_STACK 64
#define MAX_DEVICES 4
#define CU_STREAM_NON_BLOCKING 0x1

struct CUctx_st {
  int device;
};

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_WAIT_STREAM };

typedef struct Op {
  int kind;
  void* dst;
  const void* src;
  size_t bytes;
  struct CUevent_st* event;
  struct CUstream_st* stream;  // OP_WAIT_STREAM: until this stream has completed `seq` ops
  uint64_t seq;
  struct Op* next;
} Op;

struct CUstream_st {
  int destroyed;
  int is_default;
  unsigned flags;
  struct CUctx_st* ctx;  // the context it belongs to
  uint64_t enqueued;     // ops queued so far
  uint64_t done;         // ops completed so far
  Op* head;  // the op being executed stays at the head until it is done
  Op* tail;
  pthread_t thread;
  int started;
  struct CUstream_st* next_stream;
};

struct CUevent_st {
  int destroyed;
  unsigned flags;
  struct CUctx_st* ctx;  // the context it belongs to
  uint64_t recorded;   // how many times it was recorded
  uint64_t completed;  // the latest record a stream has reached
  struct CUevent_st* next_event;
};

typedef struct Alloc {
  unsigned char* p;
  size_t bytes;
  int freed;
  pid_t pid;
  struct Alloc* next;
} Alloc;

/* Everything below is protected by g_mu; g_cv is broadcast on every state change. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pid_t g_init_pid = 0;
static int g_devices = 1;
static struct CUctx_st g_primary[MAX_DEVICES] = {{0}, {1}, {2}, {3}};
static long g_retained_dev[MAX_DEVICES];
static long g_retained = 0;  // over all devices
static struct CUstream_st* g_streams = NULL;
static struct CUstream_st* g_default[MAX_DEVICES];
static struct CUevent_st* g_events = NULL;
static Alloc* g_allocs = NULL;
static long g_copy_delay_us = -1;
static long g_fail_copies = 0;  // the next n cuMemcpyHtoDAsync_v2 calls fail with g_fail_code
static CUresult g_fail_code = 0;
static long g_fail_pushes = 0;  // the next n cuCtxPushCurrent_v2 calls off g_fail_push_thread fail
static CUresult g_fail_push_code = 0;
static pthread_t g_fail_push_thread;

static struct {
  long calls, inits, retains, releases, bad_releases, pushes, pops, bad_pops, no_ctx_calls;
  long allocs, allocs_live, alloc_bytes_live, frees, bad_frees, free_while_pending;
  long streams_created, streams_live, events_created, events_live, bad_handles;
  long copies, copied_bytes, copies_from_pinned, copies_from_pageable, copies_from_freed;
  long queued_from_freed, records, waits, event_syncs, stream_syncs, other_pid_calls;
  long foreign_handles, legacy_waits, host_syncs, host_syncs_busy, host_sync_us;
} S;
static char g_errors[MAX_ERRORS][200];
static int g_nerrors = 0;
static char g_no_ctx_names[512];

static __thread struct CUctx_st* t_stack[MAX_STACK];
static __thread int t_depth = 0;

/* --- helpers (callers hold g_mu unless said otherwise) ---------------------------------- */

static void record_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void record_error(const char* fmt, ...) {
  if (g_nerrors >= MAX_ERRORS) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_errors[g_nerrors], sizeof g_errors[0], fmt, ap);
  va_end(ap);
  for (char* c = g_errors[g_nerrors]; *c; ++c)
    if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = '?';
  g_nerrors++;
}

/* Lock-free, for a forked child: the parent's threads may have held g_mu at fork time. */
static void log_other_pid(const char* fn) {
  const char* path = getenv("FAKE_CUDA_LOG");
  if (!path || !*path) return;
  char line[160];
  int n = snprintf(line, sizeof line, "%d %s\n", (int)getpid(), fn);
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t w = write(fd, line, (size_t)n);
  (void)w;
  close(fd);
}

/* The first check of every entry point. Nonzero: return that status. Does not lock. */
static CUresult foreign_process(const char* fn) {
  pid_t init = __atomic_load_n(&g_init_pid, __ATOMIC_ACQUIRE);
  if (init != 0 && getpid() != init) {
    log_other_pid(fn);
    return CUDA_ERROR_NOT_INITIALIZED;
  }
  return CUDA_SUCCESS;
}

#define ENTER(fn)                                \
  do {                                           \
    CUresult r_ = foreign_process(fn);           \
    if (r_ != CUDA_SUCCESS) return r_;           \
  } while (0)

/* Takes g_mu. A call that needs a current context on this thread. */
static CUresult lock_with_context(const char* fn) {
  pthread_mutex_lock(&g_mu);
  S.calls++;
  if (g_init_pid == 0) {
    record_error("%s before cuInit", fn);
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_NOT_INITIALIZED;
  }
  if (t_depth == 0) {
    S.no_ctx_calls++;
    record_error("%s called with no current context (thread %lu)", fn, (unsigned long)pthread_self());
    if (strlen(g_no_ctx_names) + strlen(fn) + 2 < sizeof g_no_ctx_names) {
      if (g_no_ctx_names[0]) strcat(g_no_ctx_names, " ");
      strcat(g_no_ctx_names, fn);
    }
    pthread_mutex_unlock(&g_mu);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  return CUDA_SUCCESS;
}

static Alloc* find_alloc(const void* p, size_t bytes) {
  const unsigned char* c = (const unsigned char*)p;
  for (Alloc* a = g_allocs; a; a = a->next)
    if (c >= a->p && c + bytes <= a->p + a->bytes && (bytes > 0 || c < a->p + a->bytes)) return a;
  return NULL;
}

static int overlaps(const Alloc* a, const void* p, size_t bytes) {
  const unsigned char* c = (const unsigned char*)p;
  return c < a->p + a->bytes && c + bytes > a->p;
}

static long copy_delay_us(void) {
  if (g_copy_delay_us < 0) {
    const char* e = getenv("FAKE_CUDA_COPY_DELAY_US");
    g_copy_delay_us = e ? atol(e) : 300;
  }
  return g_copy_delay_us;
}

static void* stream_main(void* arg);

static void start_stream(struct CUstream_st* s) {
  s->next_stream = g_streams;
  g_streams = s;
  if (pthread_create(&s->thread, NULL, stream_main, s) == 0) {
    s->started = 1;
    pthread_detach(s->thread);
  }
}

static struct CUctx_st* current_ctx(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

static struct CUstream_st* default_stream(struct CUctx_st* ctx) {
  int d = ctx ? ctx->device : 0;
  if (!g_default[d]) {
    g_default[d] = (struct CUstream_st*)calloc(1, sizeof *g_default[d]);
    g_default[d]->is_default = 1;
    g_default[d]->ctx = &g_primary[d];
    start_stream(g_default[d]);
  }
  return g_default[d];
}

/* The stream a handle names, or NULL for a bad handle. 0, 1 (legacy), 2 (per-thread): the
 * current context's default stream. With `same_ctx`, a stream of another context than the
 * current one is rejected (the driver's CUDA_ERROR_INVALID_HANDLE). */
static struct CUstream_st* get_stream_in(struct CUstream_st* h, const char* fn, int same_ctx) {
  if ((uintptr_t)h <= 2) return default_stream(current_ctx());
  for (struct CUstream_st* s = g_streams; s; s = s->next_stream)
    if (s == h && !s->destroyed && !s->is_default) {
      if (same_ctx && s->ctx != current_ctx()) {
        S.bad_handles++;
        S.foreign_handles++;
        record_error("%s: stream %p belongs to device %d's context, not the current one (device %d)", fn, (void*)h,
                     s->ctx->device, current_ctx() ? current_ctx()->device : -1);
        return NULL;
      }
      return s;
    }
  S.bad_handles++;
  record_error("%s: invalid or destroyed stream %p", fn, (void*)h);
  return NULL;
}

static struct CUstream_st* get_stream(struct CUstream_st* h, const char* fn) { return get_stream_in(h, fn, 1); }

static struct CUevent_st* get_event(struct CUevent_st* h, const char* fn) {
  for (struct CUevent_st* e = g_events; e; e = e->next_event)
    if (e == h && !e->destroyed) return e;
  S.bad_handles++;
  record_error("%s: invalid or destroyed event %p", fn, (void*)h);
  return NULL;
}

static void push_op(struct CUstream_st* s, Op* op) {
  op->next = NULL;
  if (s->tail)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  s->enqueued++;
}

/* Queues an implicit wait on `s` for everything queued on `other` so far. */
static void wait_for_stream(struct CUstream_st* s, struct CUstream_st* other) {
  if (other->done >= other->enqueued) return;
  Op* w = (Op*)calloc(1, sizeof *w);
  w->kind = OP_WAIT_STREAM;
  w->stream = other;
  w->seq = other->enqueued;
  push_op(s, w);
  S.legacy_waits++;
}

/* Queues op on s, after the implicit waits of the legacy default stream's semantics. */
static void enqueue(struct CUstream_st* s, Op* op) {
  if (s->is_default) {
    for (struct CUstream_st* b = g_streams; b; b = b->next_stream)
      if (!b->is_default && !b->destroyed && b->ctx == s->ctx && !(b->flags & CU_STREAM_NON_BLOCKING))
        wait_for_stream(s, b);
  } else if (!(s->flags & CU_STREAM_NON_BLOCKING)) {
    wait_for_stream(s, default_stream(s->ctx));
  }
  push_op(s, op);
  pthread_cond_broadcast(&g_cv);
}

static long queued(const struct CUstream_st* s) {
  long n = 0;
  for (const Op* o = s->head; o; o = o->next) n++;
  return n;
}

static void* stream_main(void* arg) {
  struct CUstream_st* s = (struct CUstream_st*)arg;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (!s->head && !s->destroyed) pthread_cond_wait(&g_cv, &g_mu);
    if (!s->head) break;  // destroyed and drained
    Op* op = s->head;
    if (op->kind == OP_WAIT) {
      while (op->event->completed < op->seq) pthread_cond_wait(&g_cv, &g_mu);
    } else if (op->kind == OP_WAIT_STREAM) {
      while (op->stream->done < op->seq) pthread_cond_wait(&g_cv, &g_mu);
    } else if (op->kind == OP_RECORD) {
      if (op->event->completed < op->seq) op->event->completed = op->seq;
      S.records++;
    } else {
      long us = copy_delay_us();
      pthread_mutex_unlock(&g_mu);
      if (us > 0) {
        struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
        nanosleep(&ts, NULL);
      }
      pthread_mutex_lock(&g_mu);
      /* Checked and copied under the lock: cuMemFreeHost cannot interleave. */
      Alloc* a = find_alloc(op->src, op->bytes);
      if (a && a->freed) {
        S.copies_from_freed++;
        record_error("a copy of %zu bytes read host memory %p after cuMemFreeHost", op->bytes, op->src);
      } else if (a) {
        S.copies_from_pinned++;
      } else {
        S.copies_from_pageable++;
      }
      if (op->bytes) memcpy(op->dst, op->src, op->bytes);
      S.copies++;
      S.copied_bytes += (long)op->bytes;
    }
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    s->done++;
    free(op);
    pthread_cond_broadcast(&g_cv);
  }
  pthread_mutex_unlock(&g_mu);
  return NULL;
}

/* --- initialisation, devices, contexts ----------------------------------------------------- */

EXPORT CUresult cuInit(unsigned flags) {
  ENTER("cuInit");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  S.inits++;
  if (g_init_pid == 0) {
    const char* n = getenv("FAKE_CUDA_DEVICES");
    g_devices = n ? atoi(n) : 1;
    if (g_devices < 1) g_devices = 1;
    if (g_devices > MAX_DEVICES) g_devices = MAX_DEVICES;
    __atomic_store_n(&g_init_pid, getpid(), __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g_mu);
  return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuDeviceGetCount(int* count) {
  ENTER("cuDeviceGetCount");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = g_init_pid ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
  if (r == CUDA_SUCCESS) {
    if (count)
      *count = g_devices;
    else
      r = CUDA_ERROR_INVALID_VALUE;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  ENTER("cuDeviceGet");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = !g_init_pid ? CUDA_ERROR_NOT_INITIALIZED : !dev ? CUDA_ERROR_INVALID_VALUE
                                                         : ordinal < 0 || ordinal >= g_devices ? CUDA_ERROR_INVALID_DEVICE
                                                                                               : CUDA_SUCCESS;
  if (r == CUDA_SUCCESS) *dev = ordinal;
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(struct CUctx_st** ctx, CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRetain");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = !g_init_pid ? CUDA_ERROR_NOT_INITIALIZED : !ctx ? CUDA_ERROR_INVALID_VALUE
                                                         : dev < 0 || dev >= g_devices ? CUDA_ERROR_INVALID_DEVICE
                                                                                       : CUDA_SUCCESS;
  if (r == CUDA_SUCCESS) {
    *ctx = &g_primary[dev];
    g_retained_dev[dev]++;
    g_retained++;
    S.retains++;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  ENTER("cuDevicePrimaryCtxRelease_v2");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = !g_init_pid                      ? CUDA_ERROR_NOT_INITIALIZED
               : dev < 0 || dev >= g_devices ? CUDA_ERROR_INVALID_DEVICE
                                             : CUDA_SUCCESS;
  if (r == CUDA_SUCCESS) {
    if (g_retained_dev[dev] <= 0) {
      S.bad_releases++;
      record_error("cuDevicePrimaryCtxRelease of a primary context that is not retained");
      r = CUDA_ERROR_INVALID_CONTEXT;
    } else {
      g_retained_dev[dev]--;
      g_retained--;
      S.releases++;
    }
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuCtxPushCurrent_v2(struct CUctx_st* ctx) {
  ENTER("cuCtxPushCurrent_v2");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = CUDA_SUCCESS;
  if (!g_init_pid) {
    r = CUDA_ERROR_NOT_INITIALIZED;
  } else if (!ctx || ctx < &g_primary[0] || ctx >= &g_primary[g_devices]) {
    record_error("cuCtxPushCurrent of an unknown context %p", (void*)ctx);
    r = CUDA_ERROR_INVALID_CONTEXT;
  } else if (g_retained_dev[ctx->device] <= 0) {
    record_error("cuCtxPushCurrent of a primary context nobody retains");
    r = CUDA_ERROR_INVALID_CONTEXT;
  } else if (g_fail_pushes > 0 && !pthread_equal(pthread_self(), g_fail_push_thread)) {
    g_fail_pushes--;
    r = g_fail_push_code;  // injected by the test
  } else if (t_depth >= MAX_STACK) {
    record_error("context stack overflow (%d pushes without pop)", t_depth);
    r = CUDA_ERROR_UNKNOWN;
  } else {
    t_stack[t_depth++] = ctx;
    S.pushes++;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuCtxPopCurrent_v2(struct CUctx_st** ctx) {
  ENTER("cuCtxPopCurrent_v2");
  pthread_mutex_lock(&g_mu);
  S.calls++;
  CUresult r = CUDA_SUCCESS;
  if (!g_init_pid) {
    r = CUDA_ERROR_NOT_INITIALIZED;
  } else if (t_depth == 0) {
    S.bad_pops++;
    record_error("cuCtxPopCurrent with no current context");
    r = CUDA_ERROR_INVALID_CONTEXT;
  } else {
    struct CUctx_st* c = t_stack[--t_depth];
    if (ctx) *ctx = c;
    S.pops++;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* --- host memory --------------------------------------------------------------------------- */

/* The implicit device synchronisation of cuMemHostAlloc and cuMemFreeHost: waits (releasing
 * g_mu) until every stream of every context has drained. */
static void synchronise_device(void) {
  S.host_syncs++;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int busy = 0;
  for (;;) {
    int pending = 0;
    for (struct CUstream_st* s = g_streams; s; s = s->next_stream)
      if (s->head) pending = 1;
    if (!pending) break;
    busy = 1;
    pthread_cond_wait(&g_cv, &g_mu);
  }
  if (busy) {
    S.host_syncs_busy++;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    S.host_sync_us += (t1.tv_sec - t0.tv_sec) * 1000000L + (t1.tv_nsec - t0.tv_nsec) / 1000;
  }
}

EXPORT CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned flags) {
  ENTER("cuMemHostAlloc");
  CUresult r = lock_with_context("cuMemHostAlloc");
  if (r != CUDA_SUCCESS) return r;
  (void)flags;
  void* p = NULL;
  if (pp && bytes) synchronise_device();
  if (!pp || bytes == 0) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else if ((p = mmap(NULL, (bytes + 4095) / 4096 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0)) == MAP_FAILED) {
    p = NULL;
    r = CUDA_ERROR_OUT_OF_MEMORY;
  } else {
    // Not inherited by a forked child, as the driver's pinned memory.
    (void)madvise(p, (bytes + 4095) / 4096 * 4096, MADV_DONTFORK);
    Alloc* a = (Alloc*)calloc(1, sizeof *a);
    a->p = (unsigned char*)p;
    a->bytes = bytes;
    a->pid = getpid();
    a->next = g_allocs;
    g_allocs = a;
    S.allocs++;
    S.allocs_live++;
    S.alloc_bytes_live += (long)bytes;
    *pp = p;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuMemFreeHost(void* p) {
  ENTER("cuMemFreeHost");
  CUresult r = lock_with_context("cuMemFreeHost");
  if (r != CUDA_SUCCESS) return r;
  Alloc* a = NULL;
  for (Alloc* x = g_allocs; x; x = x->next)
    if (x->p == (unsigned char*)p) a = x;
  if (a && !a->freed) synchronise_device();
  if (!a || a->freed) {
    S.bad_frees++;
    record_error("cuMemFreeHost(%p): %s", p, a ? "double free" : "not an allocation of cuMemHostAlloc");
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    for (struct CUstream_st* s = g_streams; s; s = s->next_stream)
      for (Op* o = s->head; o; o = o->next)
        if (o->kind == OP_COPY && overlaps(a, o->src, o->bytes)) {
          S.free_while_pending++;
          record_error("cuMemFreeHost(%p) while a queued copy still reads it", p);
        }
    memset(a->p, 0xDB, a->bytes);  // poisoned and kept mapped: late readers see garbage, not a crash
    a->freed = 1;
    S.frees++;
    S.allocs_live--;
    S.alloc_bytes_live -= (long)a->bytes;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* --- streams and events ---------------------------------------------------------------- */

EXPORT CUresult cuStreamCreate(struct CUstream_st** out, unsigned flags) {
  ENTER("cuStreamCreate");
  CUresult r = lock_with_context("cuStreamCreate");
  if (r != CUDA_SUCCESS) return r;
  if (!out) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    struct CUstream_st* s = (struct CUstream_st*)calloc(1, sizeof *s);
    s->flags = flags;
    s->ctx = current_ctx();
    start_stream(s);
    S.streams_created++;
    S.streams_live++;
    *out = s;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuStreamDestroy_v2(struct CUstream_st* h) {
  ENTER("cuStreamDestroy_v2");
  CUresult r = lock_with_context("cuStreamDestroy_v2");
  if (r != CUDA_SUCCESS) return r;
  struct CUstream_st* s = (uintptr_t)h <= 2 ? NULL : get_stream_in(h, "cuStreamDestroy_v2", 0);
  if (!s) {
    if ((uintptr_t)h <= 2) record_error("cuStreamDestroy of the default stream");
    r = CUDA_ERROR_INVALID_HANDLE;
  } else {
    // As the driver: returns at once; queued work still completes, then the worker exits.
    // The struct is never freed, so a late use of the handle is detected, not a crash.
    s->destroyed = 1;
    S.streams_live--;
    pthread_cond_broadcast(&g_cv);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuStreamSynchronize(struct CUstream_st* h) {
  ENTER("cuStreamSynchronize");
  CUresult r = lock_with_context("cuStreamSynchronize");
  if (r != CUDA_SUCCESS) return r;
  struct CUstream_st* s = get_stream_in(h, "cuStreamSynchronize", 0);
  if (!s) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else {
    S.stream_syncs++;
    while (s->head) pthread_cond_wait(&g_cv, &g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuEventCreate(struct CUevent_st** out, unsigned flags) {
  ENTER("cuEventCreate");
  CUresult r = lock_with_context("cuEventCreate");
  if (r != CUDA_SUCCESS) return r;
  if (!out) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    struct CUevent_st* e = (struct CUevent_st*)calloc(1, sizeof *e);
    e->flags = flags;
    e->ctx = current_ctx();
    e->next_event = g_events;
    g_events = e;
    S.events_created++;
    S.events_live++;
    *out = e;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuEventDestroy_v2(struct CUevent_st* h) {
  ENTER("cuEventDestroy_v2");
  CUresult r = lock_with_context("cuEventDestroy_v2");
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st* e = get_event(h, "cuEventDestroy_v2");
  if (!e) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else {
    e->destroyed = 1;  // kept: queued records and waits may still name it
    S.events_live--;
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuEventRecord(struct CUevent_st* h, struct CUstream_st* sh) {
  ENTER("cuEventRecord");
  CUresult r = lock_with_context("cuEventRecord");
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st* e = get_event(h, "cuEventRecord");
  struct CUstream_st* s = e ? get_stream(sh, "cuEventRecord") : NULL;
  if (e && s && e->ctx != s->ctx) {
    S.bad_handles++;
    S.foreign_handles++;
    record_error("cuEventRecord: event %p of device %d's context on a stream of device %d's", (void*)e,
                 e->ctx ? e->ctx->device : -1, s->ctx ? s->ctx->device : -1);
    s = NULL;
  }
  if (!e || !s) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else {
    Op* op = (Op*)calloc(1, sizeof *op);
    op->kind = OP_RECORD;
    op->event = e;
    op->seq = ++e->recorded;
    enqueue(s, op);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuEventSynchronize(struct CUevent_st* h) {
  ENTER("cuEventSynchronize");
  CUresult r = lock_with_context("cuEventSynchronize");
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st* e = get_event(h, "cuEventSynchronize");
  if (!e) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else {
    S.event_syncs++;
    const uint64_t target = e->recorded;  // never recorded: returns at once, as the driver
    while (e->completed < target) pthread_cond_wait(&g_cv, &g_mu);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuStreamWaitEvent(struct CUstream_st* sh, struct CUevent_st* h, unsigned flags) {
  ENTER("cuStreamWaitEvent");
  CUresult r = lock_with_context("cuStreamWaitEvent");
  if (r != CUDA_SUCCESS) return r;
  struct CUevent_st* e = get_event(h, "cuStreamWaitEvent");
  struct CUstream_st* s = e ? get_stream(sh, "cuStreamWaitEvent") : NULL;
  if (!e || !s) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else if (flags != 0) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    S.waits++;
    if (e->completed < e->recorded) {  // the latest record at call time
      Op* op = (Op*)calloc(1, sizeof *op);
      op->kind = OP_WAIT;
      op->event = e;
      op->seq = e->recorded;
      enqueue(s, op);
    }
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t bytes, struct CUstream_st* sh) {
  ENTER("cuMemcpyHtoDAsync_v2");
  CUresult r = lock_with_context("cuMemcpyHtoDAsync_v2");
  if (r != CUDA_SUCCESS) return r;
  struct CUstream_st* s = get_stream(sh, "cuMemcpyHtoDAsync_v2");
  if (!s) {
    r = CUDA_ERROR_INVALID_HANDLE;
  } else if ((!dst || !src) && bytes) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else if (g_fail_copies > 0) {
    g_fail_copies--;
    r = g_fail_code;  // injected by the test
  } else {
    Alloc* a = find_alloc(src, bytes);
    if (a && a->freed) {
      S.queued_from_freed++;
      record_error("cuMemcpyHtoDAsync from %p, which was freed with cuMemFreeHost", src);
    }
    Op* op = (Op*)calloc(1, sizeof *op);
    op->kind = OP_COPY;
    op->dst = (void*)(uintptr_t)dst;
    op->src = src;
    op->bytes = bytes;
    enqueue(s, op);
  }
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* --- error strings --------------------------------------------------------------------- */

static const char* error_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
  }
}

EXPORT CUresult cuGetErrorName(CUresult r, const char** s) {
  ENTER("cuGetErrorName");
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  *s = error_name(r);
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char** s) {
  ENTER("cuGetErrorString");
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  *s = error_name(r) ? "fake_cuda error" : NULL;
  return *s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* --- test hooks ------------------------------------------------------------------------ */

EXPORT const char* fake_cuda_stats(void) {
  static char buf[16384];
  pthread_mutex_lock(&g_mu);
  long pending = 0, pending_default = 0;
  for (struct CUstream_st* s = g_streams; s; s = s->next_stream) {
    if (s->is_default)
      pending_default += queued(s);
    else
      pending += queued(s);
  }
  int n = snprintf(
      buf, sizeof buf,
      "{\"pid\": %d, \"init_pid\": %d, \"calls\": %ld, \"inits\": %ld, \"retained\": %ld, \"retains\": %ld, "
      "\"releases\": %ld, \"bad_releases\": %ld, \"pushes\": %ld, \"pops\": %ld, \"bad_pops\": %ld, "
      "\"no_ctx_calls\": %ld, \"no_ctx_functions\": \"%s\", \"allocs\": %ld, \"allocs_live\": %ld, "
      "\"alloc_bytes_live\": %ld, \"frees\": %ld, \"bad_frees\": %ld, \"free_while_pending\": %ld, "
      "\"streams_created\": %ld, \"streams_live\": %ld, \"events_created\": %ld, \"events_live\": %ld, "
      "\"bad_handles\": %ld, \"copies\": %ld, \"copied_bytes\": %ld, \"copies_from_pinned\": %ld, "
      "\"copies_from_pageable\": %ld, \"copies_from_freed\": %ld, \"queued_from_freed\": %ld, "
      "\"records\": %ld, \"waits\": %ld, \"event_syncs\": %ld, \"stream_syncs\": %ld, "
      "\"pending\": %ld, \"pending_default\": %ld, \"foreign_handles\": %ld, \"legacy_waits\": %ld, "
      "\"host_syncs\": %ld, \"host_syncs_busy\": %ld, \"host_sync_us\": %ld, \"errors\": [",
      (int)getpid(), (int)g_init_pid, S.calls, S.inits, g_retained, S.retains, S.releases, S.bad_releases,
      S.pushes, S.pops, S.bad_pops, S.no_ctx_calls, g_no_ctx_names, S.allocs, S.allocs_live, S.alloc_bytes_live,
      S.frees, S.bad_frees, S.free_while_pending, S.streams_created, S.streams_live, S.events_created,
      S.events_live, S.bad_handles, S.copies, S.copied_bytes, S.copies_from_pinned, S.copies_from_pageable,
      S.copies_from_freed, S.queued_from_freed, S.records, S.waits, S.event_syncs, S.stream_syncs, pending,
      pending_default, S.foreign_handles, S.legacy_waits, S.host_syncs, S.host_syncs_busy, S.host_sync_us);
  for (int i = 0; i < g_nerrors && n < (int)sizeof buf - 256; ++i)
    n += snprintf(buf + n, sizeof buf - (size_t)n, "%s\"%s\"", i ? ", " : "", g_errors[i]);
  snprintf(buf + n, sizeof buf - (size_t)n, "]}");
  pthread_mutex_unlock(&g_mu);
  return buf;
}

EXPORT int fake_cuda_ctx_depth(void) { return t_depth; }

/* 1: p lies in a live cuMemHostAlloc allocation, 2: in a freed one, 0: neither. */
EXPORT int fake_cuda_is_pinned(const void* p) {
  pthread_mutex_lock(&g_mu);
  Alloc* a = find_alloc(p, 0);
  int r = !a ? 0 : a->freed ? 2 : 1;
  pthread_mutex_unlock(&g_mu);
  return r;
}

/* Ops queued (or executing) on the created streams, plus the default stream's if asked. */
EXPORT long fake_cuda_pending(int include_default) {
  long n = 0;
  pthread_mutex_lock(&g_mu);
  for (struct CUstream_st* s = g_streams; s; s = s->next_stream)
    if (!s->is_default || include_default) n += queued(s);
  pthread_mutex_unlock(&g_mu);
  return n;
}

EXPORT void fake_cuda_set_copy_delay_us(long us) {
  pthread_mutex_lock(&g_mu);
  g_copy_delay_us = us;
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fake_cuda_fail_copies(long n, int code) {
  pthread_mutex_lock(&g_mu);
  g_fail_copies = n;
  g_fail_code = code;
  pthread_mutex_unlock(&g_mu);
}

EXPORT void fake_cuda_fail_pushes_elsewhere(long n, int code) {
  pthread_mutex_lock(&g_mu);
  g_fail_pushes = n;
  g_fail_push_code = code;
  g_fail_push_thread = pthread_self();
  pthread_mutex_unlock(&g_mu);
}

EXPORT int fake_cuda_stream_flags(struct CUstream_st* h) {
  int r = -1;
  pthread_mutex_lock(&g_mu);
  for (struct CUstream_st* s = g_streams; s; s = s->next_stream)
    if (s == h && !s->destroyed && !s->is_default) r = (int)s->flags;
  pthread_mutex_unlock(&g_mu);
  return r;
}
