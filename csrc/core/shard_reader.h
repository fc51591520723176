// Shard format v1 reader (docs/format.md): memory-maps a shard, validates its header,
// schema and index once at open, then serves per-record field entries to workers.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace pyloader {

inline constexpr char kShardMagic[8] = {'P', 'Y', 'L', 'S', 'H', 'A', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kHeaderSize = 128;
inline constexpr size_t kIndexEntrySize = 32;
inline constexpr uint8_t kCodecRaw = 0;
inline constexpr uint8_t kCodecLZ4 = 1;

struct FieldSpec {
  std::string name;
  uint8_t dtype = 0;
  bool variable = false;      // leading dimension varies per record
  std::vector<int64_t> dims;  // full shape; dims[0] == -1 when variable
  size_t itemsize = 0;
  size_t row_bytes = 0;  // variable: bytes per leading row; fixed: bytes per record
};

// Parses the binary schema block; throws LoaderError(kFormat) naming `where` if malformed.
std::vector<FieldSpec> parse_schema(const uint8_t* data, size_t size, const std::string& where);

// One index entry, decoded from its 32 on-disk bytes.
struct IndexEntry {
  uint64_t offset;  // from the start of the payload
  uint32_t stored_size;
  uint32_t decoded_size;
  uint32_t leading;  // rows in the leading dimension (variable fields), else 0
  uint8_t codec;
  uint64_t checksum;  // xxh64 of the stored bytes, seed 0
};

class Shard {
 public:
  // Opens and validates. expected_bytes/records come from the manifest; schema must equal
  // the dataset schema byte for byte. Throws LoaderError.
  Shard(std::string path, uint64_t expected_bytes, uint64_t expected_records, const std::string& schema_blob,
        const std::vector<FieldSpec>& fields);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const std::string& path() const noexcept { return path_; }
  uint64_t num_records() const noexcept { return num_records_; }
  IndexEntry entry(uint64_t record, size_t field) const noexcept;
  const uint8_t* payload() const noexcept { return base_ + payload_offset_; }

  // NOTE [verify once]: every stored value is checked against its XXH64 the first time
  // this process reads its record; the record is then marked verified and later reads
  // (later epochs) use the same mapped, immutable bytes without hashing them again. A
  // shard is replaced only by renaming a new file into place, which never changes the
  // bytes behind an existing mapping.
  bool verified(uint64_t record) const noexcept {
    return (verified_[record >> 6].load(std::memory_order_acquire) >> (record & 63)) & 1u;
  }
  void mark_verified(uint64_t record) const noexcept {
    verified_[record >> 6].fetch_or(uint64_t(1) << (record & 63), std::memory_order_release);
  }

 private:
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t map_size_ = 0;
  uint64_t num_records_ = 0;
  size_t num_fields_ = 0;
  uint64_t index_offset_ = 0;
  uint64_t payload_offset_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> verified_;
};

// The shards of one dataset, opened lazily (once each) and kept mapped across epochs
// so that later epochs take no page faults.
//
// NOTE [shard readiness]: for remote datasets the files arrive while the epoch runs. Such
// a set starts with every shard *pending*; a Python fetcher calls mark_ready() once a
// shard's file is verified and in place (or mark_failed() with the reason). Workers that
// need a pending shard wait for it, polling their cancel flag, so closing a pipeline
// never waits on a download. Native threads never call into Python for this.
class ShardSet {
 public:
  ShardSet(std::vector<std::string> paths, std::vector<uint64_t> bytes, std::vector<uint64_t> records,
           std::string schema_blob, bool pending = false);
  ~ShardSet();
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  size_t size() const noexcept { return paths_.size(); }
  const std::vector<FieldSpec>& fields() const noexcept { return fields_; }
  const std::string& path(size_t i) const { return paths_.at(i); }
  uint64_t records(size_t i) const { return records_.at(i); }
  // Opens shard i on first use, waiting while it is pending. Thread-safe. Throws
  // LoaderError (kState if *cancel became true while waiting).
  std::shared_ptr<const Shard> get(size_t i, const std::atomic<bool>* cancel = nullptr);
  void mark_ready(size_t i, std::string path);
  void mark_failed(size_t i, std::string message);
  pid_t owner_pid() const noexcept { return pid_; }

 private:
  std::vector<std::string> paths_;
  std::vector<uint64_t> bytes_;
  std::vector<uint64_t> records_;
  std::string schema_blob_;
  std::vector<FieldSpec> fields_;
  std::mutex mu_;
  std::vector<std::shared_ptr<const Shard>> open_;
  std::vector<uint8_t> state_;  // 0 ready to open, 1 pending, 2 failed
  std::vector<std::string> failure_;
  std::unique_ptr<std::condition_variable> cv_ = std::make_unique<std::condition_variable>();
  pid_t pid_;
};

}  // namespace pyloader
