#include "core/packer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/errors.h"

namespace pyloader {
namespace {

// Writes n tokens of value v (its low bytes: the same value in any integer width) at dst.
void fill_tokens(uint8_t* dst, size_t n, size_t itemsize, int64_t v) {
  switch (itemsize) {
    case 1: std::fill_n(dst, n, uint8_t(v)); return;
    case 2: std::fill_n(reinterpret_cast<uint16_t*>(dst), n, uint16_t(v)); return;
    case 4: std::fill_n(reinterpret_cast<uint32_t*>(dst), n, uint32_t(v)); return;
    default: std::fill_n(reinterpret_cast<uint64_t*>(dst), n, uint64_t(v)); return;
  }
}

// Thrown on the packer thread when close() stops it mid-wait.
struct Stopped {};

FieldSpec out_field(const std::string& name, DType dtype, std::vector<int64_t> dims) {
  FieldSpec f;
  f.name = name;
  f.dtype = uint8_t(dtype);
  f.dims = std::move(dims);
  f.itemsize = dtype_itemsize(f.dtype);
  f.row_bytes = f.itemsize;
  return f;
}

}  // namespace

Packer::Packer(std::shared_ptr<BatchPipeline> docs, size_t field, std::shared_ptr<SlotPool> pool,
               std::vector<int64_t> pos, std::vector<int64_t> start, std::vector<int64_t> end, PackConfig cfg)
    : docs_(std::move(docs)),
      field_(field),
      pool_(std::move(pool)),
      pos_(std::move(pos)),
      start_(std::move(start)),
      end_(std::move(end)),
      cfg_(cfg),
      pid_(::getpid()) {
  if (!docs_) throw std::invalid_argument("the packer needs a document pipeline");
  const auto& fields = docs_->fields();
  if (field_ >= fields.size()) throw std::invalid_argument("the packed field is out of range");
  const FieldSpec& spec = fields[field_];
  if (!spec.variable || spec.dims.size() != 1 || spec.dtype == uint8_t(DType::kBytes))
    throw std::invalid_argument("field '" + spec.name + "' is not a variable-length field of one value per token");
  itemsize_ = spec.itemsize;
  if (cfg_.seq_len < 1 || cfg_.rows < 1 || cfg_.lookahead < 1 || cfg_.prefetch < 1)
    throw std::invalid_argument("seq_len, rows, lookahead and prefetch must be >= 1");
  if (cfg_.seq_len > (size_t(1) << 30) || cfg_.rows > (size_t(1) << 30) / cfg_.seq_len)
    throw std::invalid_argument("rows * seq_len must be below 2**30 (cu_seqlens are int32)");
  if (pos_.size() != start_.size() || pos_.size() != end_.size())
    throw std::invalid_argument("the item arrays differ in length");
  for (size_t i = 0; i < pos_.size(); ++i)
    if (start_[i] < 0 || (end_[i] >= 0 && end_[i] < start_[i]))
      throw std::invalid_argument("item " + std::to_string(i) + " has a bad token range");
  if (!pool_ || pool_->num_fields() != 4) throw std::invalid_argument("the packer's slot pool needs 4 fields");
  const int64_t s = int64_t(cfg_.seq_len);
  out_fields_ = {out_field(spec.name, DType(spec.dtype), {s}), out_field("position_ids", DType::kInt64, {s}),
                 out_field("document_ids", DType::kInt32, {s}), out_field("cu_seqlens", DType::kInt32, {-1})};
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    throw thread_start_error(e, "the packing thread");  // NOTE [thread start failure]
  }
}

Packer::~Packer() {
  close();
  if (::getpid() != pid_) {
    // Forked child: the parent's thread may have waited on these (NOTE [pipeline shutdown]).
    (void)cv_room_.release();
    (void)cv_ready_.release();
  }
}

void Packer::close() {
  if (::getpid() != pid_) {
    auto* leaked = new std::thread(std::move(thread_));
    (void)leaked;
    closed_ = true;
    return;
  }
  // A second close() waits for the first (its join), as CopyEngine::close() does: when any
  // close() returns the thread is joined, so ~Packer never destroys it joinable.
  std::lock_guard<std::mutex> closing(close_mu_);
  {
    // stop_ is set under mu_: the packer thread tests it under mu_ before it sleeps for
    // room (cv_room_), so the wake-up below cannot fall between its test and its sleep.
    // Set outside the lock, it could, and close() then joined a thread asleep for good
    // (a fresh-clone CI run hung there).
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    stop_.store(true, std::memory_order_release);
  }
  cv_room_->notify_all();
  cv_ready_->notify_all();
  // Closing the document pipeline first ends a wait of the packer thread in docs_->next()
  // at once (it raises there, which the stopping thread ignores).
  docs_->close();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lk(mu_);
  ready_.clear();
}

bool Packer::next_piece(Piece* out) {
  const FieldSpec& spec = docs_->fields()[field_];
  while (!in_item_) {
    if (!doc_batch_.slot || doc_row_ >= doc_batch_.rows) {
      doc_batch_ = Batch();
      if (docs_done_) return false;
      const uint64_t t0 = now_ns();
      Batch b;
      BatchPipeline::Next r;
      while ((r = docs_->next(&b, 100)) == BatchPipeline::Next::kTimeout)
        if (stopping()) throw Stopped{};
      counters_.input_wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
      if (r == BatchPipeline::Next::kEnd) {
        docs_done_ = true;
        if (item_ != pos_.size())
          throw LoaderError(ErrorKind::kState, "", -1, spec.name,
                            "the document stream ended after " + std::to_string(item_) +
                                " documents; the packing plan has " + std::to_string(pos_.size()));
        return false;
      }
      doc_batch_ = std::move(b);
      doc_row_ = 0;
      doc_off_ = 0;
    }
    if (item_ >= pos_.size())
      throw LoaderError(ErrorKind::kState, "", -1, spec.name,
                        "the document stream has more documents than the packing plan's " +
                            std::to_string(pos_.size()));
    const FieldView& v = doc_batch_.fields[field_];
    const int64_t n = v.lengths[doc_row_];
    // See NOTE [ragged batches]: rows back to back; a padded batch: rows of the longest length.
    const uint8_t* data = docs_->ragged() ? v.data + doc_off_ * itemsize_
                                          : v.data + doc_row_ * size_t(v.shape[1]) * itemsize_;
    doc_off_ += size_t(n);
    ++doc_row_;
    counters_.items.fetch_add(1, std::memory_order_relaxed);
    const int64_t s = start_[item_], e = end_[item_] < 0 ? n : end_[item_];
    if (e > n || s > e)
      throw LoaderError(ErrorKind::kState, "", -1, spec.name,
                        "packing item at position " + std::to_string(pos_[item_]) + " asks for tokens [" +
                            std::to_string(s) + ", " + std::to_string(e) + ") of a document of " + std::to_string(n) +
                            " tokens (a state taken on other data?)");
    if (s == e) {  // an empty document (or range) adds no piece
      ++item_;
      continue;
    }
    in_item_ = true;
    item_tok_ = s;
    item_end_ = e;
    item_data_ = data;
    item_hold_ = doc_batch_.slot;
    if (cfg_.split && e - s > int64_t(cfg_.seq_len)) counters_.split_items.fetch_add(1, std::memory_order_relaxed);
  }
  const int64_t len = std::min<int64_t>(int64_t(cfg_.seq_len), item_end_ - item_tok_);
  out->pos = pos_[item_];
  out->start = item_tok_;
  out->len = len;
  out->data = item_data_ + size_t(item_tok_) * itemsize_;
  out->hold = item_hold_;
  item_tok_ += len;
  if (!cfg_.split && item_tok_ < item_end_) {
    counters_.truncated_tokens.fetch_add(uint64_t(item_end_ - item_tok_), std::memory_order_relaxed);
    item_tok_ = item_end_;
  }
  if (item_tok_ == item_end_) {
    in_item_ = false;
    item_hold_.reset();
    ++item_;
  }
  return true;
}

void Packer::refill() {
  Piece p;
  while (window_.size() < cfg_.lookahead && next_piece(&p)) window_.push_back(std::move(p));
}

void Packer::snapshot(PackState* st) const {
  if (in_item_) {
    st->cursor_pos = pos_[item_];
    st->cursor_tok = item_tok_;
  } else if (item_ < pos_.size()) {
    st->cursor_pos = pos_[item_];
    st->cursor_tok = start_[item_];
  } else {
    st->cursor_pos = -1;
    st->cursor_tok = 0;
  }
  st->window.clear();
  st->window.reserve(window_.size() * 3);
  for (const Piece& p : window_) {
    st->window.push_back(p.pos);
    st->window.push_back(p.start);
    st->window.push_back(p.len);
  }
  st->rows = counters_.rows.load(std::memory_order_relaxed);
}

void Packer::run() {
  const size_t S = cfg_.seq_len, R = cfg_.rows;
  try {
    for (size_t index = 0;; ++index) {
      if (stopping()) return;
      std::shared_ptr<Slot> slot = pool_->acquire(nullptr, &stop_);
      if (!slot) return;
      const uint64_t t0 = now_ns();
      uint64_t waited0 = counters_.input_wait_ns.load(std::memory_order_relaxed);
      slot->data[0].reserve(R * S * itemsize_);
      slot->data[1].reserve(R * S * sizeof(int64_t));
      slot->data[2].reserve(R * S * sizeof(int32_t));
      slot->data[3].reserve((R * S + 1) * sizeof(int32_t));
      uint8_t* tok = slot->data[0].data();
      auto* posid = reinterpret_cast<int64_t*>(slot->data[1].data());
      auto* docid = reinterpret_cast<int32_t*>(slot->data[2].data());
      auto* cu = reinterpret_cast<int32_t*>(slot->data[3].data());
      size_t seg = 0;
      cu[0] = 0;
      int32_t piece_id = 0;
      uint64_t placed_tokens = 0, pad_tokens = 0, pieces = 0;
      size_t r = 0;
      for (; r < R; ++r) {
        refill();
        if (window_.empty()) break;
        uint8_t* row_tok = tok + r * S * itemsize_;
        int64_t* row_pos = posid + r * S;
        int32_t* row_doc = docid + r * S;
        size_t used = 0;
        auto place = [&](const Piece& p) {
          const size_t n = size_t(p.len);
          std::memcpy(row_tok + used * itemsize_, p.data, n * itemsize_);
          for (size_t k = 0; k < n; ++k) {
            row_pos[used + k] = int64_t(k);
            row_doc[used + k] = piece_id;
          }
          ++piece_id;
          ++seg;
          cu[seg] = cu[seg - 1] + int32_t(n);
          used += n;
          placed_tokens += n;
          ++pieces;
        };
        place(window_.front());
        window_.pop_front();
        for (;;) {
          refill();
          auto it = std::find_if(window_.begin(), window_.end(),
                                 [&](const Piece& p) { return size_t(p.len) <= S - used; });
          if (it == window_.end()) break;
          place(*it);
          window_.erase(it);
        }
        if (used < S) {  // padding: its own segment, document id -1, position 0
          const size_t n = S - used;
          fill_tokens(row_tok + used * itemsize_, n, itemsize_, cfg_.pad_id);
          std::fill_n(row_pos + used, n, int64_t(0));
          std::fill_n(row_doc + used, n, int32_t(-1));
          ++seg;
          cu[seg] = cu[seg - 1] + int32_t(n);
          pad_tokens += n;
        }
      }
      const uint64_t waited = counters_.input_wait_ns.load(std::memory_order_relaxed) - waited0;
      const uint64_t spent = now_ns() - t0;
      counters_.pack_ns.fetch_add(spent > waited ? spent - waited : 0, std::memory_order_relaxed);
      const bool last = r < R;
      if (r == 0 || (last && cfg_.drop_last)) break;
      counters_.rows.fetch_add(r, std::memory_order_relaxed);
      counters_.tokens.fetch_add(placed_tokens, std::memory_order_relaxed);
      counters_.pad_tokens.fetch_add(pad_tokens, std::memory_order_relaxed);
      counters_.pieces.fetch_add(pieces, std::memory_order_relaxed);
      counters_.batches.fetch_add(1, std::memory_order_relaxed);
      PackedBatch pb;
      pb.batch.index = index;
      pb.batch.rows = r;
      pb.batch.slot = std::move(slot);
      pb.batch.fields.resize(4);
      const int64_t rows = int64_t(r), s = int64_t(S);
      pb.batch.fields[0] = FieldView{{rows, s}, tok, nullptr};
      pb.batch.fields[1] = FieldView{{rows, s}, reinterpret_cast<uint8_t*>(posid), nullptr};
      pb.batch.fields[2] = FieldView{{rows, s}, reinterpret_cast<uint8_t*>(docid), nullptr};
      pb.batch.fields[3] = FieldView{{int64_t(seg) + 1}, reinterpret_cast<uint8_t*>(cu), nullptr};
      pb.segments = seg;
      snapshot(&pb.state);
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_room_->wait(lk, [&] { return stopping() || ready_.size() < size_t(cfg_.prefetch); });
        if (stopping()) return;
        ready_.push_back(std::move(pb));
      }
      cv_ready_->notify_all();
      if (last) break;
    }
  } catch (const Stopped&) {
    return;
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = std::current_exception();
  }
  // Pieces hold doc batch slots; let them go before the pipeline is closed.
  window_.clear();
  item_hold_.reset();
  doc_batch_ = Batch();
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
  }
  cv_ready_->notify_all();
}

Packer::Next Packer::next(PackedBatch* out, int64_t timeout_ms) {
  if (::getpid() != pid_)
    throw LoaderError(ErrorKind::kState, "", -1, "",
                      "iterator used in a forked child; create a new iterator after fork");
  const uint64_t t0 = now_ns();
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError(ErrorKind::kState, "", -1, "", "iterator is closed");
  auto ready = [&] { return !ready_.empty() || done_ || closed_; };
  if (timeout_ms < 0) {
    cv_ready_->wait(lk, ready);
  } else if (!cv_ready_->wait_for(lk, std::chrono::milliseconds(timeout_ms), ready)) {
    counters_.wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return Next::kTimeout;
  }
  counters_.wait_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  if (!ready_.empty()) {
    *out = std::move(ready_.front());
    ready_.pop_front();
    lk.unlock();
    cv_room_->notify_all();
    return Next::kBatch;
  }
  if (closed_) throw LoaderError(ErrorKind::kState, "", -1, "", "iterator was closed while waiting");
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    lk.unlock();
    std::rethrow_exception(e);
  }
  return Next::kEnd;
}

}  // namespace pyloader
