// Shard format reader, versions 1 to 3 (docs/format.md): memory-maps a shard, validates
// its header, schema, column table and index once at open, then serves per-record field
// entries and column values to workers.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace pyloader {

inline constexpr char kShardMagic[8] = {'P', 'Y', 'L', 'S', 'H', 'A', 'R', 'D'};
// The versions a reader accepts. 1 and 2 differ only in their checksum function; 3 is 2
// plus a column table (NOTE [column layout]).
inline constexpr uint32_t kShardVersionXxh64 = 1;    // every checksum is XXH64, seed 0
inline constexpr uint32_t kShardVersionXxh3 = 2;     // every checksum is XXH3-64, seed 0
inline constexpr uint32_t kShardVersionColumns = 3;  // XXH3-64, small fixed fields stored as columns
inline constexpr size_t kHeaderSize = 128;
inline constexpr size_t kIndexEntrySize = 32;
inline constexpr size_t kColumnTableHead = 8;  // u32 num_columns, u32 reserved
inline constexpr size_t kColumnDescSize = 24;  // u32 field, u32 row_bytes, u32 block_rows, u32 reserved, u64 offset
inline constexpr uint8_t kCodecRaw = 0;
inline constexpr uint8_t kCodecLZ4 = 1;

// NOTE [value bounds]: every size a shard states is bounded before anything is allocated
// from it, because every checksum of a shard can be forged to agree (they catch damage, not
// intent). At open, each index entry's decoded size must be what the field's declared shape
// makes of its leading length, at most what its stored bytes can become (themselves: raw;
// lz4_max_decoded_size(), 255x: LZ4), and at most the set's per-value limit
// (max_value_bytes; a fixed field's record size is checked against it once, from the
// schema). Counts and offsets are bounded by the file's size (every record takes an index
// entry or a column byte; every region lies inside the file). Workers then size batch
// buffers from validated entries only, so a forged entry fails at open, naming its shard,
// record and field, instead of reserving batch rows x 4 GiB.
inline constexpr uint64_t kDefaultMaxValueBytes = uint64_t(1) << 30;
// A field name is [A-Za-z_][A-Za-z0-9_]* of at most this many bytes (docs/format.md).
inline constexpr size_t kMaxFieldNameBytes = 128;

struct FieldSpec {
  std::string name;
  uint8_t dtype = 0;
  bool variable = false;      // leading dimension varies per record
  std::vector<int64_t> dims;  // full shape; dims[0] == -1 when variable
  size_t itemsize = 0;
  size_t row_bytes = 0;  // variable: bytes per leading row; fixed: bytes per record
};

inline bool shard_version_supported(uint32_t version) noexcept {
  return version == kShardVersionXxh64 || version == kShardVersionXxh3 || version == kShardVersionColumns;
}

// The share of [p, p + len)'s pages in the page cache (mincore; 1 if it cannot be told), and
// with queue_missing each 128 KiB piece with a page missing queued for read-ahead
// (NOTE [queue what is missing] in shard_reader.cpp).
double resident_share(const uint8_t* p, uint64_t len, bool queue_missing = false) noexcept;

// The checksum of a supported shard `version` over data[0, len): header, schema, index and
// every stored value of such a shard use it.
uint64_t shard_checksum(uint32_t version, const void* data, size_t len) noexcept;
// Copies src to dst (not overlapping) and returns shard_checksum(version, src, len) in one pass.
uint64_t shard_checksum_copy(uint32_t version, void* dst, const void* src, size_t len) noexcept;
// The checksum's name for messages: "XXH64" or "XXH3-64".
const char* shard_checksum_name(uint32_t version) noexcept;

// Parses the binary schema block; throws LoaderError naming `where` if malformed (kFormat),
// or kSchema for a field name that breaks the format's rule (the message shows it escaped).
std::vector<FieldSpec> parse_schema(const uint8_t* data, size_t size, const std::string& where);

// One index entry, decoded from its 32 on-disk bytes.
struct IndexEntry {
  uint64_t offset;  // from the start of the payload
  uint32_t stored_size;
  uint32_t decoded_size;
  uint32_t leading;  // rows in the leading dimension (variable fields), else 0
  uint8_t codec;
  uint64_t checksum;  // shard_checksum() of the stored bytes
};

// See NOTE [column layout]: a version 3 shard may store a fixed field as a *column*: its values
// for every record back to back in record order (record r at data + r * row_bytes), raw,
// cut into blocks of 2^block_shift rows, each block with one checksum in the column table.
// Such a field has no index entries; the index holds only the other (*indexed*) fields, in
// schema order. A column value is verified by checking its whole block the first time any
// of its rows is read (NOTE [verify once], per block instead of per record) and then read
// with one memcpy. Which fields are columns is a property of each shard, not of the
// dataset: shards of one dataset may differ (and versions 1 and 2 have no columns).
struct ColumnSpec {
  const uint8_t* data = nullptr;       // the value of record 0 (mapped bytes)
  const uint8_t* checksums = nullptr;  // num_blocks little-endian u64, the shard's checksum of each block
  uint32_t row_bytes = 0;              // bytes per record, >= 1
  uint32_t block_shift = 0;            // a block is 1 << block_shift rows; the last one may be shorter
  uint64_t num_blocks = 0;
  uint64_t first_block = 0;  // this column's first bit in the shard's block bitmap
};

// What a file is on its filesystem, from fstat() of the descriptor a shard was mapped
// from (NOTE [verified files]). Equal identities: the same file, not written since.
struct FileIdentity {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const FileIdentity& o) const noexcept {
    return dev == o.dev && ino == o.ino && size == o.size && mtime_ns == o.mtime_ns && ctime_ns == o.ctime_ns;
  }
};

class Shard {
 public:
  // Opens and validates. expected_bytes/records come from the manifest; schema must equal
  // the dataset schema byte for byte. No value may decode to more than max_value_bytes
  // (NOTE [value bounds]). Throws LoaderError.
  // With `read_ahead`, the whole file is queued for read-ahead at once (NOTE [read-ahead at
  // open] in shard_reader.cpp); without, by the first claim_read_ahead().
  Shard(std::string path, uint64_t expected_bytes, uint64_t expected_records, const std::string& schema_blob,
        const std::vector<FieldSpec>& fields, uint64_t max_value_bytes = kDefaultMaxValueBytes, bool read_ahead = true);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const std::string& path() const noexcept { return path_; }
  // The shard's format version (kShardVersionXxh64, kShardVersionXxh3 or kShardVersionColumns), which
  // picks its checksum.
  uint32_t version() const noexcept { return version_; }
  uint64_t num_records() const noexcept { return num_records_; }
  // The index entry of an indexed field (column_of(field) < 0).
  IndexEntry entry(uint64_t record, size_t field) const noexcept;
  // Where that entry lies in the mapping (for a prefetch before entry() reads it).
  const uint8_t* entry_address(uint64_t record, size_t field) const noexcept {
    return base_ + index_offset_ + (record * num_indexed_ + slot_[field]) * kIndexEntrySize;
  }
  const uint8_t* payload() const noexcept { return base_ + payload_offset_; }
  uint64_t payload_offset() const noexcept { return payload_offset_; }
  // The file range (offset, bytes) of the checksum block of column c that holds `record`:
  // what reading that record's value of the column touches (it verifies the whole block).
  std::pair<uint64_t, uint64_t> column_block_range(size_t c, uint64_t record) const noexcept {
    const ColumnSpec& col = columns_[c];
    const uint64_t first = (record >> col.block_shift) << col.block_shift;
    const uint64_t rows = std::min<uint64_t>(uint64_t(1) << col.block_shift, num_records_ - first);
    return {uint64_t(col.data - base_) + first * col.row_bytes, rows * col.row_bytes};
  }
  // See NOTE [column layout]: the column that stores `field`, or -1 if the field is indexed.
  int32_t column_of(size_t field) const noexcept { return column_of_[field]; }
  const ColumnSpec& column(size_t c) const noexcept { return columns_[c]; }
  // The first indexed field, or -1 when every field is a column.
  int32_t first_indexed() const noexcept { return first_indexed_; }
  // Queues bytes [offset, offset + len) of the file for asynchronous read-ahead (NOTE [cold
  // read-ahead] in batch_pipeline.h); the range is clipped to the file.
  void advise_range(uint64_t offset, uint64_t len) const noexcept;
  // NOTE [cold spans] in batch_pipeline.h: reads bytes [offset, offset + len) of the file
  // into dst with pread(), through the shard's span descriptor (NOTE [span descriptor]) or
  // one opened now, if it is still the file mapped (device, inode, size). False (dst then
  // undefined) if it is not, or on any error.
  bool read_span(uint64_t offset, uint64_t len, uint8_t* dst) const noexcept;
  // Closes the span descriptor once no read_span() uses it (NOTE [span descriptor]): the
  // last batch that read the shard's spans was released, or the shard went idle. A later
  // read_span() opens one again.
  void drop_span_file() const noexcept;
  // Whether the whole file was queued for read-ahead already (then a record needs no more).
  bool whole_file_queued() const noexcept;
  // Queues the whole file for read-ahead the first time it is called (or never, if the
  // constructor did): see NOTE [read-ahead at open]. True if this call queued it; then
  // *resident (if given) is the share of the file's pages that were in memory before, and
  // only the pieces with pages missing were queued (NOTE [queue what is missing]).
  bool claim_read_ahead(double* resident = nullptr) const noexcept {
    if (read_ahead_done_.exchange(true, std::memory_order_acq_rel)) return false;
    const double share = advise_read_ahead();
    if (share < 0) return false;
    if (share >= kMostlyCached) mostly_cached_.store(true, std::memory_order_relaxed);  // NOTE [mostly cached]
    if (resident) *resident = share;
    return true;
  }
  // The share of a file's pages in memory at its read-ahead claim from which its runs count as
  // in memory (NOTE [mostly cached] in shard_reader.cpp).
  static constexpr double kMostlyCached = 15.0 / 16.0;
  // Whether the file was wholly in the page cache when mapped (NOTE [whole file cached]), or its
  // claim found at least kMostlyCached of it in memory (and queued the rest).
  bool mostly_cached() const noexcept { return mostly_cached_.load(std::memory_order_relaxed); }
  // NOTE [cold spans] in batch_pipeline.h: queues every column's values for read-ahead, the
  // first time it is called, if they total at most `limit` bytes. True if they are queued
  // (by this call or an earlier one); false if they are larger.
  bool claim_columns_read_ahead(uint64_t limit) const noexcept;
  // Whether claim_read_ahead() could still queue the file (no one has; not too large).
  bool read_ahead_unclaimed() const noexcept;
  // NOTE [map ahead] in batch_pipeline.h: maps the file's pages into this process
  // (MADV_POPULATE_READ, waiting for those still being read), in pieces, until done or
  // `stop`. Returns the bytes mapped, or -1 if the kernel cannot (before Linux 5.14).
  int64_t map_pages(const std::atomic<bool>& stop) const noexcept;
  uint64_t file_bytes() const noexcept { return map_size_; }

  // NOTE [verify once]: every stored value is checked against its checksum the first time
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
  // Whether this process has read `record` (collated it) since it mapped the shard; unlike
  // verified(), never set by a file trusted as verified by an earlier process, whose pages
  // may have left the page cache since (NOTE [cold read-ahead] in batch_pipeline.h).
  bool seen(uint64_t record) const noexcept {
    return (seen_[record >> 6].load(std::memory_order_relaxed) >> (record & 63)) & 1u;
  }
  void mark_seen(uint64_t record) const noexcept {
    seen_[record >> 6].fetch_or(uint64_t(1) << (record & 63), std::memory_order_relaxed);
  }
  // NOTE [verified files] in shard_reader.cpp: the file this shard was mapped from, when it
  // was opened (CLOCK_REALTIME ns, before anything was hashed), every record and block
  // marked verified at once, and whether all of them are.
  const FileIdentity& identity() const noexcept { return identity_; }
  int64_t opened_ns() const noexcept { return opened_ns_; }
  void mark_all_verified() const noexcept;
  bool all_verified() const noexcept;
  // The same for the blocks of columns (NOTE [column layout]); `bit` is first_block + block.
  bool block_verified(uint64_t bit) const noexcept {
    return (block_verified_[bit >> 6].load(std::memory_order_acquire) >> (bit & 63)) & 1u;
  }
  void mark_block_verified(uint64_t bit) const noexcept {
    block_verified_[bit >> 6].fetch_or(uint64_t(1) << (bit & 63), std::memory_order_release);
  }
  // Checks block `block` of column `c` against its checksum; on a mismatch returns false
  // and sets *got / *want. Does not mark it verified.
  bool check_block(size_t c, uint64_t block, uint64_t* got, uint64_t* want) const noexcept;

 private:
  // The constructor's steps, in order. Each throws LoaderError naming the shard; the
  // constructor unmaps the file if any step after map_file() throws.
  struct Regions;  // where the header puts schema, column table, index and payload
  // Opens, checks the size against the manifest, maps the file and closes the descriptor.
  void map_file(uint64_t expected_bytes);
  // Magic, version, header checksum, counts against the manifest, and the regions tiling the file.
  Regions validate_header(uint64_t expected_records, size_t expected_fields);
  // The checksums of the schema, the column table (version 3) and the index.
  void verify_region_checksums(const Regions& r) const;
  // The shard's schema block equals the dataset's byte for byte.
  void check_schema_matches(const Regions& r, const std::string& schema_blob) const;
  // Validates the column table (NOTE [column layout]) and fills columns_ and
  // column_of_; returns the number of column blocks (bits of block_verified_).
  uint64_t read_column_table(const Regions& r, const std::vector<FieldSpec>& fields);
  // Gives every indexed field its slot in a record's index entries; checks the index size.
  void assign_index_slots(const Regions& r);
  // Every index entry against the payload, its field's shape and NOTE [value bounds].
  void validate_index_entries(const Regions& r, const std::vector<FieldSpec>& fields, uint64_t max_value_bytes) const;
  // Queues the whole file for read-ahead (NOTE [read-ahead at open] in shard_reader.cpp).
  // The share of the file's pages that were in memory, or -1 if the file is too large to queue.
  double advise_read_ahead() const;

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t map_size_ = 0;
  uint32_t version_ = 0;
  uint64_t num_records_ = 0;
  size_t num_fields_ = 0;
  size_t num_indexed_ = 0;  // fields with index entries (all of them below version 3)
  uint64_t index_offset_ = 0;
  uint64_t payload_offset_ = 0;
  std::vector<int32_t> column_of_;   // per field: its column, or -1
  std::vector<uint32_t> slot_;       // per indexed field: its position in a record's index entries
  std::vector<ColumnSpec> columns_;  // in field order
  int32_t first_indexed_ = -1;
  std::unique_ptr<std::atomic<uint64_t>[]> verified_;
  std::unique_ptr<std::atomic<uint64_t>[]> seen_;
  std::unique_ptr<std::atomic<uint64_t>[]> block_verified_;
  uint64_t total_blocks_ = 0;  // bits of block_verified_
  FileIdentity identity_;
  int64_t opened_ns_ = 0;
  bool cached_at_open_ = false;  // every page in the page cache when mapped (NOTE [whole file cached])
  mutable std::atomic<bool> mostly_cached_{false};  // NOTE [mostly cached] in shard_reader.cpp
  mutable std::atomic<bool> read_ahead_done_{false};
  mutable std::atomic<bool> columns_queued_{false};
  struct SpanFile;
  // NOTE [span descriptor]; read and replaced with std::atomic_load / atomic_store.
  mutable std::shared_ptr<const SpanFile> span_file_;
  // Opens a descriptor of path_ that is still the file mapped; -1 if it is not or on error.
  int open_mapped_file() const noexcept;
  // The span descriptor, opened on first use; null past the process's bound of kept ones.
  std::shared_ptr<const SpanFile> span_file() const noexcept;
};

// The shards of one dataset, each opened (mapped and validated) on first use.
//
// NOTE [shard readiness]: for remote datasets the files arrive while the epoch runs. Such
// a set starts with every shard *pending*; a Python fetcher calls mark_ready() once a
// shard's file is verified and in place (or mark_failed() with the reason). Workers that
// need a pending shard wait for it, polling their cancel flag, so closing a pipeline
// never waits on a download. Native threads never call into Python for this.
//
// NOTE [working set]: a pipeline retain()s, for every batch of its plan, each distinct
// shard the batch reads, and release()s them once that batch is collated (or will never
// be). A shard whose count drops to zero is *idle*: no batch in flight or planned needs
// it. Idle shards stay mapped (a later epoch reads them without page faults) in LRU
// order, and are unmapped:
//   - local sets: by the set itself, beyond `max_idle` idle mappings;
//   - pending (remote) sets: only when the fetcher calls unload(), which puts the shard
//     back to pending; the fetcher then unpins its cache file. The set records each
//     release, each shard a worker waits on, and each corrupt cached copy, for the
//     fetcher's pilot thread to collect with wait_events().
// Workers hold a shard only while collating a batch that reads it, so an idle shard is
// never mapped by a worker, and unload() unmaps it at once.
//
// NOTE [mapping bound]: a process may hold at most vm.max_map_count mappings (65,530 by
// default), and a shuffled epoch retains every shard until its last batch, so a local set
// of more shards than that would fail at mmap. A local set is therefore given `max_mapped`
// (0: no bound): once more shards than that are mapped, get() unmaps idle shards first
// (least recently released), then shards that planned batches still need but no worker
// holds now, least recently used first; a later get() maps and validates such a shard
// again (its records are verified again too: NOTE [verify once]). Shards held by workers
// are never unmapped, so the bound can be exceeded by at most what the workers hold.
//
// NOTE [self-healing]: in a pending set, a cached copy that fails a checksum (or cannot be
// opened: vanished, wrong size, corrupt header) is reported: the set drops its mapping,
// puts the shard back to pending and records it; the fetcher discards the cached file and
// fetches it again, and the worker retries its batch. A second failure of the same shard's
// bytes is raised, naming both: the source itself is then corrupt, and fetching it a third
// time would loop. A copy that vanished (ENOENT: evicted or removed by another process) is
// no sign of a bad source: it is fetched again however often it happens.
struct ShardEvents {
  std::vector<uint32_t> released;                         // shards that became idle, in order
  std::vector<uint32_t> waiting;                          // shards a worker waits on now
  std::vector<std::pair<uint32_t, std::string>> corrupt;  // shards to discard and fetch again, with the reason
};

// NOTE [renamed schemas]: a set may hold shards of several datasets (a mixture) whose
// fields differ only in name. `shard_schemas` lists their schema blocks and `schema_of[i]`
// the one shard i must equal byte for byte (empty: every shard equals `schema_blob`). Each
// must have the fields of `schema_blob` in the same order with the same dtype, variability
// and shape; batches carry `schema_blob`'s names.
class ShardSet {
 public:
  ShardSet(std::vector<std::string> paths, std::vector<uint64_t> bytes, std::vector<uint64_t> records,
           std::string schema_blob, bool pending = false, size_t max_idle = 4096,
           std::vector<std::string> shard_schemas = {}, std::vector<uint32_t> schema_of = {},
           uint64_t max_value_bytes = kDefaultMaxValueBytes, size_t max_mapped = 0);
  ~ShardSet();
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  size_t size() const noexcept { return paths_.size(); }
  bool pending_set() const noexcept { return pending_set_; }
  // How many more shards it may map before it unmaps others (NOTE [mapping bound]; SIZE_MAX: no bound).
  size_t room();
  const std::vector<FieldSpec>& fields() const noexcept { return fields_; }
  const std::string& path(size_t i) const { return paths_.at(i); }
  uint64_t records(size_t i) const { return records_.at(i); }
  uint64_t file_bytes(size_t i) const { return bytes_.at(i); }  // from the manifest
  // Shard i if it is mapped now, else null; maps and waits for nothing. Thread-safe.
  std::shared_ptr<const Shard> peek(size_t i);
  // Opens shard i on first use, waiting while it is pending. Thread-safe. Throws
  // LoaderError (kState if *cancel became true while waiting).
  // `read_ahead`: see Shard's constructor (a shard already open is returned as it is).
  std::shared_ptr<const Shard> get(size_t i, const std::atomic<bool>* cancel = nullptr, bool read_ahead = true);
  void mark_ready(size_t i, std::string path);
  void mark_failed(size_t i, std::string message, int sys_errno = 0);
  // A failed shard of a pending set becomes pending again (a later iterator retries it). False if it was not failed.
  bool retry(size_t i);
  pid_t owner_pid() const noexcept { return pid_; }

  // NOTE [working set]. `shards` may repeat; each occurrence counts once.
  void retain(const std::vector<uint32_t>& shards);
  void release(const std::vector<uint32_t>& shards);
  // Unmaps shard i of a pending set and makes it pending again: an idle one, or with
  // `force` one that planned batches still need but no worker holds now (the fetcher
  // brings it back before they run). False (and nothing changes) otherwise.
  bool unload(size_t i, bool force = false);
  // Closes shard i's span descriptor, if it is mapped (NOTE [span descriptor] in shard_reader.cpp).
  void drop_span_file(size_t i);
  // See NOTE [self-healing]: true if the caller should retry (a re-fetch was requested or is
  // under way, or `bad` is no longer the shard's current mapping); false if the error is final.
  // On false, *earlier is the first failure's message.
  // `vanished`: the copy is gone, not corrupt (fetched again every time).
  bool report_corrupt(size_t i, const Shard* bad, const std::string& message, std::string* earlier,
                      bool vanished = false);
  // Waits up to timeout_ms for a release, a corrupt report or a change in what workers
  // wait on; takes the recorded events. For the fetcher's pilot thread.
  ShardEvents wait_events(int64_t timeout_ms);
  // The shards a worker waits on now (takes no events).
  std::vector<uint32_t> waiting();

  // See NOTE [verified files] in shard_reader.cpp: shard i, once mapped from a file of this
  // identity, needs no checksum checks (a later open of a file with another identity does).
  void trust(size_t i, const FileIdentity& id);
  // Mapped shards whose every record is verified now and that were not reported before
  // (nor trusted): (index, identity, opened_ns). Each is reported once, and trusted from then on.
  struct VerifiedShard {
    size_t index;
    FileIdentity identity;
    int64_t opened_ns;
  };
  std::vector<VerifiedShard> newly_verified();

  struct Counts {
    uint64_t mapped = 0, idle = 0, active = 0, heals = 0, unloads = 0, peak_mapped = 0, remaps = 0;
    uint64_t opens = 0;  // shards mapped and checked by get(), remaps included (NOTE [one open per shard])
  };
  Counts counts();

 private:
  void make_idle_locked(size_t i);
  void leave_idle_locked(size_t i);
  void drop_mapping_locked(size_t i);
  // See NOTE [mapping bound]: the order of use of mapped shards, and the unmapping beyond max_mapped_.
  void touch_locked(size_t i);
  void forget_locked(size_t i);
  void enforce_bound_locked(size_t keep, std::vector<std::shared_ptr<const Shard>>* unmap);

  std::vector<std::string> paths_;
  std::vector<uint64_t> bytes_;
  std::vector<uint64_t> records_;
  std::string schema_blob_;
  std::vector<std::string> shard_schemas_;  // NOTE [renamed schemas]
  std::vector<uint32_t> schema_of_;
  uint64_t max_value_bytes_;  // NOTE [value bounds]
  std::vector<FieldSpec> fields_;
  bool pending_set_;
  size_t max_idle_;
  size_t max_mapped_;  // See NOTE [mapping bound]; 0: none
  std::mutex mu_;
  std::vector<std::shared_ptr<const Shard>> open_;
  std::vector<uint8_t> state_;  // 0 ready to open, 1 pending, 2 failed
  std::vector<std::string> failure_;
  std::vector<int> failure_errno_;
  std::vector<uint32_t> active_;   // batches in flight or planned that read the shard
  std::vector<uint32_t> waiters_;  // workers waiting for the shard to be ready
  std::vector<uint8_t> opening_;   // a worker is mapping the shard now (NOTE [one open per shard])
  std::vector<uint8_t> healed_;    // a re-fetch was requested once
  std::vector<std::string> first_failure_;
  std::vector<FileIdentity> trusted_;  // See NOTE [verified files]; size 0 until trust() is first called
  std::vector<uint8_t> reported_;      // by newly_verified() or trusted
  // Idle mapped shards, least recently released first: a doubly linked list by index.
  static constexpr uint32_t kNone = 0xffffffffu;
  std::vector<uint32_t> idle_prev_, idle_next_;
  std::vector<uint8_t> in_idle_;
  std::vector<uint8_t> release_noted_;  // already in events_.released
  uint32_t idle_head_ = kNone, idle_tail_ = kNone;
  // Mapped shards of a bounded set, least recently used first (See NOTE [mapping bound]).
  std::vector<uint32_t> use_prev_, use_next_;
  std::vector<uint8_t> in_use_list_, mapped_before_;
  uint32_t use_head_ = kNone, use_tail_ = kNone;
  uint64_t remaps_ = 0, opens_ = 0;
  size_t idle_count_ = 0, mapped_ = 0, peak_mapped_ = 0;
  size_t active_shards_ = 0;
  uint64_t heals_ = 0, unloads_ = 0;
  ShardEvents events_;
  uint64_t wait_gen_ = 0, reported_wait_gen_ = 0;
  std::unique_ptr<std::condition_variable> cv_ = std::make_unique<std::condition_variable>();
  std::unique_ptr<std::condition_variable> events_cv_ = std::make_unique<std::condition_variable>();
  pid_t pid_;
};

}  // namespace pyloader
