#include "core/shard_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/lz4_block.h"
#include "core/xxh3.h"
#include "core/xxh64.h"

namespace pyloader {
namespace {

template <typename T>
T load_le(const uint8_t* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the format is little-endian, as are all supported hosts
  return v;
}

// NOTE [read-ahead pieces]: the kernel reads at most the device's read-ahead window per
// WILLNEED (the larger of read_ahead_kb and max_sectors_kb: 8 MiB here, 128 KiB by default)
// and silently drops the rest of a longer range, so a 64 MiB shard advised whole had only
// its first 8 MiB queued. Ranges are asked in pieces of the default window: a cold
// sequential stream through the whole file measured 1.26-1.60 GB/s, against 0.98-1.08 with
// one call per file (256 MiB in 16 MiB files, page cache dropped).
constexpr uint64_t kWillneedPiece = 128 << 10;

void willneed(const uint8_t* base, uint64_t start, uint64_t end) noexcept {
  for (uint64_t a = start; a < end; a += kWillneedPiece)
    (void)::madvise(const_cast<uint8_t*>(base) + a, size_t(std::min(end - a, kWillneedPiece)), MADV_WILLNEED);
}

// MADV_POPULATE_READ (Linux 5.14), named here for C libraries that predate it; pieces of
// 1 MiB, so a stop is seen within one piece's read.
constexpr int kPopulateRead = 22;
constexpr uint64_t kMapPiece = 1 << 20;

size_t willneed_limit() {
  static const size_t limit = [] {
    long pages = ::sysconf(_SC_PHYS_PAGES), size = ::sysconf(_SC_PAGESIZE);
    return pages > 0 && size > 0 ? size_t(pages) * size_t(size) / 16 : size_t(0);
  }();
  return limit;
}

// NOTE [whole file cached]: whether every page of an open file is in the page cache, asked
// of the kernel with one cachestat() call (Linux 6.5), which counts the file's cached pages
// from its page-cache tree. mincore() over the same mapping, which NOTE [queue what is
// missing] runs before queueing a file for read-ahead, looks every page up one by one:
// 380-550 us per 64 MB shard here against 45-60 us (a C probe over the same cached
// files), and a shuffled first epoch opens every shard of the dataset. So a shard whose
// file is wholly cached when it is mapped skips that scan (nothing is missing to queue);
// any other answer, or a kernel without the call (ENOSYS) or a sandbox that refuses it,
// leaves the scan as it was. A page evicted between the open and the scan is then not
// queued: it is read by the page fault that reaches it.
#ifndef SYS_cachestat
#if defined(__x86_64__) || defined(__aarch64__)
#define SYS_cachestat 451
#endif
#endif
// NOTE [mostly cached]: a file is rarely in the page cache whole when a later process maps
// it: the kernel reclaims pages of the page cache nobody touched for a while (this machine's
// kernel does so by itself: shards written a minute before were 90.6-99.97% cached), and any
// memory pressure does the same. Such a shard had each span-shaped batch's run looked up page
// by page with mincore() (NOTE [cold spans] in batch_pipeline.h): 178-562 calls of 15-21 us
// in a warm in-order first epoch of 625 batches. So the first read-ahead claim of a file
// (NOTE [read-ahead at open]), which looks every page up once and queues the pieces missing
// (NOTE [queue what is missing]), marks a file it found at least 15/16 in memory: its runs
// then count as in memory, as a wholly cached file's do, and the few pages missing are read by
// the read-ahead it queued or the page fault that reaches them. A colder file keeps the check
// per run (its cold runs read with pread()).
bool whole_file_cached(int fd, uint64_t size) noexcept {
#ifdef SYS_cachestat
  static std::atomic<bool> unsupported{false};
  if (size == 0 || unsupported.load(std::memory_order_relaxed)) return false;
  struct {
    uint64_t off, len;
  } range{0, 0};  // len 0: to the end of the file
  struct {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
  } st{};
  if (::syscall(SYS_cachestat, fd, &range, &st, 0) != 0) {
    if (errno == ENOSYS || errno == EPERM) unsupported.store(true, std::memory_order_relaxed);
    return false;
  }
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  return st.nr_cache >= (size + page - 1) / page;
#else
  (void)fd;
  (void)size;
  return false;
#endif
}

[[noreturn]] void format_error(const std::string& path, const std::string& what) {
  throw LoaderError(ErrorKind::kFormat, path, -1, "", what);
}

// A name from a schema block for a message: printable ASCII as is, any other byte as \xNN,
// so the message is valid UTF-8 whatever the bytes were.
std::string escaped_name(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n && i < 2 * kMaxFieldNameBytes; ++i) {
    const uint8_t c = p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += char(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", unsigned(c));
      out += hex;
    }
  }
  if (n > 2 * kMaxFieldNameBytes) out += "...";
  return out;
}

// The format's rule for field names: [A-Za-z_][A-Za-z0-9_]*, 1 to kMaxFieldNameBytes bytes.
bool valid_field_name(const uint8_t* p, size_t n) noexcept {
  if (n == 0 || n > kMaxFieldNameBytes) return false;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t c = p[i];
    const bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string size_text(uint64_t n) {
  char buf[64];
  if (n >= (uint64_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%llu bytes (%.1f GiB)", static_cast<unsigned long long>(n), double(n) / (1 << 30));
  else if (n >= (uint64_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%llu bytes (%.1f MiB)", static_cast<unsigned long long>(n), double(n) / (1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(n));
  return buf;
}

}  // namespace

// NOTE [queue what is missing]: WILLNEED walks every page of its range in the page cache
// even when all of them are there, one 128 KiB piece per call (NOTE [read-ahead pieces]):
// queuing 480 MB of cached shards whole cost the first epoch's two workers 9 ms of CPU
// (perf: page_cache_ra_unbounded, xa_load), a quarter of what that epoch paid beyond a
// steady one. So a range is first looked up with mincore() (one byte per page, ~10 ns a
// page, in slices), and only its pieces with a page missing are queued. A slice mincore()
// cannot tell about is queued whole, as before, and counted as present.
double resident_share(const uint8_t* p, uint64_t len, bool queue_missing) noexcept {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  const uint8_t* base = reinterpret_cast<const uint8_t*>(uintptr_t(p) & ~uintptr_t(page - 1));
  const uint64_t end = uint64_t(p - base) + len;
  if (len == 0) return 1.0;
  const uint64_t piece_pages = std::max<uint64_t>(1, kWillneedPiece / page);
  constexpr uint64_t kSlice = 4096;  // pages per mincore() call: a 4 KiB vector on the stack
  unsigned char in[kSlice];
  uint64_t pages = 0, present = 0;
  for (uint64_t a = 0; a < end; a += kSlice * page) {
    const uint64_t n = std::min(end - a, kSlice * page);
    const uint64_t k = (n + page - 1) / page;
    pages += k;
    if (::mincore(const_cast<uint8_t*>(base) + a, n, in) != 0) {
      if (queue_missing) willneed(base, a, a + n);
      present += k;
      continue;
    }
    for (uint64_t i = 0; i < k; i += piece_pages) {
      const uint64_t m = std::min(piece_pages, k - i);
      uint64_t here = 0;
      for (uint64_t j = 0; j < m; ++j) here += in[i + j] & 1u;
      if (queue_missing && here < m) willneed(base, a + i * page, std::min(end, a + (i + m) * page));
      present += here;
    }
  }
  return double(present) / double(pages);
}

// Version 1 is XXH64; versions 2 and 3 are XXH3-64.
uint64_t shard_checksum(uint32_t version, const void* data, size_t len) noexcept {
  return version != kShardVersionXxh64 ? xxh3_64(data, len) : xxh64(data, len, 0);
}

uint64_t shard_checksum_copy(uint32_t version, void* dst, const void* src, size_t len) noexcept {
  return version != kShardVersionXxh64 ? xxh3_64_copy(dst, src, len) : xxh64_copy(dst, src, len, 0);
}

const char* shard_checksum_name(uint32_t version) noexcept {
  return version != kShardVersionXxh64 ? "XXH3-64" : "XXH64";
}

std::vector<FieldSpec> parse_schema(const uint8_t* data, size_t size, const std::string& where) {
  std::vector<FieldSpec> out;
  size_t pos = 0;
  auto need = [&](size_t n) {
    if (size - pos < n) format_error(where, "schema block truncated");
  };
  need(4);
  uint32_t nfields = load_le<uint32_t>(data);
  pos += 4;
  if (nfields == 0 || nfields > 4096) format_error(where, "schema has an invalid field count");
  for (uint32_t f = 0; f < nfields; ++f) {
    FieldSpec spec;
    need(2);
    uint16_t name_len = load_le<uint16_t>(data + pos);
    pos += 2;
    if (name_len == 0) format_error(where, "schema field with an empty name");
    need(name_len);
    if (!valid_field_name(data + pos, name_len))
      throw LoaderError(ErrorKind::kSchema, where, -1, "",
                        "schema field " + std::to_string(f) + " has the name '" + escaped_name(data + pos, name_len) +
                            "', which is not [A-Za-z_][A-Za-z0-9_]* of at most " + std::to_string(kMaxFieldNameBytes) +
                            " bytes (corrupt or forged schema)");
    spec.name.assign(reinterpret_cast<const char*>(data + pos), name_len);
    pos += name_len;
    need(4);
    spec.dtype = data[pos];
    uint8_t flags = data[pos + 1];
    uint8_t ndim = data[pos + 2];
    pos += 4;
    spec.itemsize = dtype_itemsize(spec.dtype);
    if (spec.itemsize == 0) format_error(where, "schema field '" + spec.name + "' has an unknown dtype code");
    if (flags & ~1u) format_error(where, "schema field '" + spec.name + "' has unknown flags");
    spec.variable = flags & 1u;
    if (ndim > 16) format_error(where, "schema field '" + spec.name + "' has too many dimensions");
    if (spec.variable && ndim == 0) format_error(where, "variable field '" + spec.name + "' has no dimensions");
    need(size_t(ndim) * 8);
    size_t row = spec.itemsize;
    for (uint8_t d = 0; d < ndim; ++d) {
      int64_t dim = load_le<int64_t>(data + pos);
      pos += 8;
      if (d == 0 && spec.variable) {
        if (dim != -1) format_error(where, "variable field '" + spec.name + "' must have dims[0] == -1");
      } else {
        if (dim < 0 || dim > (int64_t(1) << 32))
          format_error(where, "schema field '" + spec.name + "' has an invalid dimension");
        if (dim != 0 && row > std::numeric_limits<uint32_t>::max() / size_t(dim))
          format_error(where, "schema field '" + spec.name + "' is larger than 4 GiB per record");
        row *= size_t(dim);
      }
      spec.dims.push_back(dim);
    }
    if (spec.dtype == uint8_t(DType::kBytes) && !(spec.variable && ndim == 1))
      format_error(where, "bytes field '" + spec.name + "' must be one variable dimension");
    spec.row_bytes = row;
    out.push_back(std::move(spec));
  }
  if (pos != size) format_error(where, "schema block has trailing bytes");
  return out;
}

// Where the header says each region lies, after validate_header() checked that they tile
// the file.
struct Shard::Regions {
  uint64_t schema_offset = 0;
  uint64_t schema_size = 0;
  uint64_t columns_size = 0;  // the column table (version 3; 0 below)
  uint64_t index_size = 0;
  uint64_t payload_size = 0;
};

Shard::Shard(std::string path, uint64_t expected_bytes, uint64_t expected_records, const std::string& schema_blob,
             const std::vector<FieldSpec>& fields, uint64_t max_value_bytes, bool read_ahead)
    : path_(std::move(path)) {
  map_file(expected_bytes);
  try {
    const Regions regions = validate_header(expected_records, fields.size());
    // NOTE [metadata first]: opening a shard reads its schema, column table and index (the
    // checksums and the validation below touch all of them). Reached by page faults on a
    // cold file, each fault is a synchronous read of the device's read-around window (8 MiB
    // here) -- two per shard, so the first batch of a global shuffle over 25 cold shards of
    // 64 MB waited 218-244 ms for 48-58 such faults. So the header is read with pread()
    // (map_file: a read of a few pages, no read-around) and the regions before the payload
    // are queued with WILLNEED before they are touched: the faults then wait only for the
    // reads of those regions.
    // See NOTE [queue what is missing]; nothing is missing in a file wholly cached (NOTE [whole file cached]).
    if (!cached_at_open_) (void)resident_share(base_, payload_offset_, /*queue_missing=*/true);
    verify_region_checksums(regions);
    check_schema_matches(regions, schema_blob);
    column_of_.assign(num_fields_, -1);
    slot_.assign(num_fields_, 0);
    const uint64_t total_blocks = read_column_table(regions, fields);
    assign_index_slots(regions);
    validate_index_entries(regions, fields, max_value_bytes);
    total_blocks_ = total_blocks;
    block_verified_.reset(new std::atomic<uint64_t>[(total_blocks + 63) / 64 + 1]());
    verified_.reset(new std::atomic<uint64_t>[(num_records_ + 63) / 64]());
    seen_.reset(new std::atomic<uint64_t>[(num_records_ + 63) / 64]());
    if (read_ahead) claim_read_ahead();
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(base_), map_size_);
    base_ = nullptr;
    throw;
  }
}

void Shard::map_file(uint64_t expected_bytes) {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    std::string why = std::string("cannot open: ") + std::strerror(e);
    if (e == EMFILE)
      why +=
          " (this process reached its open-file limit, `ulimit -n`; a reader holds no descriptor per shard, so "
          "raise the limit by what the rest of the program keeps open)";
    throw LoaderError(ErrorKind::kIO, path_, -1, "", why, e);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw LoaderError(ErrorKind::kIO, path_, -1, "", std::string("cannot stat: ") + std::strerror(e), e);
  }
  {
    struct timespec now;
    ::clock_gettime(CLOCK_REALTIME, &now);
    opened_ns_ = int64_t(now.tv_sec) * 1000000000 + now.tv_nsec;
  }
  identity_ = FileIdentity{uint64_t(st.st_dev), uint64_t(st.st_ino), uint64_t(st.st_size),
                           int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                           int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec};
  uint64_t fsize = uint64_t(st.st_size);
  if (fsize != expected_bytes) {
    ::close(fd);
    format_error(path_, "file is " + std::to_string(fsize) + " bytes but the manifest says " +
                            std::to_string(expected_bytes) + " (truncated or replaced)");
  }
  if (fsize < kHeaderSize) {
    ::close(fd);
    format_error(path_, "file is shorter than the shard header");
  }
  // See NOTE [metadata first]: the header through a read, not a page fault.
  {
    uint8_t head[kHeaderSize];
    (void)!::pread(fd, head, kHeaderSize, 0);
  }
  cached_at_open_ = whole_file_cached(fd, fsize);                    // See NOTE [whole file cached]
  mostly_cached_.store(cached_at_open_, std::memory_order_relaxed);  // all of it is: See NOTE [mostly cached]
  void* p = ::mmap(nullptr, fsize, PROT_READ, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);  // the mapping keeps the file alive; no descriptor is held per shard
  if (p == MAP_FAILED) {
    std::string why = std::string("mmap failed: ") + std::strerror(e);
    if (e == ENOMEM)
      why +=
          " (the process may be at its limit of memory mappings, vm.max_map_count: lower the dataset's bound on "
          "mapped shards, max_mapped_shards, or raise the limit with sysctl; NOTE [mapping bound])";
    throw LoaderError(ErrorKind::kIO, path_, -1, "", why, e);
  }
  base_ = static_cast<const uint8_t*>(p);
  map_size_ = fsize;
}

Shard::Regions Shard::validate_header(uint64_t expected_records, size_t expected_fields) {
  const uint8_t* h = base_;
  const uint64_t fsize = map_size_;
  if (std::memcmp(h, kShardMagic, 8) != 0) format_error(path_, "not a pyloader shard (bad magic)");
  // The version picks the checksum function, so it is read before the header checksum
  // can be checked; that check then covers the version too.
  version_ = load_le<uint32_t>(h + 8);
  if (!shard_version_supported(version_)) format_error(path_, "unsupported shard version " + std::to_string(version_));
  if (shard_checksum(version_, h, 120) != load_le<uint64_t>(h + 120)) {
    throw LoaderError(ErrorKind::kChecksum, path_, -1, "", "header checksum mismatch (corrupt header)");
  }
  if (load_le<uint32_t>(h + 12) != kHeaderSize) format_error(path_, "unexpected header size");
  Regions r;
  num_records_ = load_le<uint64_t>(h + 16);
  num_fields_ = load_le<uint32_t>(h + 24);
  uint32_t entry_size = load_le<uint32_t>(h + 28);
  r.schema_offset = load_le<uint64_t>(h + 32);
  r.schema_size = load_le<uint64_t>(h + 40);
  index_offset_ = load_le<uint64_t>(h + 48);
  r.index_size = load_le<uint64_t>(h + 56);
  payload_offset_ = load_le<uint64_t>(h + 64);
  r.payload_size = load_le<uint64_t>(h + 72);
  uint64_t file_size = load_le<uint64_t>(h + 80);
  // Version 3: the column table (NOTE [column layout]) lies between schema and index; its
  // size and checksum take the header's reserved bytes, which are zero below version 3.
  const bool v3 = version_ == kShardVersionColumns;
  r.columns_size = v3 ? load_le<uint64_t>(h + 104) : 0;
  if (entry_size != kIndexEntrySize) format_error(path_, "unexpected index entry size");
  if (file_size != fsize) format_error(path_, "header file size disagrees with the file (truncated?)");
  if (num_records_ != expected_records)
    format_error(path_, "shard has " + std::to_string(num_records_) + " records but the manifest says " +
                            std::to_string(expected_records));
  if (num_fields_ != expected_fields) {
    throw LoaderError(ErrorKind::kSchema, path_, -1, "", "shard has a different number of fields than the dataset");
  }
  // The regions must tile the file exactly: header, schema, (column table,) index, payload.
  // num_records is bounded before anything is multiplied by it: every record has an index
  // entry (below version 3), or at least an index entry or a column value of >= 1 byte.
  if (r.schema_offset != kHeaderSize || r.schema_size > fsize - kHeaderSize ||
      num_records_ > (v3 ? fsize : fsize / kIndexEntrySize) || r.columns_size > fsize - kHeaderSize - r.schema_size ||
      (v3 && r.columns_size < kColumnTableHead) || index_offset_ != r.schema_offset + r.schema_size + r.columns_size ||
      r.index_size % kIndexEntrySize != 0 || (!v3 && r.index_size != num_records_ * num_fields_ * kIndexEntrySize) ||
      r.index_size > fsize - index_offset_ || payload_offset_ != index_offset_ + r.index_size ||
      r.payload_size != fsize - payload_offset_)
    format_error(path_, "header region offsets are inconsistent");
  return r;
}

void Shard::verify_region_checksums(const Regions& r) const {
  const uint8_t* h = base_;
  if (shard_checksum(version_, base_ + r.schema_offset, r.schema_size) != load_le<uint64_t>(h + 88))
    throw LoaderError(ErrorKind::kChecksum, path_, -1, "", "schema checksum mismatch (corrupt schema)");
  const uint8_t* ct = base_ + r.schema_offset + r.schema_size;
  if (version_ == kShardVersionColumns && shard_checksum(version_, ct, r.columns_size) != load_le<uint64_t>(h + 112))
    throw LoaderError(ErrorKind::kChecksum, path_, -1, "", "column table checksum mismatch (corrupt column table)");
  if (shard_checksum(version_, base_ + index_offset_, r.index_size) != load_le<uint64_t>(h + 96))
    throw LoaderError(ErrorKind::kChecksum, path_, -1, "", "index checksum mismatch (corrupt index)");
}

void Shard::check_schema_matches(const Regions& r, const std::string& schema_blob) const {
  const uint8_t* schema = base_ + r.schema_offset;
  if (r.schema_size == schema_blob.size() && std::memcmp(schema, schema_blob.data(), r.schema_size) == 0) return;
  std::vector<FieldSpec> got;
  try {
    got = parse_schema(schema, r.schema_size, path_);
  } catch (const LoaderError& e) {
    // The shard's own schema is malformed: it differs from the dataset's either way.
    throw LoaderError(ErrorKind::kSchema, path_, -1, "",
                      std::string("shard schema differs from the dataset schema and is malformed (") + e.what() + ")");
  }
  std::string names;
  for (auto& f : got) names += (names.empty() ? "" : ", ") + f.name;
  throw LoaderError(ErrorKind::kSchema, path_, -1, "",
                    "shard schema differs from the dataset schema (shard fields: " + names + ")");
}

uint64_t Shard::read_column_table(const Regions& r, const std::vector<FieldSpec>& fields) {
  uint64_t total_blocks = 0;
  if (version_ != kShardVersionColumns) return total_blocks;
  const uint8_t* ct = base_ + r.schema_offset + r.schema_size;
  const uint64_t columns_size = r.columns_size, payload_size = r.payload_size;
  // See NOTE [column layout]: the table is u32 num_columns, u32 reserved, num_columns
  // descriptors, then each column's block checksums in descriptor order.
  const uint32_t ncols = load_le<uint32_t>(ct);
  auto bad_table = [&](const std::string& what) { format_error(path_, "column table: " + what); };
  if (load_le<uint32_t>(ct + 4) != 0) bad_table("reserved bytes are not zero");
  if (ncols > num_fields_) bad_table("more columns than fields");
  if (columns_size - kColumnTableHead < uint64_t(ncols) * kColumnDescSize) bad_table("truncated");
  uint64_t pos = kColumnTableHead + uint64_t(ncols) * kColumnDescSize;  // first checksum
  int64_t prev = -1;
  for (uint32_t c = 0; c < ncols; ++c) {
    const uint8_t* d = ct + kColumnTableHead + size_t(c) * kColumnDescSize;
    const uint32_t f = load_le<uint32_t>(d), row = load_le<uint32_t>(d + 4), rows = load_le<uint32_t>(d + 8);
    const uint64_t off = load_le<uint64_t>(d + 16);
    const std::string which = "column " + std::to_string(c);
    if (int64_t(f) <= prev || f >= num_fields_) bad_table(which + " names no field or is out of field order");
    prev = f;
    const FieldSpec& spec = fields[f];
    if (spec.variable || spec.row_bytes == 0 || row != spec.row_bytes)
      bad_table(which + " (field '" + spec.name + "'): only a fixed field of >= 1 byte may be a column, with " +
                "its record size (" + std::to_string(spec.row_bytes) + ")");
    if (rows == 0 || (rows & (rows - 1)) != 0 || rows > (1u << 31))
      bad_table(which + " (field '" + spec.name + "'): block rows must be a power of two");
    if (load_le<uint32_t>(d + 12) != 0) bad_table(which + ": reserved bytes are not zero");
    if (off > payload_size || num_records_ > (payload_size - off) / row)
      bad_table(which + " (field '" + spec.name + "') points outside the payload");
    ColumnSpec col;
    col.data = base_ + payload_offset_ + off;
    col.row_bytes = row;
    col.block_shift = uint32_t(__builtin_ctz(rows));
    col.num_blocks = (num_records_ + rows - 1) >> col.block_shift;
    col.first_block = total_blocks;
    if ((columns_size - pos) / 8 < col.num_blocks) bad_table("truncated block checksums");
    col.checksums = ct + pos;
    pos += col.num_blocks * 8;
    total_blocks += col.num_blocks;
    column_of_[f] = int32_t(columns_.size());
    columns_.push_back(col);
  }
  if (pos != columns_size) bad_table("has trailing bytes");
  return total_blocks;
}

void Shard::assign_index_slots(const Regions& r) {
  num_indexed_ = 0;
  for (size_t f = 0; f < num_fields_; ++f) {
    if (column_of_[f] >= 0) continue;
    if (first_indexed_ < 0) first_indexed_ = int32_t(f);
    slot_[f] = uint32_t(num_indexed_++);
  }
  if (version_ == kShardVersionColumns && ((num_indexed_ != 0 && num_records_ > map_size_ / kIndexEntrySize) ||
                                           r.index_size != num_records_ * num_indexed_ * kIndexEntrySize))
    format_error(path_, "header region offsets are inconsistent (index size)");
}

void Shard::validate_index_entries(const Regions& r, const std::vector<FieldSpec>& fields,
                                   uint64_t max_value_bytes) const {
  const uint64_t payload_size = r.payload_size;
  // Validate every entry once so workers can trust offsets and sizes.
  for (uint64_t rec = 0; rec < num_records_; ++rec) {
    for (size_t f = 0; f < num_fields_; ++f) {
      if (column_of_[f] >= 0) continue;
      IndexEntry en = entry(rec, f);
      const FieldSpec& spec = fields[f];
      auto bad = [&](const std::string& what) {
        throw LoaderError(ErrorKind::kFormat, path_, int64_t(rec), spec.name, what);
      };
      if (en.offset > payload_size || en.stored_size > payload_size - en.offset)
        bad("index entry points outside the payload");
      if (en.codec != kCodecRaw && en.codec != kCodecLZ4) bad("unknown codec");
      if (en.codec == kCodecRaw && en.stored_size != en.decoded_size) bad("raw entry with stored size != decoded size");
      uint64_t expect = spec.variable ? uint64_t(en.leading) * spec.row_bytes : spec.row_bytes;
      if (!spec.variable && en.leading != 0) bad("fixed-shape entry with a nonzero length");
      if (expect != en.decoded_size) bad("decoded size does not match the field's shape");
      // See NOTE [value bounds]: no more than the stored bytes can become, nor than the limit.
      if (en.codec == kCodecLZ4 && en.decoded_size > lz4_max_decoded_size(en.stored_size))
        bad("index entry says the value decodes to " + size_text(en.decoded_size) + ", more than an LZ4 block of " +
            std::to_string(en.stored_size) + " bytes can hold (" + std::to_string(kLz4MaxExpansion) +
            " per byte): corrupt or forged index");
      if (en.decoded_size > max_value_bytes)
        bad("value of " + size_text(en.decoded_size) + " exceeds the per-value limit of " + size_text(max_value_bytes) +
            " (pass a larger max_value_bytes to the dataset if values this large are " + "intended)");
    }
  }
}

void Shard::advise_range(uint64_t offset, uint64_t len) const noexcept {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  if (offset >= map_size_) return;
  len = std::min<uint64_t>(len, map_size_ - offset);
  willneed(base_, offset & ~(page - 1), offset + len);  // NOTE [read-ahead pieces]
}

bool Shard::claim_columns_read_ahead(uint64_t limit) const noexcept {
  uint64_t total = 0;
  for (const ColumnSpec& col : columns_) total += num_records_ * col.row_bytes;
  if (total > limit) return false;
  if (columns_queued_.exchange(true, std::memory_order_acq_rel)) return true;
  for (size_t c = 0; c < columns_.size(); ++c)
    advise_range(column_block_range(c, 0).first, num_records_ * columns_[c].row_bytes);
  return true;
}

// NOTE [span descriptor]: the kernel's read-ahead state lives in the open file, not in the
// inode. Opened afresh for every batch, each span's read started with no history: its
// read-ahead began small, its folios at one page or four, and the batches behind it found
// their pages in memory and read them through the mapping (a page fault per 16 pages). The
// page cache a cold in-order epoch left behind held small folios, which every later process
// maps page-table entry by entry. So a shard keeps one descriptor for its spans, shared by
// the workers (pread() takes no file position), from its first span read until the last
// batch of the plan that reads it is released (or the shard goes idle: NOTE [working set]
// in shard_reader.h), and the pipeline reads every later batch of the shard through it
// (NOTE [cold spans] in batch_pipeline.h): its read-ahead grows along the shard as `cat`'s
// does, in folios of up to 2 MiB. Measured on 480 MB of 12 KB records in 8 shards, page
// cache dropped before each fresh process, 4 alternated rounds against the descriptor per
// span: a later process could map 198-236 MB of the files with huge page-table entries
// against 14-110 MB, and mapped them all in 22-37 ms against 35-63 ms; the cold epoch
// itself read 1.37-1.95 against 1.32-1.81 GB/s with 0.49-0.55 CPUs against 0.57-0.82 (no
// page faults), where the process's memory was touched before (on this virtual machine a
// page cache growing into memory the host has taken back costs several times the read,
// and large folios come from such memory first). A reader holds its own reference while
// it reads, so closing the descriptor never closes one in use. At most kKeptSpanFiles are
// kept in a process; past that a span read opens its own descriptor, as before.
namespace {
constexpr int64_t kKeptSpanFiles = 64;
std::atomic<int64_t> kept_span_files{0};
}  // namespace

struct Shard::SpanFile {
  int fd;
  mutable std::atomic<bool> started{false};  // a span was read through it
  explicit SpanFile(int f) noexcept : fd(f) { kept_span_files.fetch_add(1, std::memory_order_relaxed); }
  ~SpanFile() {
    ::close(fd);
    kept_span_files.fetch_sub(1, std::memory_order_relaxed);
  }
  SpanFile(const SpanFile&) = delete;
  SpanFile& operator=(const SpanFile&) = delete;
};

int Shard::open_mapped_file() const noexcept {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  if (::fstat(fd, &st) == 0 && uint64_t(st.st_dev) == identity_.dev && uint64_t(st.st_ino) == identity_.ino &&
      uint64_t(st.st_size) == map_size_)
    return fd;
  ::close(fd);
  return -1;
}

std::shared_ptr<const Shard::SpanFile> Shard::span_file() const noexcept {
  std::shared_ptr<const SpanFile> f = std::atomic_load(&span_file_);
  if (f || kept_span_files.load(std::memory_order_relaxed) >= kKeptSpanFiles) return f;
  const int fd = open_mapped_file();
  if (fd < 0) return nullptr;
  try {
    std::shared_ptr<const SpanFile> mine = std::make_shared<const SpanFile>(fd);
    std::shared_ptr<const SpanFile> none;
    if (std::atomic_compare_exchange_strong(&span_file_, &none, mine)) return mine;
    return none;  // another worker's, opened at the same time (ours closes with `mine`)
  } catch (const std::bad_alloc&) {
    ::close(fd);
    return nullptr;
  }
}

void Shard::drop_span_file() const noexcept { std::atomic_store(&span_file_, std::shared_ptr<const SpanFile>()); }

bool Shard::read_span(uint64_t offset, uint64_t len, uint8_t* dst) const noexcept {
  if (offset > map_size_ || len > map_size_ - offset) return false;
  const std::shared_ptr<const SpanFile> kept = span_file();  // NOTE [span descriptor]
  const int fd = kept ? kept->fd : open_mapped_file();
  if (fd < 0) return false;
  // The kernel takes a new descriptor's first read for a random one (read as is, in
  // single-page folios, no read-ahead) unless the pages just before it are cached; a read of
  // the byte before the span makes the span the sequential next read instead (read in large
  // folios, with read-ahead behind it). NOTE [cold spans] in batch_pipeline.h. A kept
  // descriptor needs it only for its first read: later spans follow the earlier ones.
  if (offset > 0 && (!kept || !kept->started.exchange(true, std::memory_order_relaxed))) {
    uint8_t byte;
    (void)!::pread(fd, &byte, 1, off_t(offset - 1));
  }
  bool ok = true;
  while (len > 0) {
    const ssize_t n = ::pread(fd, dst, size_t(len), off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = false;
      break;
    }
    dst += n;
    offset += uint64_t(n);
    len -= uint64_t(n);
  }
  if (!kept) ::close(fd);
  return ok;
}

bool Shard::whole_file_queued() const noexcept {
  return read_ahead_done_.load(std::memory_order_acquire) && map_size_ <= willneed_limit();
}

bool Shard::read_ahead_unclaimed() const noexcept {
  return !read_ahead_done_.load(std::memory_order_acquire) && map_size_ <= willneed_limit();
}

int64_t Shard::map_pages(const std::atomic<bool>& stop) const noexcept {
  uint64_t a = 0;
  for (; a < map_size_ && !stop.load(std::memory_order_relaxed); a += kMapPiece) {
    const size_t len = size_t(std::min(map_size_ - a, kMapPiece));
    // EINVAL: a kernel without MADV_POPULATE_READ. Any other failure (EFAULT: a file cut
    // short under its mapping, which a read would have raised SIGBUS for; ENOMEM) leaves
    // the pages to the readers, who raise what they find.
    if (::madvise(const_cast<uint8_t*>(base_) + a, len, kPopulateRead) != 0) return errno == EINVAL ? -1 : int64_t(a);
  }
  return int64_t(std::min(a, map_size_));
}

double Shard::advise_read_ahead() const {
  // NOTE [read-ahead at open]: a shard is opened when the first batch that needs it is
  // collated, and its records are then read in plan order -- for a shuffled epoch, at
  // random. Read from a cold page cache that way, every miss would be a small synchronous
  // read. So the whole file is queued for asynchronous read-ahead now (a no-op for pages
  // already cached: ~1 ms per GB here); the reads then overlap the collation. Skipped for
  // a file larger than 1/16 of the machine's memory, which read-ahead could push out of
  // the cache before it is used. A pipeline opens the shards of its next batches without it,
  // queues their records first and then the whole files (NOTE [cold read-ahead] in
  // batch_pipeline.h).
  if (map_size_ > willneed_limit()) return -1.0;
  // See NOTE [queue what is missing]; nothing is missing in a file wholly cached (NOTE [whole file cached]).
  if (cached_at_open_) return 1.0;
  return resident_share(base_, map_size_, /*queue_missing=*/true);
}

Shard::~Shard() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), map_size_);
}

namespace {

// The bits of word w of a bitmap over n items that stand for items (all 64 but in the last word).
uint64_t word_mask(uint64_t n, uint64_t w) noexcept {
  const uint64_t left = n - w * 64;
  return left >= 64 ? ~uint64_t(0) : (uint64_t(1) << left) - 1;
}

void fill_bitmap(std::atomic<uint64_t>* bits, uint64_t n) noexcept {
  for (uint64_t w = 0; w < (n + 63) / 64; ++w) bits[w].store(word_mask(n, w), std::memory_order_release);
}

bool bitmap_full(const std::atomic<uint64_t>* bits, uint64_t n) noexcept {
  for (uint64_t w = 0; w < (n + 63) / 64; ++w) {
    const uint64_t full = word_mask(n, w);
    if ((bits[w].load(std::memory_order_acquire) & full) != full) return false;
  }
  return true;
}

}  // namespace

// NOTE [verified files]: a process verifies a record's checksums the first time it reads
// it (NOTE [verify once] in shard_reader.h); a new process would hash every byte of a warm
// dataset again, which made a first epoch 1.4x as long as the next ones. So a file that a
// process verified in full is remembered by its identity: (st_dev, st_ino, st_size,
// st_mtime, st_ctime) from fstat() of the descriptor it was mapped from. The loader keeps
// these records in a small file it owns (pyloader/read/verified.py says where, and when it
// writes one) and hands them to ShardSet::trust(); a shard mapped later from a file of the
// same identity is marked verified in full and read without hashing. Any write to a file,
// truncate, chmod, or rename over it changes st_ctime (or st_ino) and user space cannot set
// st_ctime back, so a file written since it was verified is verified again -- with two
// limits, which the recorder observes: the kernel stamps ctime from a coarse clock, so a
// file is recorded only if its ctime lies well before the open that began its hashing
// (another write in the same clock tick would otherwise look unchanged); and stores
// through a shared writable mapping update ctime only when written back, which the loader
// does not guard against (as NOTE [verify once] already assumes within a process).
// The header, schema and index checksums are checked at every open regardless.
void Shard::mark_all_verified() const noexcept {
  fill_bitmap(verified_.get(), num_records_);
  fill_bitmap(block_verified_.get(), total_blocks_);
}

bool Shard::all_verified() const noexcept {
  return bitmap_full(verified_.get(), num_records_) && bitmap_full(block_verified_.get(), total_blocks_);
}

bool Shard::check_block(size_t c, uint64_t block, uint64_t* got, uint64_t* want) const noexcept {
  const ColumnSpec& col = columns_[c];
  const uint64_t first = block << col.block_shift;
  const uint64_t rows = std::min<uint64_t>(uint64_t(1) << col.block_shift, num_records_ - first);
  *got = shard_checksum(version_, col.data + first * col.row_bytes, rows * col.row_bytes);
  *want = load_le<uint64_t>(col.checksums + block * 8);
  return *got == *want;
}

IndexEntry Shard::entry(uint64_t record, size_t field) const noexcept {
  const uint8_t* p = entry_address(record, field);
  IndexEntry e;
  e.offset = load_le<uint64_t>(p);
  e.stored_size = load_le<uint32_t>(p + 8);
  e.decoded_size = load_le<uint32_t>(p + 12);
  e.leading = load_le<uint32_t>(p + 16);
  e.codec = p[20];
  e.checksum = load_le<uint64_t>(p + 24);
  return e;
}

ShardSet::ShardSet(std::vector<std::string> paths, std::vector<uint64_t> bytes, std::vector<uint64_t> records,
                   std::string schema_blob, bool pending, size_t max_idle, std::vector<std::string> shard_schemas,
                   std::vector<uint32_t> schema_of, uint64_t max_value_bytes, size_t max_mapped)
    : paths_(std::move(paths)),
      bytes_(std::move(bytes)),
      records_(std::move(records)),
      schema_blob_(std::move(schema_blob)),
      shard_schemas_(std::move(shard_schemas)),
      schema_of_(std::move(schema_of)),
      max_value_bytes_(max_value_bytes),
      pending_set_(pending),
      max_idle_(max_idle),
      max_mapped_(pending ? 0 : max_mapped),
      pid_(::getpid()) {
  if (paths_.size() != bytes_.size() || paths_.size() != records_.size())
    throw std::invalid_argument("paths, bytes and records must have the same length");
  if (paths_.size() >= kNone) throw std::invalid_argument("too many shards");
  fields_ = parse_schema(reinterpret_cast<const uint8_t*>(schema_blob_.data()), schema_blob_.size(),
                         "<dataset schema>");
  if (max_value_bytes_ == 0) throw std::invalid_argument("max_value_bytes must be >= 1");
  // See NOTE [value bounds]: a fixed field's every value has its record size.
  for (const FieldSpec& f : fields_)
    if (!f.variable && f.row_bytes > max_value_bytes_)
      throw LoaderError(ErrorKind::kSchema, "", -1, f.name,
                        "the schema makes every value " + size_text(f.row_bytes) +
                            ", more than the per-value limit of " + size_text(max_value_bytes_) +
                            " (pass a larger max_value_bytes to the dataset if values this large are intended)");
  // See NOTE [renamed schemas]: each alternative schema must match the set's but for names.
  if (!schema_of_.empty() && schema_of_.size() != paths_.size())
    throw std::invalid_argument("schema_of must have one entry per shard");
  for (uint32_t k : schema_of_)
    if (k >= shard_schemas_.size()) throw std::invalid_argument("schema_of names no schema of shard_schemas");
  for (size_t k = 0; k < shard_schemas_.size(); ++k) {
    const std::string where = "<shard schema " + std::to_string(k) + ">";
    auto alt = parse_schema(reinterpret_cast<const uint8_t*>(shard_schemas_[k].data()), shard_schemas_[k].size(),
                            where);
    if (alt.size() != fields_.size())
      throw std::invalid_argument(where + " has " + std::to_string(alt.size()) + " fields, the set's schema " +
                                  std::to_string(fields_.size()));
    for (size_t f = 0; f < alt.size(); ++f)
      if (alt[f].dtype != fields_[f].dtype || alt[f].variable != fields_[f].variable || alt[f].dims != fields_[f].dims)
        throw std::invalid_argument(where + " field '" + alt[f].name + "' differs from the set's field '" +
                                    fields_[f].name + "' in dtype, variability or shape");
  }
  const size_t n = paths_.size();
  open_.resize(n);
  state_.assign(n, pending ? 1 : 0);
  failure_.resize(n);
  failure_errno_.assign(n, 0);
  active_.assign(n, 0);
  waiters_.assign(n, 0);
  opening_.assign(n, 0);
  healed_.assign(n, 0);
  first_failure_.resize(n);
  idle_prev_.assign(n, kNone);
  idle_next_.assign(n, kNone);
  in_idle_.assign(n, 0);
  release_noted_.assign(n, 0);
  reported_.assign(n, 0);
  if (max_mapped_ != 0) {  // See NOTE [mapping bound]
    use_prev_.assign(n, kNone);
    use_next_.assign(n, kNone);
    in_use_list_.assign(n, 0);
    mapped_before_.assign(n, 0);
  }
}

size_t ShardSet::room() {
  std::lock_guard<std::mutex> lk(mu_);
  if (max_mapped_ == 0) return std::numeric_limits<size_t>::max();
  return max_mapped_ > mapped_ ? max_mapped_ - mapped_ : 0;
}

std::shared_ptr<const Shard> ShardSet::peek(size_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  return i < open_.size() ? open_[i] : nullptr;
}

std::shared_ptr<const Shard> ShardSet::get(size_t i, const std::atomic<bool>* cancel, bool read_ahead) {
  if (::getpid() != pid_)
    throw LoaderError(ErrorKind::kState, "", -1, "",
                      "shard set used in a forked child; create the dataset iterator after fork");
  if (i >= paths_.size()) throw LoaderError(ErrorKind::kState, "", -1, "", "shard index out of range");
  for (;;) {
    std::string path;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (open_[i]) {
        if (max_mapped_ != 0) touch_locked(i);
        return open_[i];
      }
      if (state_[i] == 1) {
        // See NOTE [shard readiness]: wait for the fetcher, in slices, so a cancel is seen; the
        // pilot learns what is waited on (NOTE [working set]).
        ++waiters_[i];
        ++wait_gen_;
        events_cv_->notify_all();
        bool cancelled = false;
        while (state_[i] == 1) {
          if (cancel && cancel->load(std::memory_order_acquire)) {
            cancelled = true;
            break;
          }
          cv_->wait_for(lk, std::chrono::milliseconds(50));
        }
        --waiters_[i];
        ++wait_gen_;
        if (cancelled) throw LoaderError(ErrorKind::kState, paths_[i], -1, "", "cancelled while waiting for the shard");
      }
      if (state_[i] == 2) throw LoaderError(ErrorKind::kIO, paths_[i], -1, "", failure_[i], failure_errno_[i]);
      if (open_[i]) return open_[i];
      if (opening_[i]) {
        // NOTE [one open per shard]: another worker is mapping this shard now. Two workers
        // that need a shard at once (the first batches of an epoch in order both read the
        // first shard) each mapped and checked it, and one mapping was dropped: twice the
        // work, and on a cold page cache twice the header and metadata reads waited for
        // in turn. So the second waits for the first (it needs the shard either way), in
        // slices so a cancel is seen, and then looks again (mapped, failed, or its turn to
        // open it). Other shards are opened meanwhile by whoever needs them: the lock is
        // not held while a shard is opened.
        while (opening_[i] && !open_[i]) {
          if (cancel && cancel->load(std::memory_order_acquire))
            throw LoaderError(ErrorKind::kState, paths_[i], -1, "", "cancelled while waiting for the shard");
          cv_->wait_for(lk, std::chrono::milliseconds(50));
        }
        continue;
      }
      opening_[i] = 1;
      path = paths_[i];
    }
    // Opened outside the lock so one slow open does not stall other workers. Whatever ends
    // the attempt (mapped, failed, retried) clears the mark and wakes those waiting on it.
    struct OpeningMark {
      ShardSet* set;
      size_t i;
      bool cleared = false;
      void clear_locked() {
        set->opening_[i] = 0;
        cleared = true;
        set->cv_->notify_all();
      }
      ~OpeningMark() {
        if (cleared) return;
        std::lock_guard<std::mutex> g(set->mu_);
        clear_locked();
      }
    } mark{this, i};
    std::shared_ptr<const Shard> sh;
    try {
      const std::string& blob = schema_of_.empty() ? schema_blob_ : shard_schemas_[schema_of_[i]];
      sh = std::make_shared<const Shard>(path, bytes_[i], records_[i], blob, fields_, max_value_bytes_, read_ahead);
    } catch (const LoaderError& e) {
      // See NOTE [self-healing]: a cached copy that cannot be opened as the manifest says.
      const bool vanished = e.kind() == ErrorKind::kIO && e.sys_errno() == ENOENT;
      const bool healable = e.kind() == ErrorKind::kChecksum || e.kind() == ErrorKind::kFormat ||
                            e.kind() == ErrorKind::kSchema || vanished;
      std::string earlier;
      if (pending_set_ && healable && report_corrupt(i, nullptr, e.what(), &earlier, vanished)) continue;
      if (!earlier.empty())
        throw LoaderError(e.kind(), path, -1, "",
                          std::string(e.what()) +
                              "; the cached copy was discarded and fetched again after an earlier "
                              "failure (" +
                              earlier + "), and failed again",
                          e.sys_errno());
      throw;
    }
    std::shared_ptr<const Shard> drop;                // a mapping made stale meanwhile is unmapped outside the lock
    std::vector<std::shared_ptr<const Shard>> unmap;  // See NOTE [mapping bound]; unmapped after the lock too
    std::lock_guard<std::mutex> lk(mu_);
    mark.clear_locked();
    ++opens_;
    if (state_[i] != 0) {
      drop = std::move(sh);  // made pending again (healing) while we opened it: wait again
      continue;
    }
    if (!open_[i]) {
      if (!trusted_.empty() && trusted_[i].size != 0 && trusted_[i] == sh->identity()) {
        sh->mark_all_verified();  // See NOTE [verified files]
        reported_[i] = 1;
      }
      open_[i] = std::move(sh);
      if (++mapped_ > peak_mapped_) peak_mapped_ = mapped_;
      if (active_[i] == 0) make_idle_locked(i);
      if (max_mapped_ != 0) {
        if (mapped_before_[i]) ++remaps_;
        mapped_before_[i] = 1;
        touch_locked(i);
        enforce_bound_locked(i, &unmap);
      }
    } else {
      drop = std::move(sh);
    }
    return open_[i];
  }
}

void ShardSet::trust(size_t i, const FileIdentity& id) {
  std::lock_guard<std::mutex> lk(mu_);
  if (i >= paths_.size()) throw std::out_of_range("shard index out of range");
  if (trusted_.empty()) trusted_.resize(paths_.size());
  trusted_[i] = id;
}

std::vector<ShardSet::VerifiedShard> ShardSet::newly_verified() {
  std::vector<std::pair<size_t, std::shared_ptr<const Shard>>> open;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < open_.size(); ++i)
      if (open_[i] && !reported_[i]) open.emplace_back(i, open_[i]);
  }
  std::vector<VerifiedShard> out;
  for (auto& [i, sh] : open)
    if (sh->all_verified()) out.push_back(VerifiedShard{i, sh->identity(), sh->opened_ns()});
  std::lock_guard<std::mutex> lk(mu_);
  if (!out.empty() && trusted_.empty()) trusted_.resize(paths_.size());
  for (const VerifiedShard& v : out) {
    reported_[v.index] = 1;
    trusted_[v.index] = v.identity;  // a re-open of the same file (NOTE [mapping bound]) needs no hashing
  }
  return out;
}

ShardSet::~ShardSet() {
  // In a forked child the parent's workers may have been waiting on the condition
  // variables: leak them rather than block in their destructors.
  if (::getpid() != pid_) {
    (void)cv_.release();
    (void)events_cv_.release();
  }
}

void ShardSet::mark_ready(size_t i, std::string path) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= paths_.size()) throw std::out_of_range("shard index out of range");
    paths_[i] = std::move(path);
    state_[i] = 0;
  }
  cv_->notify_all();
}

void ShardSet::mark_failed(size_t i, std::string message, int sys_errno) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= paths_.size()) throw std::out_of_range("shard index out of range");
    if (open_[i]) return;  // already mapped: the failure of a re-fetch does not matter
    state_[i] = 2;
    failure_[i] = std::move(message);
    failure_errno_[i] = sys_errno;
  }
  cv_->notify_all();
}

bool ShardSet::retry(size_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  if (i >= paths_.size()) throw std::out_of_range("shard index out of range");
  if (!pending_set_ || state_[i] != 2) return false;
  state_[i] = 1;
  failure_[i].clear();
  failure_errno_[i] = 0;
  return true;
}

void ShardSet::make_idle_locked(size_t i) {
  if (in_idle_[i]) return;
  open_[i]->drop_span_file();  // NOTE [span descriptor]
  in_idle_[i] = 1;
  idle_prev_[i] = idle_tail_;
  idle_next_[i] = kNone;
  if (idle_tail_ != kNone) idle_next_[idle_tail_] = uint32_t(i);
  idle_tail_ = uint32_t(i);
  if (idle_head_ == kNone) idle_head_ = uint32_t(i);
  ++idle_count_;
}

void ShardSet::leave_idle_locked(size_t i) {
  if (!in_idle_[i]) return;
  in_idle_[i] = 0;
  uint32_t p = idle_prev_[i], n = idle_next_[i];
  if (p != kNone)
    idle_next_[p] = n;
  else
    idle_head_ = n;
  if (n != kNone)
    idle_prev_[n] = p;
  else
    idle_tail_ = p;
  idle_prev_[i] = idle_next_[i] = kNone;
  --idle_count_;
}

void ShardSet::touch_locked(size_t i) {
  if (in_use_list_[i]) {
    if (use_tail_ == uint32_t(i)) return;
    forget_locked(i);
  }
  in_use_list_[i] = 1;
  use_prev_[i] = use_tail_;
  use_next_[i] = kNone;
  if (use_tail_ != kNone) use_next_[use_tail_] = uint32_t(i);
  use_tail_ = uint32_t(i);
  if (use_head_ == kNone) use_head_ = uint32_t(i);
}

void ShardSet::forget_locked(size_t i) {
  if (!in_use_list_[i]) return;
  in_use_list_[i] = 0;
  uint32_t p = use_prev_[i], n = use_next_[i];
  if (p != kNone)
    use_next_[p] = n;
  else
    use_head_ = n;
  if (n != kNone)
    use_prev_[n] = p;
  else
    use_tail_ = p;
  use_prev_[i] = use_next_[i] = kNone;
}

void ShardSet::enforce_bound_locked(size_t keep, std::vector<std::shared_ptr<const Shard>>* unmap) {
  // See NOTE [mapping bound]: idle shards first, then the least recently used shard no worker
  // holds (a worker copies open_[s] under mu_, so use_count() == 1 means none does).
  while (mapped_ > max_mapped_) {
    uint32_t s = idle_head_;
    if (s == uint32_t(keep)) s = idle_next_[s];
    if (s == kNone)
      for (s = use_head_; s != kNone; s = use_next_[s])
        if (s != uint32_t(keep) && open_[s].use_count() == 1) break;
    if (s == kNone) return;  // every other mapped shard is held by a worker
    leave_idle_locked(s);
    forget_locked(s);
    unmap->push_back(std::move(open_[s]));
    --mapped_;
    ++unloads_;
  }
}

void ShardSet::retain(const std::vector<uint32_t>& shards) {
  std::lock_guard<std::mutex> lk(mu_);
  for (uint32_t s : shards) {
    if (s >= active_.size()) throw std::out_of_range("shard index out of range");
    if (active_[s]++ == 0) {
      ++active_shards_;
      leave_idle_locked(s);
    }
  }
}

void ShardSet::release(const std::vector<uint32_t>& shards) {
  std::vector<std::shared_ptr<const Shard>> unmap;  // destroyed (munmap) after the lock
  bool noted = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (uint32_t s : shards) {
      if (s >= active_.size() || active_[s] == 0) continue;  // never retained: nothing to undo
      if (--active_[s] != 0) continue;
      --active_shards_;
      if (open_[s]) make_idle_locked(s);
      if (pending_set_ && !release_noted_[s]) {
        release_noted_[s] = 1;
        events_.released.push_back(s);
        noted = true;
      }
    }
    if (!pending_set_) {
      while (idle_count_ > max_idle_) {
        uint32_t s = idle_head_;
        leave_idle_locked(s);
        if (max_mapped_ != 0) forget_locked(s);
        unmap.push_back(std::move(open_[s]));
        --mapped_;
        ++unloads_;
      }
    }
  }
  if (noted) events_cv_->notify_all();
}

void ShardSet::drop_span_file(size_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  if (i < open_.size() && open_[i]) open_[i]->drop_span_file();
}

bool ShardSet::unload(size_t i, bool force) {
  std::shared_ptr<const Shard> unmap;
  std::lock_guard<std::mutex> lk(mu_);
  if (i >= paths_.size()) throw std::out_of_range("shard index out of range");
  if (!pending_set_ || state_[i] != 0) return false;
  // A worker copies open_[i] under mu_, so use_count() == 1 here means no worker holds it.
  if (active_[i] != 0 && !(force && (!open_[i] || open_[i].use_count() == 1))) return false;
  leave_idle_locked(i);
  if (open_[i]) {
    unmap = std::move(open_[i]);
    --mapped_;
  }
  state_[i] = 1;
  ++unloads_;
  return true;
}

bool ShardSet::report_corrupt(size_t i, const Shard* bad, const std::string& message, std::string* earlier,
                              bool vanished) {
  std::shared_ptr<const Shard> unmap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (bad != nullptr ? open_[i].get() != bad : bool(open_[i])) return true;  // replaced meanwhile: retry
    if (state_[i] == 1) return true;                                           // a re-fetch is under way
    if (!pending_set_ || state_[i] != 0 || (healed_[i] && !vanished)) {
      if (earlier) *earlier = first_failure_[i];
      return false;
    }
    if (!vanished) {  // See NOTE [self-healing]: a vanished copy says nothing of the source
      healed_[i] = 1;
      first_failure_[i] = message;
    }
    leave_idle_locked(i);
    if (open_[i]) {
      unmap = std::move(open_[i]);
      --mapped_;
    }
    state_[i] = 1;
    ++heals_;
    events_.corrupt.emplace_back(uint32_t(i), message);
  }
  events_cv_->notify_all();
  return true;
}

ShardEvents ShardSet::wait_events(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  auto any = [&] { return !events_.released.empty() || !events_.corrupt.empty() || wait_gen_ != reported_wait_gen_; };
  if (!any() && timeout_ms > 0) events_cv_->wait_for(lk, std::chrono::milliseconds(timeout_ms), any);
  ShardEvents out;
  out.released.swap(events_.released);
  for (uint32_t s : out.released) release_noted_[s] = 0;
  out.corrupt.swap(events_.corrupt);
  for (size_t s = 0; s < waiters_.size(); ++s)
    if (waiters_[s] != 0) out.waiting.push_back(uint32_t(s));
  reported_wait_gen_ = wait_gen_;
  return out;
}

std::vector<uint32_t> ShardSet::waiting() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<uint32_t> out;
  for (size_t s = 0; s < waiters_.size(); ++s)
    if (waiters_[s] != 0) out.push_back(uint32_t(s));
  return out;
}

ShardSet::Counts ShardSet::counts() {
  std::lock_guard<std::mutex> lk(mu_);
  Counts c;
  c.mapped = mapped_;
  c.idle = idle_count_;
  c.active = active_shards_;
  c.heals = heals_;
  c.unloads = unloads_;
  c.peak_mapped = peak_mapped_;
  c.remaps = remaps_;
  c.opens = opens_;
  return c;
}

}  // namespace pyloader
