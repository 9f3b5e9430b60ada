// NodeMemory (transport/proxy/node_memory.hpp) between forked processes: the
// ranks of a node map each other's memfd regions, what one writes the others
// read, ranks of another node are not mapped, and bad sizes and node lists
// are errors naming them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "transport/proxy/node_memory.hpp"
#include "unit/forked_ranks.hpp"

namespace epx::proxy {
namespace {

using forked::expect;
using forked::Ranks;
using forked::ShmExchange;

/// Ranks 0-1 and 2-3 as two nodes of two.
std::vector<int> node_of(int rank) {
  return rank < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
}

uint8_t pattern(int writer, int region, std::size_t i) {
  return static_cast<uint8_t>(writer * 37 + region * 11 + i * 7 + 1);
}

TEST(NodeMemory, RanksOfANodeMapEachOthersRegions) {
  Ranks ranks;
  ranks.start(4, [](int me, ShmExchange& ex) {
    NodeMemory nm(ex, node_of(me), 10);
    const std::size_t asked[2] = {5000, 1 << 20};
    NodeMemory::Region regions[2];
    for (int g = 0; g < 2; ++g) {
      NodeMemory::Region& r = regions[g];
      r = nm.alloc(asked[g]);
      expect(r.bytes >= asked[g] && r.bytes % 4096 == 0,
             "size " + std::to_string(r.bytes) + " for " + std::to_string(asked[g]));
      expect(r.peers.size() == 4 && r.peers[me] == r.local, "own entry");
      for (int p = 0; p < 4; ++p) {
        const bool same = node_of(p) == node_of(me);
        expect((r.peers[p] != nullptr) == same,
               "rank " + std::to_string(p) + " mapped: " + std::to_string(r.peers[p] != nullptr));
      }
      const auto* mine = static_cast<const uint8_t*>(r.local);
      for (std::size_t i = 0; i < r.bytes; ++i)
        if (mine[i] != 0) expect(false, "byte " + std::to_string(i) + " of a new region not 0");
    }
    ex.barrier();  // every rank checked its zeros before any peer writes
    // Each rank writes its pattern into the other rank of its node's regions,
    // in the half of the region that belongs to it as a writer.
    const int other = node_of(me)[0] == me ? node_of(me)[1] : node_of(me)[0];
    for (int g = 0; g < 2; ++g) {
      auto* dst = static_cast<uint8_t*>(regions[g].peers[other]);
      const std::size_t half = regions[g].bytes / 2, at = me < other ? 0 : half;
      for (std::size_t i = 0; i < half; ++i) dst[at + i] = pattern(me, g, i);
    }
    ex.barrier();
    for (int g = 0; g < 2; ++g) {
      const auto* got = static_cast<const uint8_t*>(regions[g].local);
      const std::size_t half = regions[g].bytes / 2, at = other < me ? 0 : half;
      for (std::size_t i = 0; i < half; ++i)
        if (got[at + i] != pattern(other, g, i))
          expect(false, "region " + std::to_string(g) + " byte " + std::to_string(at + i) +
                            " from rank " + std::to_string(other) + ": " +
                            std::to_string(got[at + i]));
      // Nothing lands in the half that is this rank's to write.
      for (std::size_t i = 0; i < half; ++i)
        if (got[(at + half) % regions[g].bytes + i] != 0) expect(false, "own half written");
    }
    ex.barrier();  // nobody writes any more
    for (auto& r : regions) nm.free(r);
  });
  EXPECT_EQ(ranks.wait(60), "");
}

TEST(NodeMemory, RanksAskingForDifferentSizesAreNamed) {
  Ranks ranks;
  ranks.start(2, [](int me, ShmExchange& ex) {
    NodeMemory nm(ex, {0, 1}, 10);
    try {
      NodeMemory::Region r = nm.alloc(me == 0 ? 4096 : 3 * 4096);
      nm.free(r);
    } catch (const Error& e) {
      const std::string what = e.what();
      expect(e.code() == ErrorCode::kInvalidArgument, "code of: " + what);
      expect(what.find("must ask for the same size") != std::string::npos &&
                 what.find("rank " + std::to_string(1 - me) + " has") != std::string::npos,
             "message: " + what);
      return;
    }
    expect(false, "no error for sizes 4096 and 12288");
  });
  EXPECT_EQ(ranks.wait(30), "");
}

TEST(NodeMemory, NodeListsWithoutThisRankOrOutOfOrderAreRefused) {
  Ranks ranks;
  ranks.start(1, [](int, ShmExchange& ex) {
    for (const std::vector<int>& bad :
         {std::vector<int>{1}, std::vector<int>{}, std::vector<int>{0, 0}}) {
      try {
        NodeMemory nm(ex, bad, 5);
      } catch (const Error& e) {
        expect(std::string(e.what()).find("node") != std::string::npos, e.what());
        continue;
      }
      expect(false, "a bad node list was taken");
    }
  });
  EXPECT_EQ(ranks.wait(30), "");
}

}  // namespace
}  // namespace epx::proxy
