// Config rules, size hints and the buffer plan (pure arithmetic, no GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/plan.hpp"
#include "epx/buffer.hpp"
#include "epx/config.hpp"

namespace epx {
namespace {

TEST(Config, ValidateNamesTheField) {
  auto check = [](const Config& c, const char* field) {
    try {
      c.validate(4, 132);
      ADD_FAILURE() << "expected an error about " << field;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  check(Config(1, 8, 4096), "config.num_sms");
  check(Config(200, 8, 4096), "config.num_sms");
  check(Config(24, 0, 4096), "config.num_max_send_tokens");
  check(Config(24, 2000, 4096), "config.num_max_send_tokens");
  check(Config(24, 16, 8), "config.num_max_recv_tokens");
  check(Config(24, 8, 4096, 24), "config.num_send_sms");
  auto rdma = [](int send, int recv) {
    Config c(24, 8, 4096);
    c.num_max_rdma_send_tokens = send;
    c.num_max_rdma_recv_tokens = recv;
    return c;
  };
  check(rdma(0, -1), "config.num_max_rdma_recv_tokens");
  check(rdma(0, (1 << 20) + 1), "config.num_max_rdma_recv_tokens");
  check(rdma(-1, 0), "config.num_max_rdma_send_tokens");
  check(rdma((1 << 20) + 1, 0), "config.num_max_rdma_send_tokens");
  EXPECT_NO_THROW(rdma(32, 32).validate(4, 132));
  EXPECT_NO_THROW(rdma(64, 0).validate(4, 132));  // the ring's size stays EPX's
  EXPECT_NO_THROW(Config(24, 8, 4096).validate(4, 132));
  EXPECT_NO_THROW(Config(24, 8, 4096).validate(8, 132));
  try {
    Config().validate(9, 132);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_ranks"), std::string::npos);
  }
}

TEST(Config, SplitOfSms) {
  Config c(24, 8, 4096);
  EXPECT_EQ(c.send_sms(), 8);
  EXPECT_EQ(c.recv_sms(), 16);
  EXPECT_EQ(Config(2, 8, 4096).send_sms(), 1);
  EXPECT_EQ(Config(2, 8, 4096).recv_sms(), 1);
  c.num_send_sms = 16;
  EXPECT_EQ(c.send_sms(), 16);
  EXPECT_EQ(c.recv_sms(), 8);
  // The pull dispatch's send blocks only fill the export ring: a sixth.
  Config p(24, 8, 4096);
  p.pull_dispatch = true;
  EXPECT_EQ(p.send_sms(), 4);
  EXPECT_EQ(p.recv_sms(), 20);
  p.num_sms = 5;
  EXPECT_EQ(p.send_sms(), 1);
  p.num_send_sms = 3;
  EXPECT_EQ(p.send_sms(), 3);
}

TEST(Plan, PullBatchFitsTheStaging) {
  EXPECT_EQ(plan::ht_pull_batch(4096), 8);
  EXPECT_EQ(plan::ht_pull_batch(8), 8);
  EXPECT_EQ(plan::ht_pull_batch(5), 5);  // a ring of one batch
  EXPECT_EQ(plan::ht_pull_batch(0), 1);  // one rank: no staging, no export
  plan::HtRegion r;
  r.num_ranks = 4;
  r.capacity = 20;
  EXPECT_EQ(r.staged_rows(), 60);
}

TEST(Config, SizeHintCoversThePlan) {
  // The hint must hold the region a dispatch of that shape plans.
  for (int R : {2, 4, 8}) {
    for (int H : {2048, 4096, 7168}) {
      Config c(24, 8, 4096);
      const std::size_t hint = c.get_nvl_buffer_size_hint(static_cast<std::size_t>(H) * 2, R, 8);
      plan::HtRegion r;
      r.num_ranks = R;
      r.num_experts = 256;
      r.capacity = 4096;
      r.chunk = 8;
      r.row_bytes = plan::ht_dispatch_row_bytes(static_cast<std::size_t>(H) * 2, 0, 8);
      EXPECT_GE(hint, r.total_bytes()) << "R=" << R << " H=" << H;
      r.row_bytes = plan::ht_dispatch_row_bytes(static_cast<std::size_t>(H), H / 128, 8);  // fp8
      EXPECT_GE(hint, r.total_bytes()) << "fp8 R=" << R << " H=" << H;
      r.row_bytes = plan::ht_combine_row_bytes(H, 8);
      EXPECT_GE(hint, r.total_bytes()) << "combine R=" << R << " H=" << H;
      // ...and is not wildly larger than what one dispatch needs.
      EXPECT_LE(hint, r.total_bytes() * 11 / 10 + (1 << 20));
    }
  }
  EXPECT_EQ(Config().get_rdma_buffer_size_hint(14336, 4), 0u);
}

// A rank's own rows never stage: the staging has one area per peer, and the
// areas of the peers of every rank are distinct and fill [0, R - 1).
TEST(Plan, StagingHasOneAreaPerPeer) {
  for (int R : {1, 2, 4, 8}) {
    plan::HtRegion r;
    r.num_ranks = R;
    r.capacity = 4096;
    r.chunk = 8;
    r.row_bytes = plan::ht_dispatch_row_bytes(14336, 0, 8);
    EXPECT_EQ(r.staged_sources(), R - 1);
    EXPECT_EQ(r.total_bytes(), plan::HtRegion::staging_offset() +
                                   static_cast<std::size_t>(R - 1) * 4096 * r.row_bytes);
    for (int me = 0; me < R; ++me) {
      std::vector<int> seen(static_cast<std::size_t>(R), 0);
      for (int src = 0; src < R; ++src) {
        if (src == me) continue;
        const int i = plan::HtRegion::staging_index(src, me);
        ASSERT_GE(i, 0);
        ASSERT_LT(i, R - 1) << "R=" << R << " me=" << me << " src=" << src;
        ++seen[static_cast<std::size_t>(i)];
      }
      for (int i = 0; i + 1 < R; ++i) EXPECT_EQ(seen[static_cast<std::size_t>(i)], 1);
    }
  }
}

// Issue 3: the buffer for the standard workload (hidden 7168 BF16, top-8,
// 4096 tokens, 24 SMs) is no larger than DeepEP V1's get_nvl_buffer_size_hint
// for it at EP2, EP4 and EP8 (EP8 through a ring smaller than the call). DeepEP's hint, as its
// Config computes it: (num_sms / 2) channels x ranks x 256 ring tokens x (hidden bytes + 8 B source
// meta + 128 ids x 8 B + 128 weights x 4 B + 128 scales x 4 B), plus a small header.
TEST(Config, SizeHintWithinDeepEpsForTheStandardWorkload) {
  const std::size_t hidden_bytes = 7168 * 2;
  for (int R : {2, 4, 8}) {
    const std::size_t deepep = static_cast<std::size_t>(24 / 2) * R * 256 *
                               (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4);
    const std::size_t ours = get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R, 8);
    EXPECT_LE(ours, deepep) << "R=" << R;
  }
}

// Chunks shrink for pairs with few rows (so every sender warp gets work) and
// never exceed the config's chunk; the flags a pair needs stay within
// kMaxChunks whenever the config's own chunk count does.
TEST(Plan, PairChunkShrinksForFewRows) {
  // EP2, 8 send SMs of 16 warps, config chunk 4: measured best at these sizes.
  EXPECT_EQ(plan::ht_pair_chunk(128, 4, 128, 2), 1);
  EXPECT_EQ(plan::ht_pair_chunk(256, 4, 128, 2), 2);
  EXPECT_EQ(plan::ht_pair_chunk(4096, 4, 128, 2), 4);
  EXPECT_EQ(plan::ht_pair_chunk(0, 4, 128, 2), 1);
  EXPECT_EQ(plan::ht_pair_chunk(100, 8, 128, 1), 8);  // one rank: no peers
  for (int R : {2, 3, 4, 8}) {
    for (int warps : {16, 128, 512, 132 * 16}) {
      for (int chunk : {1, 4, 8, 16, 1024}) {
        for (int rows = 0; rows <= 16384; rows += rows < 64 ? 1 : 97) {
          const int c = plan::ht_pair_chunk(rows, chunk, warps, R);
          ASSERT_GE(c, 1);
          ASSERT_LE(c, chunk);
          const int chunks = (rows + c - 1) / c;
          const int bound = std::max((rows + chunk - 1) / chunk, 2 * warps / (R - 1) + 1);
          ASSERT_LE(chunks, bound) << "R=" << R << " warps=" << warps << " rows=" << rows;
        }
      }
    }
  }
}

// A pair's ring: chunk j of ch rows goes to slot j % slots, so row k of the
// pair sits at k % (slots * ch), inside the pair's capacity rows.
TEST(Plan, RingSlotsHoldWholeChunks) {
  for (int capacity : {1, 7, 8, 256, 3584, 4096})
    for (int ch : {1, 3, 8, 37, 1024}) {
      if (ch > capacity) continue;  // config.validate refuses chunk > capacity
      const int slots = plan::HtRegion::ring_slots(capacity, ch);
      ASSERT_GE(slots, 1);
      ASSERT_LE(slots * ch, capacity) << capacity << " " << ch;
      ASSERT_GT((slots + 1) * ch, capacity) << "a whole chunk more would fit";
      for (int k = 0; k < 5 * capacity; k += 1 + k / 50) {
        const int j = k / ch;
        ASSERT_EQ(k % (slots * ch), (j % slots) * ch + k % ch);
      }
    }
  EXPECT_EQ(plan::ht_num_chunks(0, 8), 0);
  EXPECT_EQ(plan::ht_num_chunks(17, 8), 3);
}

// The LL token count word: the count and the 21-bit shape fingerprint come
// back apart whatever either is.
TEST(Plan, LowLatencyCountWordRoundTrips) {
  for (int n : {0, 1, 127, plan::kLlMaxTokens})
    for (uint32_t fp : {0u, 1u, 0x1fffffu, plan::fingerprint({128, 7168, 256, 1}) >> 11}) {
      const uint32_t w = plan::ll_count_word(n, fp);
      EXPECT_EQ(plan::ll_count_of(w), n);
      EXPECT_EQ(plan::ll_shape_of(w), fp);
    }
}

TEST(Plan, RegionsDoNotOverlapAndAreAligned) {
  plan::HtRegion r;
  r.num_ranks = 8;
  r.capacity = 4096;
  r.chunk = 1;
  r.row_bytes = plan::ht_dispatch_row_bytes(14336, 0, 8);
  EXPECT_LT(plan::HtRegion::counts_offset(0), plan::HtRegion::counts_offset(1));
  EXPECT_LE(plan::HtRegion::counts_offset(1) + plan::HtRegion::counts_bytes(),
            plan::HtRegion::flags_offset());
  EXPECT_LE(plan::HtRegion::flags_offset() + 4u * plan::kHtMaxRanks * plan::kMaxChunks,
            plan::HtRegion::credits_offset());
  EXPECT_LE(plan::HtRegion::credits_offset() + 4u * plan::kHtMaxRanks * plan::kMaxChunks,
            plan::HtRegion::consumed_offset());
  EXPECT_LE(plan::HtRegion::consumed_offset() + 8u * plan::kHtMaxRanks * plan::kMaxChunks,
            plan::HtRegion::config_offset());
  EXPECT_LE(plan::HtRegion::config_offset() + 8u * plan::kHtMaxRanks,
            plan::HtRegion::export_offset());
  EXPECT_LE(plan::HtRegion::export_offset() + 8u, plan::HtRegion::staging_offset());
  EXPECT_EQ(plan::HtRegion::export_offset() % 8, 0u);
  EXPECT_EQ(plan::HtRegion::config_offset() % 8, 0u);
  EXPECT_EQ(plan::HtRegion::consumed_offset() % 8, 0u);  // 64-bit atomics
  EXPECT_EQ(plan::HtRegion::staging_offset() % 128, 0u);
  EXPECT_EQ(r.row_bytes % 16, 0u);
  // the control and flag areas do not depend on the call's shape
  plan::HtRegion other = r;
  other.num_experts = 8;
  other.chunk = 32;
  EXPECT_EQ(other.staging_offset(), r.staging_offset());
}

// Words compared against an epoch (flags, tagged combine weights) must sit
// at one place whatever the call's shape: at a shape-dependent place, rows of
// an earlier call with another shape would read as epochs.
TEST(Plan, LowLatencyEpochWordsHaveAFixedPlace) {
  for (int R : {2, 4, 8}) {
    std::vector<plan::LlRegion> shapes;
    for (int maxT : {1, 64, 128, plan::kLlMaxTokens})
      for (int H : {128, 2880, 7168})
        for (int E : {R, 8 * R, 256, plan::kLlMaxExperts}) {
          plan::LlRegion r;
          r.num_ranks = R;
          r.max_tokens = maxT;
          r.hidden = H;
          r.num_experts = E;
          shapes.push_back(r);
        }
    const plan::LlRegion& a = shapes.front();
    for (const plan::LlRegion& r : shapes) {
      SCOPED_TRACE(::testing::Message() << "R=" << R << " maxT=" << r.max_tokens
                                        << " H=" << r.hidden << " E=" << r.num_experts);
      EXPECT_EQ(r.control_bytes(), a.control_bytes());
      EXPECT_EQ(r.weights_half_bytes(), a.weights_half_bytes());
      EXPECT_EQ(r.dtags_base(), a.dtags_base());
      EXPECT_EQ(r.dtags_half_bytes(), a.dtags_half_bytes());
      // control < flags < weights < dispatch tags (both halves each) < half 0 < half 1 < zero-copy
      EXPECT_LE(plan::LlRegion::flags_base() + 2 * plan::LlRegion::flags_bytes(),
                plan::LlRegion::weights_base());
      EXPECT_LE(plan::LlRegion::weights_base() + 2 * r.weights_half_bytes(), r.dtags_base());
      EXPECT_LE(r.dtags_base() + 2 * r.dtags_half_bytes(), r.half_offset(0));
      // inside a tag area: counts < masks < chunk flags, each big enough for any shape
      EXPECT_LE(8u * plan::kLlMaxRanks, plan::LlRegion::dtag_masks_offset());
      EXPECT_LE(plan::LlRegion::dtag_masks_offset() +
                    8u * static_cast<std::size_t>(R) * r.mask_words() * r.local_experts(),
                plan::LlRegion::dtag_chunks_offset());
      EXPECT_LE(plan::LlRegion::dtag_chunks_offset() +
                    4u * static_cast<std::size_t>(R) * plan::kLlMaxTokens * plan::kLlMaxChunks,
                r.dtags_half_bytes());
      EXPECT_GE(plan::kLlMaxChunks * plan::kLlChunk, plan::kLlMaxHidden);
      EXPECT_EQ(r.dtags_base() % 8, 0u);
      EXPECT_LE(r.half_offset(0) + r.half_bytes(), r.half_offset(1));
      EXPECT_LE(r.half_offset(1) + r.half_bytes(), r.zero_copy_offset(0));
      // inside a half: dispatch rows < combine rows
      EXPECT_LE(r.dispatch_rows_offset() +
                    static_cast<std::size_t>(R) * r.max_tokens * r.dispatch_row_capacity(),
                r.combine_rows_offset());
      // tagged weights are 8-byte words, rows 16-byte vectors
      EXPECT_EQ(plan::LlRegion::weights_base() % 8, 0u);
      EXPECT_EQ(r.half_offset(0) % 16, 0u);
      EXPECT_EQ(r.half_bytes() % 16, 0u);
      EXPECT_EQ(r.dispatch_row_capacity() % 16, 0u);
    }
    EXPECT_GE(plan::LlRegion::weights_stride(),
              8u * static_cast<std::size_t>(plan::kLlMaxTokens) * plan::kLlMaxTopK);
  }
}

TEST(Plan, RowBytes) {
  EXPECT_EQ(plan::ht_dispatch_row_bytes(14336, 0, 8),
            14336u + 80u);  // ids, weights, src idx: 68 -> 80
  EXPECT_EQ(plan::ht_dispatch_row_bytes(7168, 56, 8), 7168u + 224u + 80u);
  EXPECT_EQ(plan::ht_combine_row_bytes(7168, 8), 14336u + 32u);
  EXPECT_EQ(plan::ht_combine_row_bytes(2880, 0), 5760u);
}

TEST(Buffer, SetNumSmsRule) {
  EXPECT_THROW(Buffer::set_num_sms(3), Error);
  EXPECT_THROW(Buffer::set_num_sms(0), Error);
  const int before = Buffer::num_sms();
  Buffer::set_num_sms(20);
  EXPECT_EQ(get_dispatch_config(4).num_sms, 20);
  Buffer::set_num_sms(before);
}

TEST(Plan, NextEpochSkipsZeroAndKeepsParityAlternating) {
  EXPECT_EQ(plan::next_epoch(0u), 1u);
  EXPECT_EQ(plan::next_epoch(41u), 42u);
  EXPECT_EQ(plan::next_epoch(0xfffffffeu), 0xffffffffu);
  EXPECT_EQ(plan::next_epoch(0xffffffffu), 2u);  // not 0: never-written words hold 0
  for (uint32_t e = 0xfffffff0u; e != 8u; e = plan::next_epoch(e)) {
    EXPECT_NE(plan::next_epoch(e), 0u);
    EXPECT_NE(plan::next_epoch(e) & 1u, e & 1u) << e;  // the double buffers alternate
    // Wrap-safe order (barrier flags): the next epoch is ahead of this one.
    EXPECT_GT(static_cast<int32_t>(plan::next_epoch(e) - e), 0) << e;
    // A kernel after the notify kernel recovers the epoch the notify stored.
    EXPECT_EQ(plan::next_epoch(plan::next_epoch(e) - 1u), plan::next_epoch(e)) << e;
  }
}

// DeepEP's internode sizing, `config.get_nvl_buffer_size_hint(hidden_bytes,
// group.size())` at EP16 and up, works unchanged: nodes of 8, the internode
// ops' worst case for 4096 tokens per rank; a rank count that is not nodes of
// 8 is named.
TEST(Config, SizeHintAcrossNodes) {
  for (int R : {16, 32}) {
    const std::size_t hint = get_dispatch_config(R).get_nvl_buffer_size_hint(7168 * 2, R, 8);
    EXPECT_EQ(hint, Buffer::get_internode_nvl_size_hint(Config::kInternodeHintTokens, 7168, R,
                                                        kMaxRanksPerNode, 8))
        << "R=" << R;
  }
  // FP8 payloads (7168 bytes) ask for no more than BF16 ones.
  EXPECT_LE(get_dispatch_config(16).get_nvl_buffer_size_hint(7168, 16, 8),
            get_dispatch_config(16).get_nvl_buffer_size_hint(7168 * 2, 16, 8));
  try {
    get_dispatch_config(12).get_nvl_buffer_size_hint(7168 * 2, 12, 8);
    ADD_FAILURE() << "expected an error for 12 ranks";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("num_ranks"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epx
