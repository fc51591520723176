// HTTP(S) downloads straight into a file descriptor through the system's libcurl, loaded
// at run time from libcurl.so.4 and never linked (like the CUDA driver), so one build runs
// with and without it; without it the Python side downloads through fsspec.
//
// NOTE [native transport]: one download is one attempt: a GET of the whole object, or one
// ranged GET per part, all driven by one multi handle on the calling thread and written
// with pwrite() at their offsets through a staging buffer per part (libcurl hands the body
// over in 16 KiB pieces; writing those one by one costs more CPU than the transfer). A
// whole GET's XXH64 is taken in the same pass as that copy, while the piece is in cache,
// so its bytes are read once by pyloader (Xxh64Stream::update_copy), never read back. The
// caller drives it in slices (`step`) and, between slices, sees the bytes written and may
// cancel. Nothing is retried here and nothing is judged: each part reports its status line,
// the headers that matter (Content-Length, Content-Range, Retry-After), the start of an
// error body and libcurl's error, and the Python side classifies them (NOTE [fetch
// retries] in pyloader/remote/fs.py). A part stops as soon as it cannot be right (a body
// larger than asked, a 200 to a ranged request, a total size other than the expected one),
// so a changed object is never written past the bytes it was asked for. Each thread keeps
// its own multi handle and easy handles, so connections (and TLS sessions) are reused by
// the next download on that thread; a forked child never touches its parent's handles
// (their sockets are the parent's): it leaks them and starts anew. Only http and https
// are spoken, redirects included.
//
// NOTE [receive buffer]: libcurl receives into a buffer of CURLOPT_BUFFERSIZE bytes per
// transfer (its callbacks still see 16 KiB pieces of it). A larger buffer means fewer,
// larger recv() calls, and fewer window updates (ACKs) sent back with the softirq work
// they cost the receiving thread: 32 MB objects over loopback into files, 2 threads,
// alternated, CPU s/GB: 512 KiB 0.92-0.98, 1 MiB 0.86-0.88, 2 MiB 0.75-0.77, 4 MiB
// 0.71-0.80, 10 MiB 0.74-0.76, where a bare socket taking the body with recv_into a
// 4 MiB buffer cost 0.61-0.69. 4 MiB it is (libcurl 7.88 takes up to 10 MB; older
// versions clamp to 512 KiB), never more than the part asks for.
//
// NOTE [stall]: a part ends with a timeout (CURLE_OPERATION_TIMEDOUT) once its server sent
// nothing -- no header, no body byte -- for the request's stall timeout, checked at every
// step of the caller's loop, so within the timeout plus one step. libcurl's own low-speed
// limit stays as a backstop only: it judges the average speed over its last seconds, so
// after a burst it noticed a stall several seconds late (about 6.8 s for a 1 s limit).
//
// NOTE [redirects]: libcurl does not follow redirects itself (it would send the caller's
// headers -- API keys, tokens -- to whatever host a redirect names, and libcurl before
// 7.83 even its own Authorization on a downgrade, CVE-2022-27776). A part's 3xx answer is
// followed here, one hop at a time, at most kMaxRedirects times per request: to the same
// origin (scheme, host and port) with the caller's headers, to another origin without
// them (from then on, also if a later hop comes back), never from https to plain http
// nor to another scheme: those end the part as wrong (kWrongRedirect), nothing written.
// Every hop is a request of the same attempt, driven by the same multi handle, so the
// caller's cancel and stall limits apply to it as to the first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pyloader {
namespace http {

// Whether libcurl.so.4 could be loaded (the reason in *why when not).
bool available(std::string* why = nullptr);
// libcurl's version string ("libcurl/7.88.1 OpenSSL/3.0 ..."), or "" without it.
std::string version();

struct Part {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct Request {
  std::string url;
  int fd = -1;                       // written with pwrite() at each part's offsets
  uint64_t size = 0;                 // the object's expected size
  std::vector<Part> parts;           // empty: one GET of the whole object; else one ranged GET each
  std::vector<std::string> headers;  // "Name: value" lines sent with every request
  double connect_timeout_s = 30;
  double stall_timeout_s = 30;  // no byte for this long ends the part (libcurl's low-speed limit)
  std::string ca_file;          // the CA bundle to verify TLS peers with ("": libcurl's default)
  size_t write_buffer = 1 << 20;
  size_t recv_buffer = 4 << 20;  // libcurl's receive buffer per part, at most (See NOTE [receive buffer])
};

// What a part stopped as wrong found: the answer was not the range asked for (a server that
// ignores ranges: whole GETs work), or the object is not the one the manifest describes.
constexpr int kWrongNone = 0;
constexpr int kWrongRange = 1;
constexpr int kWrongObject = 2;
constexpr int kWrongRedirect = 3;  // a redirect refused (See NOTE [redirects])
constexpr int kMaxRedirects = 5;

struct PartResult {
  int status = 0;          // the final response's status code (0: none came)
  uint64_t written = 0;    // body bytes written to fd
  int curl_code = -1;      // libcurl's CURLcode (0: the transfer ended cleanly; -1: not finished)
  std::string curl_error;  // its message
  int64_t content_length = -1;
  int64_t range_total = -1;      // the "/total" of Content-Range
  std::string retry_after;       // the Retry-After header as sent
  std::string bucket_region;     // S3's x-amz-bucket-region header as sent
  std::string error_body;        // the start of a non-2xx body
  std::string wrong;             // why the part was stopped as wrong ("" if not)
  int wrong_kind = kWrongNone;   // what was wrong, for the caller to act on (not the words)
  int write_errno = 0;           // errno of a failed pwrite
  bool hashed = false;           // whether xxh64 covers every byte written (a whole-object GET)
  uint64_t xxh64 = 0;            // XXH64 (seed 0) of the bytes written, when hashed
  int redirects = 0;             // redirects followed (See NOTE [redirects])
  bool redirected_away = false;  // one led to another origin: the caller's headers were not sent there
};

class Download {
 public:
  // Starts every part; throws std::runtime_error when libcurl is unavailable.
  explicit Download(const Request& req);
  ~Download();
  Download(const Download&) = delete;
  Download& operator=(const Download&) = delete;

  // Drives the transfers for at most `ms` milliseconds; true once every part has ended.
  bool step(int ms);
  // Body bytes written since the last call.
  uint64_t take_written();
  // Ends every part still running (curl_code stays -1 for those).
  void stop();
  const std::vector<PartResult>& results() const { return results_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<PartResult> results_;
};

}  // namespace http
}  // namespace pyloader
