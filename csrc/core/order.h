// Epoch orders computed natively (NOTE [native global order] in order.cpp): the positions of
// a global shuffle one reader needs, and the (shard, record) of global sample ids.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyloader {

// splitmix64's finalizer and its inverse (pyloader/read/order.py: mix64, _unmix64).
inline uint64_t mix64(uint64_t z) noexcept {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t unmix64(uint64_t z) noexcept;

// out[0, hi - lo) = positions [lo, hi) of the ids 0..n-1 sorted by mix64(id ^ state):
// epoch_order(...)[lo:hi] of a global shuffle whose key state is `state`. lo <= hi <= n.
void global_order(uint64_t n, uint64_t state, uint64_t lo, uint64_t hi, int64_t* out);

// For each of the m ids (each in [0, ends[num_shards - 1])): the shard whose range
// [ends[s - 1], ends[s]) holds it (empty shards never do) and the record within it.
// `ends`: the running sum of records per shard. Returns false, with *bad the first id out
// of range, if an id is outside [0, total).
bool locate_ids(const int64_t* ids, size_t m, const int64_t* ends, size_t num_shards, int32_t* shard, int64_t* record,
                int64_t* bad) noexcept;

}  // namespace pyloader
