// Native error type. Workers capture it into the batch slot; the bindings map its
// kind to a pyloader Python exception on the consuming thread (see pyloader/_errors.py).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyloader {

enum class ErrorKind : int {
  kFormat = 0,    // malformed shard: bad magic/version/sizes/index, undecodable block
  kChecksum = 1,  // a checksum does not match: the bytes are corrupt
  kSchema = 2,    // the shard's schema differs from the dataset's
  kIO = 3,        // open/stat/mmap failed
  kState = 4,     // API misuse (e.g. use after fork, after close)
  kTimeout = 5,   // no batch within the caller's timeout
  kDevice = 6,    // a CUDA driver call failed
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

}  // namespace pyloader
