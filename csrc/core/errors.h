// Native error type. Workers capture it into the batch slot; the bindings map its
// kind to a pyloader Python exception on the consuming thread (see pyloader/errors.py).
#pragma once

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

namespace pyloader {

enum class ErrorKind : int {
  kFormat = 0,    // malformed shard: bad magic/version/sizes/index, undecodable block
  kChecksum = 1,  // a checksum does not match: the bytes are corrupt
  kSchema = 2,    // the shard's schema differs from the dataset's
  kIO = 3,        // open/stat/mmap failed
  kState = 4,     // API misuse (e.g. use after fork, after close)
  kTimeout = 5,   // no batch within the caller's timeout
  kDevice = 6,    // a CUDA driver call failed
  kThread = 7,    // a native thread could not be started (NOTE [thread start failure])
};

class LoaderError : public std::runtime_error {
 public:
  LoaderError(ErrorKind kind, std::string shard, int64_t record, std::string field, const std::string& what,
              int sys_errno = 0)
      : std::runtime_error(compose(shard, record, field, what)),
        kind_(kind),
        shard_(std::move(shard)),
        record_(record),
        field_(std::move(field)),
        errno_(sys_errno) {}

  ErrorKind kind() const noexcept { return kind_; }
  const std::string& shard() const noexcept { return shard_; }
  int64_t record() const noexcept { return record_; }
  const std::string& field() const noexcept { return field_; }
  int sys_errno() const noexcept { return errno_; }

 private:
  static std::string compose(const std::string& shard, int64_t record, const std::string& field,
                             const std::string& what) {
    std::string s;
    if (!shard.empty()) s += "shard '" + shard + "'";
    if (record >= 0) s += (s.empty() ? "" : " ") + std::string("record ") + std::to_string(record);
    if (!field.empty()) s += (s.empty() ? "" : " ") + std::string("field '") + field + "'";
    if (!s.empty()) s += ": ";
    return s + what;
  }

  ErrorKind kind_;
  std::string shard_;
  int64_t record_;
  std::string field_;
  int errno_;
};

// NOTE [thread start failure]: std::thread throws std::system_error when the system will not
// start another thread -- EAGAIN under a limit on the user's processes and threads
// (RLIMIT_NPROC, `ulimit -u`), a cgroup's pids.max or kernel.threads-max. A native
// constructor that starts threads catches it, stops and joins the threads it already started
// (a joinable std::thread destroyed by the unwinding would std::terminate the process),
// undoes what it took (a pipeline's shard retains), and throws this error instead: Python
// receives a ThreadStartError (an OSError with the errno) that names the limit.
inline LoaderError thread_start_error(const std::system_error& e, const std::string& which) {
  const int err = e.code().value();
  std::string msg = "could not start " + which + ": " + e.code().message();
  if (err == EAGAIN)
    msg +=
        " -- the process is at a limit on threads: its user's RLIMIT_NPROC (ulimit -u, which counts every thread "
        "of the user), its cgroup's pids.max or kernel.threads-max; raise the limit or use fewer workers";
  return LoaderError(ErrorKind::kThread, "", -1, "", msg, err);
}

}  // namespace pyloader
