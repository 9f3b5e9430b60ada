#include "transport/proxy/coalesce.hpp"

#include <algorithm>

#include "transport/proxy/bounds.hpp"

namespace epx::proxy {

namespace {
/// Pitches past this stay separate copies (cudaMemcpy2D takes size_t
/// pitches; a huge one is no strided run worth the name).
constexpr uint64_t kMaxPitch = uint64_t{1} << 31;
}  // namespace

Coalescer::Coalescer(Engine& engine, int channel, int num_ranks, std::size_t max_queued)
    : engine_(engine),
      channel_(channel),
      max_queued_(max_queued < 1 ? 1 : max_queued),
      queues_(static_cast<std::size_t>(num_ranks)) {}

void Coalescer::put(int peer, int region, uint64_t dst_off, uint64_t src_off, uint64_t bytes) {
  if (peer < 0 || peer >= static_cast<int>(queues_.size())) {
    // Not a rank: let the engine refuse it with its own message, in order.
    flush_all();
    ++engine_puts_;
    engine_.put(channel_, peer, region, dst_off, src_off, bytes);
    return;
  }
  // Each put is checked as taken: merged with its neighbours, puts out of
  // bounds (offsets that wrap past 2^64) could add up to one copy in bounds.
  engine_.check_put(channel_, peer, region, dst_off, src_off, bytes);
  auto& q = queues_[static_cast<std::size_t>(peer)];
  if (q.empty()) busy_.push_back(peer);
  q.push_back(Put{region, dst_off, src_off, bytes});
  ++queued_;
  if (q.size() >= max_queued_) flush(peer);
}

void Coalescer::flush(int peer) {
  if (peer < 0 || peer >= static_cast<int>(queues_.size())) return;
  auto& q = queues_[static_cast<std::size_t>(peer)];
  if (q.empty()) return;
  // Taken out first: if the engine throws, the queue is empty and consistent.
  std::vector<Put> puts;
  puts.swap(q);
  busy_.erase(std::find(busy_.begin(), busy_.end(), peer));
  queued_ -= puts.size();
  issue(peer, puts);
}

void Coalescer::flush_all() {
  while (!busy_.empty()) flush(busy_.back());
}

void Coalescer::issue(int peer, std::vector<Put>& puts) {
  // Sorted by destination; puts whose destinations overlap keep their order
  // (the later one must win), so a queue with any overlap goes out as taken.
  std::vector<Put> sorted = puts;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Put& a, const Put& b) { return a.dst < b.dst; });
  // The sums below are checked too (an end past 2^64 counts as overlapping,
  // a run that would pass it ends), so merging never wraps.
  bool overlap = false;
  for (std::size_t i = 1; i < sorted.size() && !overlap; ++i) {
    uint64_t end = 0;
    overlap = !add_fits(sorted[i - 1].dst, sorted[i - 1].bytes, &end) || end > sorted[i].dst;
  }
  const std::vector<Put>& order = overlap ? puts : sorted;

  std::size_t i = 0;
  while (i < order.size()) {
    const Put& first = order[i];
    // A contiguous run: each put starts where the last ended, in both regions.
    uint64_t bytes = first.bytes;
    std::size_t j = i + 1;
    uint64_t dst_end = 0, src_end = 0, total = 0;
    while (!overlap && j < order.size() && order[j].region == first.region &&
           add_fits(first.dst, bytes, &dst_end) && add_fits(first.src, bytes, &src_end) &&
           order[j].dst == dst_end && order[j].src == src_end &&
           add_fits(bytes, order[j].bytes, &total)) {
      bytes = total;
      ++j;
    }
    if (j > i + 1) {
      ++engine_puts_;
      engine_.put(channel_, peer, first.region, first.dst, first.src, bytes);
      i = j;
      continue;
    }
    // A strided run: rows of one width at one pitch on each side.
    uint64_t rows = 1, dpitch = 0, spitch = 0;
    if (!overlap && i + 1 < order.size()) {
      const Put& second = order[i + 1];
      if (second.region == first.region && second.bytes == first.bytes && second.src > first.src) {
        dpitch = second.dst - first.dst;
        spitch = second.src - first.src;
        if (dpitch >= first.bytes && spitch >= first.bytes && dpitch < kMaxPitch &&
            spitch < kMaxPitch) {
          rows = 2;
          while (i + rows < order.size()) {
            const Put& next = order[i + rows];
            uint64_t dst_at = 0, src_at = 0;
            if (next.region != first.region || next.bytes != first.bytes ||
                __builtin_mul_overflow(rows, dpitch, &dst_at) ||
                __builtin_mul_overflow(rows, spitch, &src_at) ||
                !add_fits(first.dst, dst_at, &dst_at) || !add_fits(first.src, src_at, &src_at) ||
                next.dst != dst_at || next.src != src_at)
              break;
            ++rows;
          }
        }
      }
    }
    ++engine_puts_;
    if (rows > 1)
      engine_.put_strided(channel_, peer, first.region, first.dst, dpitch, first.src, spitch,
                          first.bytes, rows);
    else
      engine_.put(channel_, peer, first.region, first.dst, first.src, first.bytes);
    i += rows;
  }
}

}  // namespace epx::proxy
