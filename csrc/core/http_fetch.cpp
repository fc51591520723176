#include "core/http_fetch.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "core/clock.h"
#include "core/dynamic_library.h"
#include "core/xxh64.h"

namespace pyloader {
namespace http {
namespace {

// libcurl's C API, declared from its documented signatures (See NOTE [native transport]).
using CURL = void;
using CURLM = void;
using CURLcode = int;
using CURLMcode = int;
struct curl_slist;
struct CURLMsg {
  int msg;
  CURL* easy_handle;
  union {
    void* whatever;
    CURLcode result;
  } data;
};
constexpr int kMsgDone = 1;  // CURLMSG_DONE
constexpr long kGlobalDefault = 3;
constexpr int kErrorSize = 256;  // CURL_ERROR_SIZE
constexpr int kOk = 0;

// Option numbers (type base + index, as curl.h computes them).
constexpr int kOptWriteData = 10001, kOptUrl = 10002, kOptRange = 10007, kOptErrorBuffer = 10010;
constexpr int kOptUserAgent = 10018, kOptHttpHeader = 10023, kOptHeaderData = 10029, kOptCaInfo = 10065;
constexpr int kOptWriteFunction = 20011, kOptHeaderFunction = 20079;
constexpr int kOptLowSpeedLimit = 19, kOptLowSpeedTime = 20, kOptFollowLocation = 52;
constexpr int kOptHttpGet = 80, kOptBufferSize = 98, kOptNoSignal = 99, kOptConnectTimeoutMs = 156;
constexpr int kOptProtocols = 181, kOptRedirProtocols = 182, kOptTcpKeepAlive = 213;
constexpr int kOptSuppressConnectHeaders = 265;
constexpr long kProtoHttp = 1, kProtoHttps = 2;
constexpr int kInfoResponseCode = 0x200000 + 2;
constexpr int kInfoRedirectUrl = 0x100000 + 31;  // CURLINFO_REDIRECT_URL: where a 3xx would lead

struct Api {
  CURLcode (*global_init)(long);
  CURL* (*easy_init)();
  void (*easy_cleanup)(CURL*);
  void (*easy_reset)(CURL*);
  CURLcode (*easy_setopt)(CURL*, int, ...);
  CURLcode (*easy_getinfo)(CURL*, int, ...);
  const char* (*easy_strerror)(CURLcode);
  curl_slist* (*slist_append)(curl_slist*, const char*);
  void (*slist_free_all)(curl_slist*);
  CURLM* (*multi_init)();
  CURLMcode (*multi_add_handle)(CURLM*, CURL*);
  CURLMcode (*multi_remove_handle)(CURLM*, CURL*);
  CURLMcode (*multi_perform)(CURLM*, int*);
  CURLMcode (*multi_poll)(CURLM*, void*, unsigned, int, int*);
  CURLMsg* (*multi_info_read)(CURLM*, int*);
  CURLMcode (*multi_cleanup)(CURLM*);
  const char* (*multi_strerror)(CURLMcode);
  char* (*version)();
};

struct Loaded {
  Api api{};
  bool ok = false;
  std::string why;
};

Loaded load() {
  Loaded l;
  // RTLD_NODELETE: the library stays mapped at exit, for the threads' handles' destructors.
  void* lib = ::dlopen("libcurl.so.4", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) {
    const char* e = ::dlerror();
    l.why = std::string("cannot load libcurl.so.4: ") + (e ? e : "unknown error");
    return l;
  }
  Api& a = l.api;
  const SymbolResolver resolve(lib, "libcurl.so.4", &l.why, " (libcurl 7.66 or newer is needed)");
  bool ok = resolve("curl_global_init", &a.global_init) && resolve("curl_easy_init", &a.easy_init) &&
            resolve("curl_easy_cleanup", &a.easy_cleanup) && resolve("curl_easy_reset", &a.easy_reset) &&
            resolve("curl_easy_setopt", &a.easy_setopt) && resolve("curl_easy_getinfo", &a.easy_getinfo) &&
            resolve("curl_easy_strerror", &a.easy_strerror) && resolve("curl_slist_append", &a.slist_append) &&
            resolve("curl_slist_free_all", &a.slist_free_all) && resolve("curl_multi_init", &a.multi_init) &&
            resolve("curl_multi_add_handle", &a.multi_add_handle) &&
            resolve("curl_multi_remove_handle", &a.multi_remove_handle) &&
            resolve("curl_multi_perform", &a.multi_perform) && resolve("curl_multi_poll", &a.multi_poll) &&
            resolve("curl_multi_info_read", &a.multi_info_read) && resolve("curl_multi_cleanup", &a.multi_cleanup) &&
            resolve("curl_multi_strerror", &a.multi_strerror) && resolve("curl_version", &a.version);
  if (!ok) return l;
  if (a.global_init(kGlobalDefault) != kOk) {
    l.why = "curl_global_init failed";
    return l;
  }
  l.ok = true;
  return l;
}

const Loaded& loaded() {
  static Loaded* l = new Loaded(load());  // leaked: usable by the threads' destructors at exit
  return *l;
}

// A thread's handles (See NOTE [native transport]): its multi handle keeps the connections
// for the next download on this thread.
struct Session {
  CURLM* multi = nullptr;
  std::vector<CURL*> idle;
  std::vector<std::vector<char>> buffers;
  pid_t pid = ::getpid();

  ~Session() {
    if (pid != ::getpid()) return;  // a forked child: the sockets are the parent's
    const Api& a = loaded().api;
    for (CURL* e : idle) a.easy_cleanup(e);
    if (multi) a.multi_cleanup(multi);
  }
};

Session& session() {
  thread_local std::unique_ptr<Session> s;
  if (s && s->pid != ::getpid()) {
    (void)s.release();  // See NOTE [native transport]: never close the parent's connections
  }
  if (!s) {
    s = std::make_unique<Session>();
    s->multi = loaded().api.multi_init();
    if (!s->multi) throw std::runtime_error("curl_multi_init failed");
  }
  return *s;
}

bool iequal_prefix(const char* p, size_t n, const char* name, size_t* value_at) {
  size_t k = std::strlen(name);
  if (n <= k || p[k] != ':') return false;
  for (size_t i = 0; i < k; ++i)
    if (std::tolower(static_cast<unsigned char>(p[i])) != name[i]) return false;
  size_t v = k + 1;
  while (v < n && (p[v] == ' ' || p[v] == '\t')) ++v;
  *value_at = v;
  return true;
}

// A decimal number of at most 18 digits at s (hostile input: no overflow); -1 if none.
int64_t parse_u63(const char* s, size_t n, size_t* used) {
  int64_t v = 0;
  size_t i = 0;
  while (i < n && i < 18 && s[i] >= '0' && s[i] <= '9') v = v * 10 + (s[i++] - '0');
  if (used) *used = i;
  return i == 0 || (i < n && s[i] >= '0' && s[i] <= '9') ? -1 : v;
}

// An absolute http(s) URL's scheme and origin ("https", "https://host:443"): lower case, the
// user info left out, the default port made explicit; false for anything else.
bool origin_of(const std::string& url, std::string* scheme, std::string* origin) {
  size_t colon = url.find("://");
  if (colon == std::string::npos) return false;
  std::string sch = url.substr(0, colon);
  for (char& c : sch) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (sch != "http" && sch != "https") return false;
  size_t start = colon + 3;
  size_t end = url.find_first_of("/?#", start);
  std::string auth = url.substr(start, end == std::string::npos ? std::string::npos : end - start);
  size_t at = auth.rfind('@');
  if (at != std::string::npos) auth = auth.substr(at + 1);
  for (char& c : auth) c = char(std::tolower(static_cast<unsigned char>(c)));
  size_t close = auth.rfind(']');
  size_t port_colon = auth.rfind(':');
  bool has_port = port_colon != std::string::npos && (close == std::string::npos || port_colon > close);
  std::string host = has_port ? auth.substr(0, port_colon) : auth;
  std::string port = has_port ? auth.substr(port_colon + 1) : std::string();
  if (host.empty()) return false;
  if (port.empty()) port = sch == "https" ? "443" : "80";
  *scheme = sch;
  *origin = sch + "://" + host + ":" + port;
  return true;
}

bool is_redirect(int status) {
  return status == 301 || status == 302 || status == 303 || status == 307 || status == 308;
}

std::string trimmed(const char* p, size_t n) {
  while (n && (p[n - 1] == '\r' || p[n - 1] == '\n' || p[n - 1] == ' ')) --n;
  return std::string(p, std::min<size_t>(n, 256));
}

}  // namespace

bool available(std::string* why) {
  const Loaded& l = loaded();
  if (!l.ok && why) *why = l.why;
  return l.ok;
}

std::string version() {
  const Loaded& l = loaded();
  return l.ok ? std::string(l.api.version()) : std::string();
}

struct Download::Impl {
  struct PartState {
    Impl* owner = nullptr;
    PartResult* res = nullptr;
    CURL* easy = nullptr;
    uint64_t offset = 0, expect = 0;  // where the body goes and how long it must be
    bool ranged = false, checked = false, ended = false, added = false;
    bool headers_dropped = false;  // redirected to another origin: the caller's headers stay home
    uint64_t last_byte_ns = 0;     // when the server last sent anything (See NOTE [stall])
    std::vector<char>* buf = nullptr;
    size_t fill = 0;
    std::string range;
    std::string url;  // where the request now goes (the first URL, or where a redirect led)
    Xxh64Stream hash;
    char errbuf[kErrorSize] = {0};
  };

  const Api& a = loaded().api;
  Session& s = session();
  Request req;
  std::vector<PartState> parts;
  curl_slist* headers = nullptr;
  uint64_t unreported = 0;

  bool flush(PartState& p) {
    size_t done = 0;
    while (done < p.fill) {
      ssize_t n = ::pwrite(req.fd, p.buf->data() + done, p.fill - done, off_t(p.offset + p.res->written + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        p.res->write_errno = n < 0 ? errno : EIO;
        return false;
      }
      done += size_t(n);
    }
    p.res->written += p.fill;
    unreported += p.fill;
    p.fill = 0;
    return true;
  }

  // The checks made once the final response's headers are in (See NOTE [native transport]).
  static bool check_headers(PartState& p, const Request& req) {
    PartResult& r = *p.res;
    p.checked = true;
    if (r.status < 200 || r.status > 299) return true;  // its body is kept as the error's text
    if (p.ranged) {
      if (r.status != 206) {
        r.wrong_kind = kWrongRange;
        r.wrong = "answered " + std::to_string(r.status) + " to a ranged request";
        return false;
      }
      if (r.range_total >= 0 && uint64_t(r.range_total) != req.size) {
        r.wrong_kind = kWrongObject;
        r.wrong = "the object is " + std::to_string(r.range_total) + " bytes";
        return false;
      }
    } else if (r.status != 200) {
      r.wrong_kind = kWrongObject;
      r.wrong = "answered " + std::to_string(r.status) + " to a request for the whole object";
      return false;
    }
    if (r.content_length >= 0 && uint64_t(r.content_length) > p.expect) {
      r.wrong_kind = p.ranged ? kWrongRange : kWrongObject;
      r.wrong = "the body is " + std::to_string(r.content_length) + " bytes";
      return false;
    }
    return true;
  }

  static size_t on_header(char* data, size_t size, size_t n, void* user) {
    auto& p = *static_cast<PartState*>(user);
    PartResult& r = *p.res;
    size_t len = size * n;
    p.last_byte_ns = now_ns();
    size_t v = 0;
    if (len >= 5 && std::memcmp(data, "HTTP/", 5) == 0) {  // a new response (after a redirect or a 100)
      const char* sp = static_cast<const char*>(std::memchr(data, ' ', len));
      r.status = sp ? int(parse_u63(sp + 1, len - size_t(sp + 1 - data), nullptr)) : 0;
      r.content_length = r.range_total = -1;
      r.retry_after.clear();
      r.bucket_region.clear();
      p.checked = false;
    } else if (iequal_prefix(data, len, "content-length", &v)) {
      r.content_length = parse_u63(data + v, len - v, nullptr);
    } else if (iequal_prefix(data, len, "content-range", &v)) {
      const char* slash = static_cast<const char*>(std::memchr(data + v, '/', len - v));
      if (slash) r.range_total = parse_u63(slash + 1, len - size_t(slash + 1 - data), nullptr);
      // the start must be the offset asked for
      const char* sp = static_cast<const char*>(std::memchr(data + v, ' ', len - v));
      if (sp && p.ranged) {
        size_t used = 0;
        int64_t start = parse_u63(sp + 1, len - size_t(sp + 1 - data), &used);
        if (start != int64_t(p.offset)) r.range_total = -2;  // marks a wrong range
      }
    } else if (iequal_prefix(data, len, "retry-after", &v)) {
      r.retry_after = trimmed(data + v, len - v);
    } else if (iequal_prefix(data, len, "x-amz-bucket-region", &v)) {
      r.bucket_region = trimmed(data + v, len - v);
    } else if (len <= 2 && r.status >= 200 && r.status <= 299) {  // the end of a final response's headers
      if (r.range_total == -2) {
        r.wrong_kind = kWrongRange;
        r.wrong = "answered a range other than the one asked for";
        return 0;
      }
      if (!check_headers(p, p.owner->req)) return 0;  // aborts the transfer
    }
    return len;
  }

  static size_t on_body(char* data, size_t size, size_t n, void* user) {
    auto& p = *static_cast<PartState*>(user);
    PartResult& r = *p.res;
    size_t len = size * n;
    p.last_byte_ns = now_ns();
    if (r.status < 200 || r.status > 299) {
      if (r.error_body.size() >= 4096) return 0;  // enough to tell what it is
      r.error_body.append(data, std::min(len, 4096 - r.error_body.size()));
      return len;
    }
    if (!p.checked && !check_headers(p, p.owner->req)) return 0;
    if (r.written + p.fill + len > p.expect) {
      r.wrong_kind = p.ranged ? kWrongRange : kWrongObject;
      r.wrong = "the body is larger than " + std::to_string(p.expect) + " bytes";
      return 0;
    }
    while (len) {
      size_t k = std::min(len, p.buf->size() - p.fill);
      // A whole object's bytes are hashed as they are staged, while libcurl's piece is still
      // in cache: one read of it for both (the staged copy is not read back to hash it).
      if (p.ranged)
        std::memcpy(p.buf->data() + p.fill, data, k);
      else
        p.hash.update_copy(p.buf->data() + p.fill, data, k);
      p.fill += k;
      data += k;
      len -= k;
      if (p.fill == p.buf->size() && !p.owner->flush(p)) return 0;
    }
    return size * n;
  }

  // See NOTE [redirects]: a 3xx is followed here, one hop at a time, or refused.
  // True when the part was sent on to the redirect's target.
  bool follow(PartState& p) {
    PartResult& r = *p.res;
    char* next = nullptr;
    if (a.easy_getinfo(p.easy, kInfoRedirectUrl, &next) != kOk || next == nullptr) return false;
    std::string to(next);
    std::string from_scheme, from_origin, to_scheme, to_origin;
    origin_of(p.url, &from_scheme, &from_origin);
    r.wrong_kind = kWrongRedirect;
    if (!origin_of(to, &to_scheme, &to_origin)) {
      r.wrong = "redirected to a URL that is not http or https";
    } else if (from_scheme == "https" && to_scheme == "http") {
      r.wrong = "redirected from https to plain http (" + to_origin + "): refused";
    } else if (r.redirects >= kMaxRedirects) {
      r.wrong = "redirected more than " + std::to_string(kMaxRedirects) + " times";
    } else {
      r.wrong_kind = kWrongNone;
    }
    if (r.wrong_kind != kWrongNone) return false;
    if (to_origin != from_origin && !p.headers_dropped) {
      p.headers_dropped = true;
      a.easy_setopt(p.easy, kOptHttpHeader, static_cast<curl_slist*>(nullptr));
    }
    if (to_origin != from_origin) r.redirected_away = true;
    r.redirects += 1;
    p.url = to;
    a.easy_setopt(p.easy, kOptUrl, p.url.c_str());
    r.status = 0;
    r.error_body.clear();
    r.content_length = r.range_total = -1;
    r.retry_after.clear();
    r.bucket_region.clear();
    p.checked = false;
    p.errbuf[0] = 0;
    p.last_byte_ns = now_ns();
    if (a.multi_add_handle(s.multi, p.easy) != 0) return false;
    p.added = true;
    return true;
  }

  void finish(PartState& p, CURLcode code) {
    PartResult& r = *p.res;
    long status = 0;
    if (a.easy_getinfo(p.easy, kInfoResponseCode, &status) == kOk && status) r.status = int(status);
    if (code == kOk && is_redirect(r.status)) {
      a.multi_remove_handle(s.multi, p.easy);
      p.added = false;
      if (follow(p)) return;
      if (r.wrong_kind == kWrongRedirect) {  // refused: the part ends as wrong
        r.curl_code = code;
        p.ended = true;
        return;
      }
    }
    if (code == kOk && r.status >= 200 && r.status <= 299 && p.fill && !flush(p)) code = 23;  // CURLE_WRITE_ERROR
    r.curl_code = code;
    if (!p.ranged && code == kOk && p.hash.length() == r.written) {
      r.hashed = true;
      r.xxh64 = p.hash.digest();
    }
    if (code != kOk) r.curl_error = p.errbuf[0] ? std::string(p.errbuf) : std::string(a.easy_strerror(code));
    p.ended = true;
    a.multi_remove_handle(s.multi, p.easy);
    p.added = false;
  }

  void drain() {
    int left = 0;
    while (CURLMsg* m = a.multi_info_read(s.multi, &left)) {
      if (m->msg != kMsgDone) continue;
      for (PartState& p : parts)
        if (p.easy == m->easy_handle && !p.ended) finish(p, m->data.result);
    }
  }

  // See NOTE [stall]: a part whose server sent nothing for the stall timeout ends now.
  void end_stalled() {
    uint64_t now = now_ns();
    auto limit = uint64_t(std::max(0.0, req.stall_timeout_s) * 1e9);
    for (PartState& p : parts) {
      if (p.ended || now - p.last_byte_ns <= limit) continue;
      if (p.added) a.multi_remove_handle(s.multi, p.easy);
      p.added = false;
      p.ended = true;
      PartResult& r = *p.res;
      r.curl_code = 28;  // CURLE_OPERATION_TIMEDOUT: the same failure as libcurl's own limits
      r.curl_error = "the server sent nothing for " + std::to_string(req.stall_timeout_s) + " s (stall timeout)";
    }
  }

  bool all_ended() const {
    for (const PartState& p : parts)
      if (!p.ended) return false;
    return true;
  }
};

Download::Download(const Request& req) {
  std::string why;
  if (!available(&why)) throw std::runtime_error(why);
  impl_ = std::make_unique<Impl>();
  Impl& im = *impl_;
  im.req = req;
  const Api& a = im.a;
  std::vector<Part> parts = req.parts;
  bool ranged = !parts.empty();
  if (!ranged) parts.push_back(Part{0, req.size});
  results_.resize(parts.size());
  im.parts.resize(parts.size());
  for (const std::string& h : req.headers) im.headers = a.slist_append(im.headers, h.c_str());
  while (im.s.buffers.size() < parts.size()) im.s.buffers.emplace_back();
  long stall = std::max(1L, long(req.stall_timeout_s + 0.999));
  for (size_t i = 0; i < parts.size(); ++i) {
    Impl::PartState& p = im.parts[i];
    p.owner = &im;
    p.res = &results_[i];
    p.offset = parts[i].offset;
    p.expect = parts[i].length;
    p.ranged = ranged;
    p.buf = &im.s.buffers[i];
    if (p.buf->size() != std::max<size_t>(req.write_buffer, 4096))
      p.buf->assign(std::max<size_t>(req.write_buffer, 4096), 0);
    if (!im.s.idle.empty()) {
      p.easy = im.s.idle.back();
      im.s.idle.pop_back();
      a.easy_reset(p.easy);
    } else {
      p.easy = a.easy_init();
      if (!p.easy) throw std::runtime_error("curl_easy_init failed");
    }
    CURL* e = p.easy;
    a.easy_setopt(e, kOptUrl, req.url.c_str());
    a.easy_setopt(e, kOptHttpGet, 1L);
    a.easy_setopt(e, kOptNoSignal, 1L);
    a.easy_setopt(e, kOptProtocols, kProtoHttp | kProtoHttps);
    a.easy_setopt(e, kOptRedirProtocols, kProtoHttp | kProtoHttps);
    a.easy_setopt(e, kOptFollowLocation, 0L);  // See NOTE [redirects]: followed by Impl::follow
    // A proxy's "200 Connection established" is not the answer to the GET (libcurl 7.54).
    a.easy_setopt(e, kOptSuppressConnectHeaders, 1L);
    p.url = req.url;
    // See NOTE [receive buffer]: libcurl's receive buffer, no larger than the part.
    a.easy_setopt(e, kOptBufferSize,
                  long(std::clamp<uint64_t>(p.expect, 16 << 10, std::max<size_t>(req.recv_buffer, 16 << 10))));
    a.easy_setopt(e, kOptConnectTimeoutMs, long(req.connect_timeout_s * 1000));
    a.easy_setopt(e, kOptLowSpeedLimit, 1L);
    a.easy_setopt(e, kOptLowSpeedTime, stall);
    a.easy_setopt(e, kOptTcpKeepAlive, 1L);
    a.easy_setopt(e, kOptUserAgent, "pyloader");
    a.easy_setopt(e, kOptErrorBuffer, p.errbuf);
    if (im.headers) a.easy_setopt(e, kOptHttpHeader, im.headers);
    if (!im.req.ca_file.empty()) a.easy_setopt(e, kOptCaInfo, im.req.ca_file.c_str());
    a.easy_setopt(e, kOptHeaderFunction, &Impl::on_header);
    a.easy_setopt(e, kOptHeaderData, &p);
    a.easy_setopt(e, kOptWriteFunction, &Impl::on_body);
    a.easy_setopt(e, kOptWriteData, &p);
    if (ranged) {
      p.range = std::to_string(p.offset) + "-" + std::to_string(p.offset + p.expect - 1);
      a.easy_setopt(e, kOptRange, p.range.c_str());
    }
  }
  for (Impl::PartState& p : im.parts) {
    p.last_byte_ns = now_ns();
    CURLMcode mc = a.multi_add_handle(im.s.multi, p.easy);
    if (mc != 0) {
      // The destructor does not run for a constructor that throws: detach what was added
      // (the multi handle would otherwise drive transfers whose state is gone).
      stop();
      for (Impl::PartState& q : im.parts) im.s.idle.push_back(q.easy);
      if (im.headers) a.slist_free_all(im.headers);
      impl_.reset();
      throw std::runtime_error(std::string("curl_multi_add_handle: ") + a.multi_strerror(mc));
    }
    p.added = true;
  }
}

Download::~Download() {
  if (!impl_) return;
  stop();
  Impl& im = *impl_;
  for (Impl::PartState& p : im.parts)
    if (p.easy) im.s.idle.push_back(p.easy);
  if (im.headers) im.a.slist_free_all(im.headers);
}

bool Download::step(int ms) {
  Impl& im = *impl_;
  int running = 0;
  CURLMcode mc = im.a.multi_perform(im.s.multi, &running);
  im.drain();
  if (mc != 0 || im.all_ended()) {
    if (mc != 0)
      for (Impl::PartState& p : im.parts)
        if (!p.ended) {
          p.res->curl_error = std::string("curl_multi_perform: ") + im.a.multi_strerror(mc);
          p.res->curl_code = 2;  // CURLE_FAILED_INIT
          p.ended = true;
        }
    return true;
  }
  int fds = 0;
  im.a.multi_poll(im.s.multi, nullptr, 0, ms, &fds);
  mc = im.a.multi_perform(im.s.multi, &running);
  im.drain();
  im.end_stalled();
  return im.all_ended();
}

uint64_t Download::take_written() {
  uint64_t n = impl_->unreported;
  impl_->unreported = 0;
  return n;
}

void Download::stop() {
  Impl& im = *impl_;
  for (Impl::PartState& p : im.parts) {
    if (p.added) im.a.multi_remove_handle(im.s.multi, p.easy);
    p.added = false;
    p.ended = true;
  }
}

}  // namespace http
}  // namespace pyloader
