// transport/proxy/libfabric_engine.hpp - an engine over libfabric RDM
// endpoints (tcp;ofi_rxm, shm, verbs;ofi_rxm, efa): RMA writes with remote
// CQ data, signals applied by the receiving engine.
//
// Endpoints: one FI_EP_RDM endpoint per channel, its own completion queue and
// an address vector holding the same channel's endpoint of every rank (index
// = rank). Channel c of one rank only talks to channel c of the others, so a
// completion read from channel c's queue says which channel it belongs to.
// The endpoint addresses, memory keys and region bases (virtual addresses for
// FI_MR_VIRT_ADDR providers, else offsets from 0) go through an `Exchange`
// (an allgather and a barrier), not through a host-local mesh, so ranks may be
// on different hosts.
//
// Rails: the engine opens a fabric and a domain per libfabric domain named in
// LibfabricOptions::domains (NICs, or the ports of one NIC; default: the
// provider's first domain), and channel c opens its endpoint, queue and
// address vector on domain c % n. Every region (and the control region) is
// registered once per domain, and the keys and bases exchanged are per
// (rank, domain): a write on channel c uses the keys of domain c % n at both
// ends, which works because every rank uses the same number of domains (the
// setup exchange checks it). The names may differ between hosts.
//
// No ordering between writes is assumed (EFA and several rails reorder), nor
// FI_FENCE, nor fi_atomic. Every write carries 32 bits of immediate data
// (ImmKind below); the receiver's progress thread counts them:
//   - put to `peer`: fi_writemsg of the bytes, immediate PUT(src, epoch). The
//     epoch of (channel, peer) is how many signals this rank has sent to that
//     peer on that channel before this put.
//   - signal_add: a 32-byte MailboxEntry {epoch, puts in the epoch, region,
//     sig_off, add} written into the receiver's mailbox slot for (source
//     rank, channel, epoch mod window), immediate MAILBOX(src, epoch). The
//     add does not fit in 32 bits together with the source and the epoch, so
//     every signal travels this way (a signal is one small write either way).
//   - the receiver counts PUT arrivals per (source, channel, epoch mod
//     window); it applies the signals of one (source, channel) in epoch
//     order, each once its mailbox entry has arrived and the count of its
//     epoch equals the entry's `puts`: an atomic fetch_add with release order
//     on the 8-byte word in its own region. A signal is thus never visible
//     before the bytes of any put issued before it on that (channel, peer).
//   - credits: the receiver writes the number of epochs it applied for
//     (source, channel) back into the source's control region (a plain
//     fi_write, every window/4 epochs); a sender starts epoch e only while
//     e - credit < window, so a mailbox slot and an arrival counter are
//     reused only once the receiver is done with them.
// Immediate data (32 bits, what EFA and verbs carry):
//   bits 31..30  kind: 1 = PUT, 2 = MAILBOX (0 and 3 are never sent)
//   bits 29..18  source rank (so at most 4096 ranks)
//   bits 17..0   epoch mod 2^18 (the receiver rebuilds the full epoch from
//                the window it expects: [applied, applied + window))
//
// Order: Engine::put says effects on one (channel, peer) happen in call
// order; here two puts of one endpoint may land in either order (only a
// signal orders them: it is applied after every put before it). Puts that
// overwrite the same bytes, or a kFence between puts, need the writer to
// wait for completion (mark / completed) in between.
//
// Completion: writes are posted with FI_DELIVERY_COMPLETE where the provider
// offers it (tcp;ofi_rxm and shm in libfabric 1.17 both do: their local
// completion then means the data was placed at the target), else with the
// provider's default (transmit complete: the error message of a timeout says
// so). mark(c, t) remembers how many writes channel c had posted; t is
// complete once every one of them has its local completion, in any order.
//
// Progress: one thread per engine polls every channel's completion queue (so
// every domain's: each channel's queue lives on its channel's domain)
// (manual-progress providers such as tcp;ofi_rxm place incoming writes only
// then), counts arrivals, applies signals, sends credits, and records
// completions and errors. Errors (a completion error: fi_cq_readerr and
// fi_cq_strerror's text; a write still incomplete after `timeout_s`: a peer
// that died or stopped) become epx::Error(kTimeout) from the next call of the
// channel's thread, naming the peer, the channel and the provider's text;
// held_call_cause() gives the same message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/proxy/engine.hpp"

namespace epx {
class Communicator;
}

namespace epx::proxy {

/// The collectives the engine needs to set itself up (register_region,
/// deregister_region and the constructor call them on every rank).
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  /// `bytes` from every rank (the same size everywhere), in rank order.
  virtual std::vector<uint8_t> allgather(const void* data, std::size_t bytes) = 0;
  virtual void barrier() = 0;
};

/// An Exchange over `comm` (its allgather and barrier, with its deadline).
/// `comm` must outlive it.
std::unique_ptr<Exchange> make_communicator_exchange(Communicator& comm);

struct LibfabricOptions {
  /// Provider name as fi_info -l prints it ("tcp;ofi_rxm", "shm",
  /// "verbs;ofi_rxm", "efa"), matched exactly (a utility provider layered
  /// over it is not taken). Empty: $FI_PROVIDER, else "tcp;ofi_rxm".
  std::string provider;
  /// The rails: libfabric domain names as `fi_info -p <provider>` prints them
  /// after "domain:" ("lo,eth0" for tcp, "mlx5_0,mlx5_1" for verbs),
  /// comma-separated; channel c uses domain c % n. Empty: the provider's first
  /// domain. At most kMaxRails and at most one per channel; every rank must
  /// name as many (the names may differ between hosts).
  std::string domains;
  /// How long a write may stay incomplete, and how long a call waits for a
  /// free transmit slot or for the receiver's credits, before kTimeout.
  double timeout_s = 30.0;
  /// Epochs (signals) a sender may be ahead of a receiver per (channel,
  /// peer): mailbox slots per (source, channel). A power of two in [4, 4096].
  uint32_t window = 64;
  /// Writes in flight per channel (a power of two in [16, 1 << 20]).
  uint32_t max_inflight = 4096;
  /// Test hook: the progress thread holds up to this many incoming
  /// immediate-data completions and handles them in a random order (0: off),
  /// as a fabric that reorders them would deliver them.
  uint32_t test_reorder_window = 0;
};

/// Domains (rails) one engine may use at most.
inline constexpr int kMaxRails = 32;

/// What one engine's progress thread saw (for tests and diagnostics).
struct LibfabricStats {
  uint64_t puts_received = 0, signals_received = 0, signals_applied = 0;
  /// Signals whose mailbox entry arrived before every put of their epoch.
  uint64_t signals_waited = 0;
  uint64_t credits_sent = 0;
  bool delivery_complete = false;            ///< every domain's writes use FI_DELIVERY_COMPLETE
  std::string provider;                      ///< the provider fi_getinfo chose
  std::vector<std::string> domains;          ///< the domains in use (rails), in order
  std::vector<std::string> channel_domains;  ///< per channel: its domain's name
  /// Per channel: its endpoint's address as fi_av_straddr prints it.
  std::vector<std::string> channel_addresses;
  /// Per channel: writes with immediate data (puts and signals) it received.
  std::vector<uint64_t> channel_writes_received;
};

/// What `stats` says the engine runs on, for Buffer::network_engine():
/// "libfabric tcp;ofi_rxm, domain lo", or with several rails
/// "libfabric verbs;ofi_rxm, domains mlx5_0,mlx5_1 (channel c on domain c % 2)".
inline std::string describe(const LibfabricStats& stats) {
  std::string out = "libfabric " + stats.provider;
  std::string names;
  for (const std::string& d : stats.domains) names += (names.empty() ? "" : ",") + d;
  if (stats.domains.size() == 1) out += ", domain " + names;
  if (stats.domains.size() > 1)
    out += ", domains " + names + " (channel c on domain c % " +
           std::to_string(stats.domains.size()) + ")";
  return out;
}

/// The domains `provider` (matched exactly) offers RDM endpoints with RMA on,
/// in fi_getinfo's order, each once ({} for an unknown provider). Loads
/// libfabric: in a process that forks later, call it in a child.
std::vector<std::string> libfabric_domains(const std::string& provider);

/// Rank exchange.rank()'s engine with `num_channels` channels (collective:
/// every rank constructs one with the same channels and options). Throws
/// epx::Error(kInvalidArgument) for an unknown provider or domain, a bad
/// option, or ranks that name different numbers of domains (a rank whose
/// setup failed gives its error to every rank through the exchange),
/// kUnsupported for a provider without FI_EP_RDM + FI_RMA or remote CQ data
/// (naming the provider and what it lacks), kTimeout when the exchange does.
std::unique_ptr<Engine> make_libfabric_engine(std::shared_ptr<Exchange> exchange, int num_channels,
                                              const LibfabricOptions& options = {});

/// The stats of an engine made by make_libfabric_engine (throws
/// kInvalidArgument for another engine).
LibfabricStats libfabric_stats(const Engine& engine);

/// The immediate-data encoding (see the header comment), for tests.
namespace fabric_imm {
enum class Kind : uint32_t { kNone = 0, kPut = 1, kMailbox = 2, kReserved = 3 };
inline constexpr int kMaxRanks = 1 << 12;
inline constexpr uint32_t kEpochBits = 18;
inline constexpr uint32_t kEpochMask = (1u << kEpochBits) - 1;
constexpr uint32_t encode(Kind kind, int src, uint64_t epoch) {
  return (static_cast<uint32_t>(kind) << 30) | ((static_cast<uint32_t>(src) & 0xfffu) << 18) |
         (static_cast<uint32_t>(epoch) & kEpochMask);
}
constexpr Kind kind_of(uint32_t imm) {
  return static_cast<Kind>(imm >> 30);
}
constexpr int src_of(uint32_t imm) {
  return static_cast<int>((imm >> 18) & 0xfffu);
}
constexpr uint32_t epoch_of(uint32_t imm) {
  return imm & kEpochMask;
}
/// The full epoch of `imm`'s 18 bits given the receiver expects epochs in
/// [applied, applied + window) (window <= 2^17); false if it is outside.
constexpr bool full_epoch(uint32_t imm, uint64_t applied, uint32_t window, uint64_t& epoch) {
  const uint64_t ahead = (epoch_of(imm) - static_cast<uint32_t>(applied)) & kEpochMask;
  epoch = applied + ahead;
  return ahead < window;
}
}  // namespace fabric_imm

/// One mailbox slot: what a signal carries.
struct MailboxEntry {
  uint64_t epoch;    ///< the signal's epoch (checked against the immediate's)
  uint32_t puts;     ///< puts the sender issued in this epoch (before the signal)
  uint32_t region;   ///< region id of the signal word
  uint64_t sig_off;  ///< offset of the 8-byte word in that region
  uint64_t add;      ///< value added
};
static_assert(sizeof(MailboxEntry) == 32);

}  // namespace epx::proxy
