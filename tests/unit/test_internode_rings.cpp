// The ring dispatch's region and signals (common/internode_rings.hpp): every
// area and slot inside the region, none overlapping; every ring signal id
// distinct, after the other families' ids and inside the pool (and the
// region's signal words); slots that stay continuous where a 32-bit index
// would wrap; bad geometry named by its Config field. No GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/internode_rings.hpp"
#include "common/ring.hpp"
#include "epx/error.hpp"

namespace {

using epx::Topology;
using epx::plan::HtRingBase;
using epx::plan::HtRingGeometry;
using epx::plan::HtRingRegion;
using epx::plan::HtRingSignal;

struct Span {
  std::size_t begin, end;
  std::string what;
};

/// Every word and slot of `r` as spans; checked pairwise for overlap and
/// against the region's size.
std::vector<Span> spans_of(const HtRingRegion& r) {
  const int C = r.geometry.channels, N = r.num_nodes(), L = r.ranks_per_node, R = r.num_ranks;
  std::vector<Span> s;
  // The whole-call header the rings follow (the barrier's counts, signals, shapes).
  s.push_back({0, epx::plan::HtNetRegion::body(R), "header"});
  // Every ring signal id's words, through the ring kernel's signal base.
  for (int k = 0; k < static_cast<int>(HtRingSignal::kKinds); ++k)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < R; ++p) {
        const int id = epx::plan::ht_ring_signal(R, static_cast<HtRingSignal>(k), c, p);
        const std::size_t w = r.signals + 8u * static_cast<std::size_t>(id) * epx::kMaxContexts;
        s.push_back({w, w + 8u * epx::kMaxContexts, "ring signal"});
      }
  for (int k = 0; k < static_cast<int>(HtRingBase::kKinds); ++k)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < r.width(); ++i) {
        const std::size_t w = r.base_word(static_cast<HtRingBase>(k), c, i);
        s.push_back({w, w + 8, "base " + std::to_string(k)});
      }
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < L; ++l) {
      s.push_back({r.nvl_tail(c, l), r.nvl_tail(c, l) + 8, "nvl tail"});
      s.push_back({r.nvl_head(c, l), r.nvl_head(c, l) + 8, "nvl head"});
      // The NVLink area: the dispatch's rings per forwarder, or the
      // combine's return rings per (local rank, node)
      if (!r.combine) {
        for (int i = 0; i < r.geometry.nvl_slots; ++i) {
          const std::size_t a = r.nvl_slot(c, l, static_cast<uint64_t>(i));
          s.push_back({a, a + r.record_bytes, "nvl slot"});
        }
      } else {
        for (int m = 0; m < N; ++m)
          for (int i = 0; i < r.ret_slots(); ++i) {
            const std::size_t a = r.ret_slot(c, l, m, static_cast<uint64_t>(i));
            s.push_back({a, a + r.record_bytes, "return slot"});
          }
      }
    }
  // The return rings' words, for every channel the state block holds
  for (int c = 0; c < epx::plan::kMaxRingChannels; ++c)
    for (int l = 0; l < L; ++l)
      for (int m = 0; m < N; ++m)
        for (std::size_t area : {r.ret_tails, r.ret_heads, r.ret_sent, r.ret_taken}) {
          const std::size_t w = r.ret_word(area, c, l, m);
          s.push_back({w, w + 8, "return word"});
        }
  for (int c = 0; c < C; ++c) {
    for (int l = 0; l < L; ++l)
      s.push_back({r.nvl_header(c, l), r.nvl_header(c, l) + 8, "nvl header"});
    // A header as its put writes and reads it (pad word included).
    for (int m = 0; m < N; ++m) {
      const std::size_t a = r.net_header(c, m, 0), b = r.header_send_word(c, m, 0);
      s.push_back({a, a + r.net_header_bytes(), "net header"});
      s.push_back({b, b + r.net_header_bytes(), "header send"});
    }
  }
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < N; ++m)
      for (int i = 0; i < r.geometry.net_slots; ++i) {
        const std::size_t a = r.net_slot(c, m, static_cast<uint64_t>(i));
        const std::size_t b = r.net_send_slot(c, m, static_cast<uint64_t>(i));
        s.push_back({a, a + r.record_bytes, "net slot"});
        s.push_back({b, b + r.record_bytes, "net send slot"});
      }
  // A num_worst_tokens dispatch's count rows: R sources' and this rank's own
  const std::size_t ci =
      static_cast<std::size_t>(epx::plan::HtNetRegion::count_row_ints(R, N)) * 4u;
  s.push_back({r.count_rows, r.count_rows + ci * (static_cast<std::size_t>(R) + 1), "count rows"});
  return s;
}

TEST(InternodeRings, AreasAndSlotsAreDisjointAndInside) {
  struct Case {
    int R, L;
    HtRingGeometry g;
    std::size_t record;
  };
  for (const Case& k : {Case{2, 1, {1, 4, 2, 3, 1}, 64}, Case{4, 2, {2, 5, 3, 4, 4}, 128},
                        Case{8, 4, {3, 7, 7, 2, 1}, 7200}, Case{16, 2, {4, 3, 1, 5, 2}, 48},
                        Case{16, 8, {2, 2, 2, 3, 3}, 16}}) {
    const std::size_t region = std::size_t{64} << 20;
    for (const bool combine : {false, true}) {
      const HtRingRegion r =
          combine ? HtRingRegion::make_combine(Topology{k.R, k.L}, k.g, k.record,
                                               epx::plan::HtNetRegion::body(k.R), region)
                  : HtRingRegion::make(Topology{k.R, k.L}, k.g, k.record,
                                       epx::plan::HtNetRegion::body(k.R), region);
      EXPECT_EQ(r.combine, combine);
      EXPECT_GE(r.ret_slots(), 1);
      EXPECT_LE(r.total, region);
      EXPECT_EQ(r.total - r.state, HtRingRegion::state_bytes(Topology{k.R, k.L}))
          << "the state block's size is the same wherever it lies";
      EXPECT_GE(r.state, r.rings_end);
      auto s = spans_of(r);
      std::sort(s.begin(), s.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
      for (std::size_t i = 0; i < s.size(); ++i) {
        ASSERT_LE(s[i].end, r.total) << s[i].what << " R" << k.R;
        if (i > 0)
          ASSERT_LE(s[i - 1].end, s[i].begin)
              << s[i - 1].what << " overlaps " << s[i].what << " R" << k.R << " L" << k.L;
      }
      // The areas after the header start aligned.
      for (std::size_t a :
           {r.ring_signals, r.bases, r.nvl_tails, r.nvl_heads, r.net_headers, r.nvl_headers,
            r.header_send, r.count_rows, r.net_rings, r.net_send, r.nvl_rings, r.ret_tails,
            r.ret_heads, r.ret_sent, r.ret_taken, r.total})
        EXPECT_EQ(a % epx::plan::kAlign, 0u);
    }
  }
}

/// The layout word the dispatch barrier compares: positive (0 means no
/// rings), the same for the same rings, and different when anything that
/// moves a ring differs between ranks: the channel count (config.num_sms),
/// a ring or chunk size (EPX_HT_RINGS), the record size, the region's size
/// (num_nvl_bytes: the state block and the NVLink rings move).
TEST(InternodeRings, LayoutWordTellsApartWhatMovesARing) {
  const Topology topo{4, 2};
  const std::size_t record = 7200, region = std::size_t{64} << 20;
  const std::size_t header = epx::plan::HtNetRegion::body(4);
  const HtRingGeometry g{3, 8, 4, 6, 2};
  auto word = [&](const HtRingGeometry& geo, std::size_t rec, std::size_t bytes) {
    return HtRingRegion::make(topo, geo, rec, header, bytes).layout_word();
  };
  const int base = word(g, record, region);
  EXPECT_GT(base, 0);
  EXPECT_EQ(word(g, record, region), base) << "the same rings, the same word";
  std::vector<int> others;
  for (HtRingGeometry h :
       {HtRingGeometry{4, 8, 4, 6, 2}, HtRingGeometry{3, 9, 4, 6, 2}, HtRingGeometry{3, 8, 3, 6, 2},
        HtRingGeometry{3, 8, 4, 7, 2}, HtRingGeometry{3, 8, 4, 6, 1}})
    others.push_back(word(h, record, region));
  others.push_back(word(g, record + 16, region));
  others.push_back(word(g, record, region + 4096));
  // the combine's rings (other NVLink rings) against the dispatch's
  others.push_back(HtRingRegion::make_combine(topo, g, record, header, region).layout_word());
  for (std::size_t i = 0; i < others.size(); ++i) {
    EXPECT_GT(others[i], 0) << i;
    EXPECT_NE(others[i], base) << "variant " << i << " would meet the base rings unnoticed";
  }
}

/// The combine's return rings share the NVLink ring's records among the
/// nodes (at least one each), and rings that do not fit are named as the
/// combine's, with the field to raise.
TEST(InternodeRings, CombineRingsShareTheNvlinkRecordsAndNameTheCombine) {
  const std::size_t header = epx::plan::HtNetRegion::body(8);
  const HtRingGeometry g{2, 8, 4, 12, 2};
  const HtRingRegion r =
      HtRingRegion::make_combine(Topology{8, 2}, g, 14368, header, std::size_t{64} << 20);
  EXPECT_EQ(r.ret_slots(), 3);  // 12 records over 4 nodes
  const HtRingRegion one = HtRingRegion::make_combine(Topology{8, 2}, HtRingGeometry{2, 8, 4, 2, 1},
                                                      14368, header, std::size_t{64} << 20);
  EXPECT_EQ(one.ret_slots(), 1);
  try {
    HtRingRegion::make_combine(Topology{8, 2}, g, 14368, header, std::size_t{1} << 20);
    FAIL() << "rings of 1 MiB and more fitted 1 MiB";
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.code(), epx::ErrorCode::kBufferTooSmall);
    const std::string what = e.what();
    EXPECT_NE(what.find("combine"), std::string::npos) << what;
    EXPECT_NE(what.find("num_nvl_bytes"), std::string::npos) << what;
  }
}

/// Every offset the ring kernel accesses with a vector or 64-bit word is a
/// multiple of its width, as GPUs require (cudaErrorMisalignedAddress
/// otherwise): records and the header puts are 16-byte copies between
/// same-node ranks (lsa_copy: int4 loads and stores of bytes / 16 units, so
/// the size is a multiple of 16 too), counters, tails, heads and tagged
/// header words are u64. Swept over topologies (2 nodes of 2 ranks: the
/// in-process GPU run whose every header put at node 1 started 8 B off 16),
/// channel counts, ring sizes, the suites' record shapes and region sizes
/// that are not multiples of 16 (the state block is placed from the end).
TEST(InternodeRings, VectorAndWordAccessesAreAligned) {
  struct Topo {
    int R, L;
  };
  auto at = [](const char* what, std::size_t off, std::size_t width) {
    if (off % width == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << " at " << off << " (" << off % width
                                         << " past a multiple of " << width << ")";
  };
  for (const Topo tp : {Topo{2, 1}, Topo{4, 1}, Topo{4, 2}, Topo{4, 4}, Topo{6, 3}, Topo{8, 2},
                        Topo{8, 4}, Topo{16, 8}, Topo{24, 6}, Topo{10, 5}}) {
    const Topology topology{tp.R, tp.L};
    // The Internode suites' rows: BF16 256..8192 and 7168, FP8 7168 with
    // its 56 scales, top-k 0, 4, 6 and 8.
    for (const auto& [hidden_bytes, S, K] : {std::tuple<int, int, int>{512, 0, 8},
                                             {5760, 0, 8},
                                             {14336, 0, 8},
                                             {7168, 56, 8},
                                             {4096, 16, 6},
                                             {8192, 0, 4},
                                             {512, 0, 0}}) {
      const std::size_t record =
          epx::plan::ht_net_record_bytes(static_cast<std::size_t>(hidden_bytes), S, K, tp.L);
      for (const int C : {1, 3, 6, 44})
        for (const int slots : {1, 4, 5}) {
          const HtRingGeometry g{C, slots, std::min(slots, 2), slots, std::min(slots, 3)};
          for (const std::size_t extra : {std::size_t{0}, std::size_t{4}, std::size_t{8},
                                          std::size_t{24}, std::size_t{4100}}) {
            const std::size_t region = (std::size_t{512} << 20) + extra;
            const HtRingRegion r =
                HtRingRegion::make(topology, g, record, epx::plan::HtNetRegion::body(tp.R), region);
            const int N = r.num_nodes(), L = r.ranks_per_node;
            SCOPED_TRACE("R" + std::to_string(tp.R) + " L" + std::to_string(tp.L) + " C" +
                         std::to_string(C) + " record " + std::to_string(record) + " region " +
                         std::to_string(region));
            ASSERT_TRUE(at("record_bytes", r.record_bytes, 16));
            ASSERT_TRUE(at("state", r.state, 16));
            ASSERT_TRUE(at("header put bytes", r.net_header_bytes(), 16));
            ASSERT_GE(r.net_header_bytes(), 8u * (1u + L)) << "the put must carry every word";
            for (int k = 0; k < static_cast<int>(HtRingBase::kKinds); ++k)
              for (int i = 0; i < r.width(); ++i)
                ASSERT_TRUE(at("base", r.base_word(static_cast<HtRingBase>(k), C - 1, i), 8));
            for (int k = 0; k < static_cast<int>(HtRingSignal::kKinds); ++k) {
              const int id =
                  epx::plan::ht_ring_signal(tp.R, static_cast<HtRingSignal>(k), C - 1, tp.R - 1);
              ASSERT_TRUE(at("signal word",
                             r.signals + 8u * static_cast<std::size_t>(id) * epx::kMaxContexts, 8));
            }
            for (int c = 0; c < C; ++c) {
              for (int l = 0; l < L; ++l) {
                ASSERT_TRUE(at("nvl tail", r.nvl_tail(c, l), 8));
                ASSERT_TRUE(at("nvl head", r.nvl_head(c, l), 8));
                ASSERT_TRUE(at("nvl header", r.nvl_header(c, l), 8));
                for (int i = 0; i < slots; ++i)
                  ASSERT_TRUE(at("nvl slot", r.nvl_slot(c, l, static_cast<uint64_t>(i)), 16));
              }
              for (int m = 0; m < N; ++m) {
                ASSERT_TRUE(at("net header put (to)", r.net_header(c, m, 0), 16));
                ASSERT_TRUE(at("net header put (from)", r.header_send_word(c, m, 0), 16));
                for (int w = 0; w <= L; ++w) {
                  ASSERT_TRUE(at("net header word", r.net_header(c, m, w), 8));
                  ASSERT_LT(r.net_header(c, m, w), r.net_header(c, m, 0) + r.net_header_bytes());
                }
                for (int i = 0; i < slots; ++i) {
                  ASSERT_TRUE(at("net slot", r.net_slot(c, m, static_cast<uint64_t>(i)), 16));
                  ASSERT_TRUE(
                      at("net send slot", r.net_send_slot(c, m, static_cast<uint64_t>(i)), 16));
                }
              }
            }
          }
        }
    }
  }
}

TEST(InternodeRings, SignalIdsAreDistinctAndInsideThePool) {
  for (int R : {2, 4, 16, 64, epx::kMaxRanks}) {
    std::set<int> ids;
    for (int k = 0; k < static_cast<int>(HtRingSignal::kKinds); ++k)
      for (int c = 0; c < epx::plan::kMaxRingChannels; ++c)
        for (int p = 0; p < R; ++p) {
          const int id = epx::plan::ht_ring_signal(R, static_cast<HtRingSignal>(k), c, p);
          ASSERT_GE(id, epx::plan::kSignalKindsAll * R) << "collides with the other families";
          ASSERT_LT(id, epx::plan::ht_ring_signal_count(R));
          ASSERT_TRUE(ids.insert(id).second) << "id " << id << " twice";
        }
    // NCCL GIN's signal pool per communicator holds 65536 ids (num_signals), one kept.
    EXPECT_LE(epx::plan::ht_ring_signal_count(R) + 1, 65536) << "R " << R;
  }
}

TEST(InternodeRings, SlotsStayContinuousPastA32BitIndex) {
  const HtRingRegion r = HtRingRegion::make(Topology{4, 2}, HtRingGeometry{2, 6, 3, 5, 2}, 32,
                                            epx::plan::HtNetRegion::body(4), std::size_t{8} << 20);
  const uint64_t starts[] = {0, (uint64_t{1} << 32) - 7, (uint64_t{1} << 40) + 3};
  for (uint64_t i0 : starts)
    for (uint64_t i = i0; i < i0 + 20; ++i) {
      const std::size_t a = r.net_slot(1, 1, i), b = r.net_slot(1, 1, i + 1);
      if ((i + 1) % 6 != 0) ASSERT_EQ(b, a + r.record_bytes) << "index " << i;
      if ((i + 1) % 6 == 0) ASSERT_EQ(b, r.net_slot(1, 1, 0)) << "index " << i;
      const std::size_t x = r.nvl_slot(1, 0, i), y = r.nvl_slot(1, 0, i + 1);
      if ((i + 1) % 5 != 0) ASSERT_EQ(y, x + r.record_bytes) << "index " << i;
      if ((i + 1) % 5 == 0) ASSERT_EQ(y, r.nvl_slot(1, 0, 0)) << "index " << i;
    }
}

TEST(InternodeRings, RingArithmeticWithLifetimeIndexes) {
  // A ring of 6 slots: the 32-bit index jumps at its wrap (2^32 % 6 = 4),
  // the 64-bit one does not.
  const uint32_t cap = 6;
  const uint32_t last32 = 0xffffffffu;
  EXPECT_NE((epx::ring::slot(last32, cap) + 1) % cap, epx::ring::slot(last32 + 1u, cap))
      << "the 32-bit wrap is expected to jump for a capacity that is not a power of two";
  const uint64_t last = 0xffffffffull;
  EXPECT_EQ((epx::ring::slot64(last, cap) + 1) % cap, epx::ring::slot64(last + 1, cap));
  for (uint64_t i = last - 20; i < last + 20; ++i) {
    const uint32_t s = epx::ring::slot64(i, cap);
    ASSERT_LT(s, cap);
    ASSERT_EQ(s, static_cast<uint32_t>(i % cap));
    ASSERT_EQ(epx::ring::contiguous64(i, 100u, cap), cap - s);
    ASSERT_EQ(epx::ring::contiguous64(i, 1u, cap), 1u);
  }
}

/// An op's geometry from EPX_HT_RINGS, the SMs and the config's RDMA fields.
TEST(InternodeRings, GeometryFromTheSwitchSmsAndConfig) {
  auto expect = [](const HtRingGeometry& g, int channels, int net_slots, int net_chunk,
                   int nvl_slots, int nvl_chunk) {
    EXPECT_EQ(g.channels, channels);
    EXPECT_EQ(g.net_slots, net_slots);
    EXPECT_EQ(g.net_chunk, net_chunk);
    EXPECT_EQ(g.nvl_slots, nvl_slots);
    EXPECT_EQ(g.nvl_chunk, nvl_chunk);
  };
  expect(HtRingGeometry::of(1, 24, 0, 0), 8, 256, 48, 256, 8);  // the defaults
  expect(HtRingGeometry::of(1, 2, 0, 0), 1, 256, 48, 256, 8);   // at least one channel
  expect(HtRingGeometry::of(1, 600, 0, 0), epx::plan::kMaxRingChannels, 256, 48, 256, 8);
  expect(HtRingGeometry::of(4, 24, 0, 0), 8, 4, 4, 4, 4);          // rings of 4
  expect(HtRingGeometry::of(1, 24, 24, 128), 8, 128, 24, 256, 8);  // DeepEP's fields
  expect(HtRingGeometry::of(1, 24, 0, 32), 8, 32, 32, 256, 8);     // a default put cut to the ring
  expect(HtRingGeometry::of(4, 24, 0, 128), 8, 128, 4, 4, 4);
  // Knowing the record size, a default put carries about 1 MiB, at most half
  // the network ring: BF16 records at hidden 7168, top-8, 2 ranks per node
  // (14432 B) 72 a put, FP8 ones (7488 B) 140 cut to 128; tiny records half
  // the ring, huge ones 1.
  const std::size_t bf16 = epx::plan::ht_net_record_bytes(2 * 7168, 0, 8, 2);
  const std::size_t fp8 = epx::plan::ht_net_record_bytes(7168, 7168 / 128, 8, 2);
  EXPECT_EQ(bf16, 14432u);
  EXPECT_EQ(fp8, 7488u);
  expect(HtRingGeometry::of(1, 24, 0, 0, bf16), 8, 256, 72, 256, 8);
  expect(HtRingGeometry::of(1, 24, 0, 0, fp8), 8, 256, 128, 256, 8);
  expect(HtRingGeometry::of(1, 24, 0, 64, 1024), 8, 64, 32, 256, 8);
  expect(HtRingGeometry::of(1, 24, 0, 0, std::size_t{4} << 20), 8, 256, 1, 256, 8);
  expect(HtRingGeometry::of(1, 24, 0, 1, 1024), 8, 1, 1, 256, 8);  // a ring of one record
  // DeepEP's field and rings of N keep their put size whatever the records
  expect(HtRingGeometry::of(1, 24, 24, 0, bf16), 8, 256, 24, 256, 8);
  expect(HtRingGeometry::of(4, 24, 0, 0, bf16), 8, 4, 4, 4, 4);
  for (std::size_t bytes : {std::size_t{16}, std::size_t{1000}, bf16, fp8, std::size_t{300000}}) {
    const HtRingGeometry g = HtRingGeometry::of(1, 24, 0, 0, bytes);
    EXPECT_NO_THROW(g.validate()) << bytes;
    EXPECT_LE(static_cast<std::size_t>(g.net_chunk) * bytes,
              std::max(HtRingGeometry::kDefaultPutBytes, bytes))
        << bytes;
  }
  // A put larger than the ring is kept, and named where the rings are made
  const HtRingGeometry big = HtRingGeometry::of(1, 24, 300, 0);
  EXPECT_EQ(big.net_chunk, 300);
  try {
    big.validate();
    ADD_FAILURE() << "no error for a put larger than the ring";
  } catch (const epx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_max_rdma_chunked_send_tokens"), std::string::npos)
        << e.what();
  }
}

TEST(InternodeRings, BadGeometryIsNamed) {
  auto expect_named = [](HtRingGeometry g, std::size_t record, const std::string& field) {
    try {
      (void)HtRingRegion::make(Topology{4, 2}, g, record, epx::plan::HtNetRegion::body(4),
                               std::size_t{8} << 20);
      ADD_FAILURE() << "no error for " << field;
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.code(), epx::ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_named({0, 4, 2, 4, 2}, 64, "num_sms");
  expect_named({1, 0, 1, 4, 2}, 64, "num_max_rdma_chunked_recv_tokens");
  expect_named({1, 4, 5, 4, 2}, 64, "num_max_rdma_chunked_send_tokens");
  expect_named({1, 4, 0, 4, 2}, 64, "num_max_rdma_chunked_send_tokens");
  expect_named({1, 4, 2, 0, 1}, 64, "num_max_nvl_chunked_recv_tokens");
  expect_named({1, 4, 2, 4, 5}, 64, "num_max_nvl_chunked_send_tokens");
  expect_named({1, 4, 2, 4, 2}, 40, "record_bytes");
  // A region without room for the rings and their state: named, kBufferTooSmall.
  try {
    (void)HtRingRegion::make(Topology{4, 2}, HtRingGeometry{4, 256, 6, 256, 8}, 7200,
                             epx::plan::HtNetRegion::body(4), std::size_t{4} << 20);
    ADD_FAILURE() << "no error for a region too small";
  } catch (const epx::Error& e) {
    EXPECT_EQ(e.code(), epx::ErrorCode::kBufferTooSmall);
    EXPECT_NE(std::string(e.what()).find("num_nvl_bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(HtRingGeometry::channels_for_sms(2), 1);
  EXPECT_EQ(HtRingGeometry::channels_for_sms(24), 8);
  EXPECT_EQ(HtRingGeometry::channels_for_sms(132), 44);
  EXPECT_EQ(HtRingGeometry::channels_for_sms(1000), epx::plan::kMaxRingChannels);
  expect_named({epx::plan::kMaxRingChannels + 1, 4, 2, 4, 2}, 64, "num_sms");
}

/// Default rings that do not fit the region are halved until they do (more
/// channels than the buffer was sized for), and what a user fixed is kept.
TEST(InternodeRings, DefaultRingsShrinkToFitTheRegion) {
  const Topology topo{4, 2};
  const std::size_t header = epx::plan::HtNetRegion::body(4);
  const std::size_t bf16 = epx::plan::ht_net_record_bytes(2 * 7168, 0, 8, 2);
  const std::size_t row = epx::plan::ht_combine_row_bytes(7168, 8);
  auto need = [&](const HtRingGeometry& g, std::size_t record, bool combine) {
    const std::size_t big = std::size_t{1} << 46;
    const HtRingRegion r = combine ? HtRingRegion::make_combine(topo, g, record, header, big)
                                   : HtRingRegion::make(topo, g, record, header, big);
    return r.rings_end + HtRingRegion::state_bytes(topo);
  };
  for (bool combine : {false, true}) {
    const std::size_t rec = combine ? row : bf16;
    // A region sized for 8 channels' default rings, used with 10 channels.
    const HtRingGeometry eight = HtRingGeometry::of(1, 24, 0, 0, rec);
    const std::size_t region = need(eight, rec, combine);
    const HtRingGeometry same =
        HtRingRegion::fit(topo, eight, rec, header, region, combine, false, true);
    EXPECT_EQ(same.net_slots, 256);  // fits: unchanged
    EXPECT_EQ(same.nvl_slots, 256);
    EXPECT_EQ(same.net_chunk, eight.net_chunk);
    const HtRingGeometry ten = HtRingGeometry::of(1, 30, 0, 0, rec);
    ASSERT_EQ(ten.channels, 10);
    EXPECT_GT(need(ten, rec, combine), region);
    const HtRingGeometry f =
        HtRingRegion::fit(topo, ten, rec, header, region, combine, false, true);
    EXPECT_EQ(f.channels, 10);
    EXPECT_EQ(f.net_slots, 128);
    EXPECT_EQ(f.nvl_slots, 128);
    EXPECT_LE(f.net_chunk, f.net_slots / 2);
    EXPECT_LE(need(f, rec, combine), region);
    EXPECT_NO_THROW((void)(combine ? HtRingRegion::make_combine(topo, f, rec, header, region)
                                   : HtRingRegion::make(topo, f, rec, header, region)));
    // A config's network ring (num_max_rdma_recv_tokens) and put are kept; the
    // NVLink rings alone shrink.
    const HtRingGeometry cfg = HtRingGeometry::of(1, 30, 24, 256, rec);
    const HtRingGeometry kept =
        HtRingRegion::fit(topo, cfg, rec, header, region, combine, true, false);
    EXPECT_EQ(kept.net_slots, 256);
    EXPECT_EQ(kept.net_chunk, 24);
    EXPECT_LT(kept.nvl_slots, 256);
    EXPECT_GE(kept.nvl_slots, HtRingRegion::kMinFitSlots);
    // Nothing fits at the floor: returned at the floor, and make names the buffer.
    const HtRingGeometry floor =
        HtRingRegion::fit(topo, ten, rec, header, 1 << 20, combine, false, true);
    EXPECT_EQ(floor.net_slots, HtRingRegion::kMinFitSlots);
    EXPECT_EQ(floor.nvl_slots, HtRingRegion::kMinFitSlots);
    try {
      (void)HtRingRegion::make(topo, floor, rec, header, 1 << 20);
      ADD_FAILURE() << "no error for a region too small";
    } catch (const epx::Error& e) {
      EXPECT_EQ(e.code(), epx::ErrorCode::kBufferTooSmall);
    }
  }
}

}  // namespace
