// Native sequence packing: documents of a variable-length token field, read in plan order
// by a BatchPipeline, are concatenated into rows of exactly seq_len tokens on the packer's
// own thread, with what attention needs (document ids, position ids, cu_seqlens).
//
// NOTE [packing rule]: the input is a stream of *items*, each one document of the doc
// pipeline's plan with a token range [start, end) of it (end < 0: the document's end).
// An item is cut into *pieces* of at most seq_len tokens from its start (split=true: every
// piece but the last has exactly seq_len tokens, each piece is its own document for
// attention and its position ids start at 0; split=false: only the first piece is kept,
// the rest counted as truncated). Pieces enter a *window* of at most `lookahead` pieces in
// stream order. A row is built as:
//
//   refill the window; if it is empty the stream is done;
//   take the window's oldest piece;
//   repeat: refill the window; take the first piece (in stream order) that fits the
//           row's free tokens; stop when none fits;
//   pad the rest of the row with pad_id.
//
// lookahead=1 is greedy packing in plan order (a row closes at the first piece that does
// not fit); a larger window is first-fit over the next `lookahead` pieces, for less
// padding. The oldest piece always goes first, so no piece waits more than `lookahead`
// rows. Everything is a function of the stream of items and their lengths alone.
//
// NOTE [packing state]: after each batch the packer records where it stands: the *cursor*
// (the position of the item it splits next and the token it resumes at) and the window's
// pieces (position, start, length). Feeding a new packer the window's pieces as items,
// then the cursor item from its token, then the items after it, makes exactly the rows
// the first packer would have made next: the window refills with the same pieces in the
// same order. pyloader/loader/packing.py keeps these per batch for state_dict().
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/batch_pipeline.h"
#include "core/slot_pool.h"

namespace pyloader {

struct PackConfig {
  size_t seq_len = 0;      // tokens per row
  size_t rows = 1;         // rows per batch
  size_t lookahead = 1;    // window of pieces (1: greedy)
  bool split = true;       // false: a document longer than seq_len keeps its first seq_len tokens
  bool drop_last = false;  // drop a last batch of fewer than `rows` rows
  int prefetch = 2;        // packed batches made ahead of the consumer
  int64_t pad_id = 0;      // token value of padding
};

// See NOTE [packing state]: pieces are (position, start, length) triples.
struct PackState {
  int64_t cursor_pos = -1;  // position of the next item to split; -1: the stream is exhausted
  int64_t cursor_tok = 0;   // the token it resumes at
  std::vector<int64_t> window;
  uint64_t rows = 0;  // rows made so far by this packer
};

struct PackedBatch {
  Batch batch;      // fields: tokens [rows, seq_len], position_ids int64, document_ids int32, cu_seqlens int32 [n + 1]
  PackState state;  // after this batch
  size_t segments = 0;  // entries of cu_seqlens minus one
};

struct PackCounters {
  std::atomic<uint64_t> items{0};             // documents (items) taken from the doc pipeline
  std::atomic<uint64_t> pieces{0};            // pieces placed in rows
  std::atomic<uint64_t> split_items{0};       // items cut into more than one piece
  std::atomic<uint64_t> rows{0};              // rows made
  std::atomic<uint64_t> tokens{0};            // document tokens placed
  std::atomic<uint64_t> pad_tokens{0};        // padding tokens
  std::atomic<uint64_t> truncated_tokens{0};  // tokens dropped by split=false
  std::atomic<uint64_t> batches{0};
  std::atomic<uint64_t> pack_ns{0};        // packer thread time building rows
  std::atomic<uint64_t> input_wait_ns{0};  // packer thread time waiting for documents
  std::atomic<uint64_t> wait_ns{0};        // consumer time blocked in next()
};

class Packer {
 public:
  // `docs` reads the items' documents in stream order (one record per item); `field` is a
  // variable-length field with one value per token (dims [-1]). pos/start/end describe the
  // items (NOTE [packing rule]). `pool` has 4 fields.
  Packer(std::shared_ptr<BatchPipeline> docs, size_t field, std::shared_ptr<SlotPool> pool, std::vector<int64_t> pos,
         std::vector<int64_t> start, std::vector<int64_t> end, PackConfig cfg);
  ~Packer();
  Packer(const Packer&) = delete;
  Packer& operator=(const Packer&) = delete;

  enum class Next { kBatch, kEnd, kTimeout };
  // The next packed batch, waiting up to timeout_ms (< 0: forever). Rethrows the error that
  // stopped the packer (a document pipeline's LoaderError, a bad item) after the batches
  // made before it.
  Next next(PackedBatch* out, int64_t timeout_ms = -1);
  void close();
  const PackCounters& counters() const noexcept { return counters_; }
  const std::vector<FieldSpec>& out_fields() const noexcept { return out_fields_; }
  const PackConfig& config() const noexcept { return cfg_; }

 private:
  struct Piece {
    int64_t pos = 0;
    int64_t start = 0;
    int64_t len = 0;
    const uint8_t* data = nullptr;  // the piece's first token
    std::shared_ptr<Slot> hold;     // the doc batch it lives in
  };

  void run();
  // The next piece of the stream into *out; false when the stream is exhausted.
  bool next_piece(Piece* out);
  void refill();
  void snapshot(PackState* st) const;
  bool stopping() const { return stop_.load(std::memory_order_acquire); }

  std::shared_ptr<BatchPipeline> docs_;
  size_t field_;
  std::shared_ptr<SlotPool> pool_;
  std::vector<int64_t> pos_, start_, end_;
  PackConfig cfg_;
  size_t itemsize_ = 0;
  std::vector<FieldSpec> out_fields_;
  pid_t pid_;

  // Packer thread state (touched by that thread only).
  Batch doc_batch_;         // the doc batch being split
  size_t doc_row_ = 0;      // its next row
  size_t doc_off_ = 0;      // that row's first token (ragged batches)
  bool docs_done_ = false;  // the doc pipeline ended
  size_t item_ = 0;         // stream index of the item being split
  bool in_item_ = false;    // an item is being split
  int64_t item_tok_ = 0, item_end_ = 0;
  const uint8_t* item_data_ = nullptr;
  std::shared_ptr<Slot> item_hold_;
  std::deque<Piece> window_;

  std::mutex close_mu_;  // serialises close()
  std::mutex mu_;
  std::unique_ptr<std::condition_variable> cv_room_ = std::make_unique<std::condition_variable>();
  std::unique_ptr<std::condition_variable> cv_ready_ = std::make_unique<std::condition_variable>();
  std::deque<PackedBatch> ready_;
  bool done_ = false;
  std::exception_ptr error_;
  std::atomic<bool> stop_{false};
  bool closed_ = false;
  std::thread thread_;
  PackCounters counters_;
};

}  // namespace pyloader
