#include "transport/proxy/libfabric_engine.hpp"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/communicator.hpp"
#include "epx/error.hpp"
#include "transport/proxy/bounds.hpp"
#include "transport/proxy/command.hpp"

namespace epx::proxy {

namespace {

class CommunicatorExchange final : public Exchange {
 public:
  explicit CommunicatorExchange(Communicator& comm) : comm_(comm) {}
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  std::vector<uint8_t> allgather(const void* data, std::size_t bytes) override {
    return comm_.allgather(data, bytes);
  }
  void barrier() override { comm_.barrier(); }

 private:
  Communicator& comm_;
};

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

std::string fi_text(int err) {
  return std::string(fi_strerror(err < 0 ? -err : err)) + " (" + std::to_string(err) + ")";
}

/// Frees an fi_info list.
struct InfoPtr {
  fi_info* p = nullptr;
  InfoPtr() = default;
  InfoPtr(const InfoPtr&) = delete;
  InfoPtr& operator=(const InfoPtr&) = delete;
  ~InfoPtr() {
    if (p) fi_freeinfo(p);
  }
};

constexpr uint32_t kFiVersion = FI_VERSION(1, 9);

/// fi_getinfo hints for `provider`: the provider alone (`full` false), or
/// what the engine needs (RDM endpoints, RMA writes, the memory registration
/// modes it handles, thread safety; FI_DELIVERY_COMPLETE where `delivery`)
/// on domain `domain` (empty: any).
fi_info* make_hints(const std::string& provider, const std::string& domain, bool full,
                    bool delivery) {
  fi_info* h = fi_allocinfo();
  if (!h) throw Error(ErrorCode::kInternal, "libfabric engine: fi_allocinfo failed");
  h->fabric_attr->prov_name = strdup(provider.c_str());
  if (full) {
    h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    h->ep_attr->type = FI_EP_RDM;
    h->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    h->domain_attr->threading = FI_THREAD_SAFE;
    h->mode = 0;
    if (delivery) h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  }
  if (!domain.empty()) h->domain_attr->name = strdup(domain.c_str());
  return h;
}

/// Whether `i` is provider `provider` itself (not a utility provider layered
/// over it: "udp" must not become "udp;ofi_rxd") on domain `domain` (empty: any).
bool is_exact(const fi_info* i, const std::string& provider, const std::string& domain) {
  if (!i->fabric_attr->prov_name || provider != i->fabric_attr->prov_name) return false;
  return domain.empty() || (i->domain_attr->name && domain == i->domain_attr->name);
}

std::vector<std::string> domains_of(const std::string& provider) {
  fi_info* h = make_hints(provider, "", true, false);
  InfoPtr list;
  const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, h, &list.p);
  fi_freeinfo(h);
  std::vector<std::string> out;
  if (rc != 0) return out;
  for (fi_info* i = list.p; i; i = i->next)
    if (is_exact(i, provider, "") && i->domain_attr->name &&
        std::find(out.begin(), out.end(), i->domain_attr->name) == out.end())
      out.emplace_back(i->domain_attr->name);
  return out;
}

std::string join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

/// LibfabricOptions::domains as names: split at commas, blanks around a name
/// dropped; an empty name or a name given twice is an error.
std::vector<std::string> parse_domains(const std::string& list) {
  std::vector<std::string> out;
  if (list.find_first_not_of(" \t") == std::string::npos) return out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = list.find(',', at);
    std::string name = list.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    const std::string where = "libfabric engine: fabric domains '" + list +
                              "' (BufferOptions::fabric_domains or EPX_FABRIC_DOMAINS)";
    if (name.empty())
      throw Error(ErrorCode::kInvalidArgument,
                  where +
                      ": an empty name (the names are comma-separated, as `fi_info -p "
                      "<provider>` prints them after 'domain:')");
    if (std::find(out.begin(), out.end(), name) != out.end())
      throw Error(ErrorCode::kInvalidArgument, where + ": names domain '" + name + "' twice");
    out.push_back(std::move(name));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

/// Operation contexts (the op_context of a local completion): the write's
/// sequence number on its channel, or a credit write for a source rank.
constexpr uint64_t kCreditTag = uint64_t{1} << 62;

/// The control region of a rank: what peers write into besides the regions.
///   mailbox[src][channel][window]   MailboxEntry, written by src
///   credit_in[dst][channel]         epochs dst applied for our channel
///   credit_out[src][channel]        source of our credit writes to src
///   staged[dst][channel][window]    source of our mailbox writes to dst
struct ControlLayout {
  std::size_t mailbox = 0, credit_in = 0, credit_out = 0, staged = 0, bytes = 0;
  ControlLayout(int ranks, int channels, uint32_t window) {
    const std::size_t rc = static_cast<std::size_t>(ranks) * channels;
    mailbox = 0;
    credit_in = mailbox + rc * window * sizeof(MailboxEntry);
    credit_out = credit_in + rc * 8;
    staged = credit_out + rc * 8;
    bytes = (staged + rc * window * sizeof(MailboxEntry) + 4095) / 4096 * 4096;
  }
};

struct RemoteRegion {
  uint64_t key = 0;
  uint64_t base = 0;  ///< address of offset 0 in the peer's rma_iov (VIRT_ADDR: its pointer)
  uint64_t bytes = 0;
};

class LibfabricEngine final : public Engine {
 public:
  LibfabricEngine(std::shared_ptr<Exchange> exchange, int num_channels, LibfabricOptions o)
      : ex_(std::move(exchange)), opt_(std::move(o)) {
    require(ex_ != nullptr, "exchange", "must not be null");
    rank_ = ex_->rank();
    num_ranks_ = ex_->num_ranks();
    num_channels_ = num_channels;
    require(num_channels >= 1 && num_channels <= 256, "num_channels",
            "must be in [1, 256], got " + std::to_string(num_channels));
    require(num_ranks_ >= 1 && num_ranks_ <= fabric_imm::kMaxRanks, "num_ranks",
            "the libfabric engine carries the source rank in 12 bits of immediate data: at most " +
                std::to_string(fabric_imm::kMaxRanks) + " ranks, got " +
                std::to_string(num_ranks_));
    require(opt_.window >= 4 && opt_.window <= 4096 && std::has_single_bit(opt_.window),
            "LibfabricOptions::window",
            "must be a power of two in [4, 4096], got " + std::to_string(opt_.window));
    require(opt_.max_inflight >= 16 && opt_.max_inflight <= (1u << 20) &&
                std::has_single_bit(opt_.max_inflight),
            "LibfabricOptions::max_inflight",
            "must be a power of two in [16, 2^20], got " + std::to_string(opt_.max_inflight));
    require(opt_.timeout_s > 0, "LibfabricOptions::timeout_s",
            "must be > 0, got " + std::to_string(opt_.timeout_s));
    if (opt_.provider.empty()) {
      const char* env = std::getenv("FI_PROVIDER");
      opt_.provider = env && *env ? env : "tcp;ofi_rxm";
    }
    timeout_ns_ = static_cast<uint64_t>(std::min(opt_.timeout_s, 1e9) * 1e9);
    try {
      open();
    } catch (...) {
      close_all();
      throw;
    }
  }

  ~LibfabricEngine() override { close_all(); }

  const char* name() const override { return "libfabric"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  int num_channels() const override { return num_channels_; }
  bool reaches(int peer) const override { return peer >= 0 && peer < num_ranks_; }

  void register_region(int id, void* base, std::size_t bytes) override {
    check_region_id(id, "register_region");
    check_new_region(id, base, bytes, regions_[id].registered(), rank_);
    // One registration per domain: a channel's writes name the keys of its domain.
    Local l;
    std::vector<RemoteRegion> mine(rails_.size());
    try {
      for (std::size_t d = 0; d < rails_.size(); ++d) {
        l.mr.push_back(register_memory(static_cast<int>(d), base, bytes,
                                       static_cast<uint64_t>(id) + 1,
                                       "region " + std::to_string(id)));
        l.desc.push_back(fi_mr_desc(l.mr.back()));
        mine[d] = {fi_mr_key(l.mr.back()),
                   rails_[d].virt_addr ? reinterpret_cast<uint64_t>(base) : 0, bytes};
      }
    } catch (const Error&) {
      close_mrs(l);
      // The others wait in the allgather: give them a size of 0 to refuse.
      std::fill(mine.begin(), mine.end(), RemoteRegion{});
      (void)gather(mine, "register_region");
      throw;
    }
    l.base = static_cast<char*>(base);
    l.bytes = bytes;
    std::vector<RemoteRegion> all = gather(mine, "register_region(" + std::to_string(id) + ")");
    for (int r = 0; r < num_ranks_; ++r) {
      const uint64_t theirs = all[static_cast<std::size_t>(r) * rails_.size()].bytes;
      if (theirs != bytes) {
        close_mrs(l);
        throw Error(ErrorCode::kInvalidArgument,
                    where() + ": register_region(" + std::to_string(id) +
                        "): every rank must register the same size: rank " + std::to_string(rank_) +
                        " gives " + std::to_string(bytes) + " bytes, rank " + std::to_string(r) +
                        " " + std::to_string(theirs) +
                        (theirs == 0 ? " (its registration failed)" : ""));
      }
    }
    {
      std::lock_guard lock(region_m_);  // the progress thread reads regions_ for signals
      regions_[id] = std::move(l);
    }
    remote_[id] = std::move(all);
    barrier("register_region");
  }

  void deregister_region(int id) override {
    check_region_id(id, "deregister_region");
    require(regions_[id].registered(), "deregister_region",
            "region " + std::to_string(id) + " is not registered on rank " + std::to_string(rank_));
    barrier("deregister_region");  // no peer writes into it any more
    {
      std::lock_guard lock(region_m_);
      close_mrs(regions_[id]);
    }
    remote_[id].clear();
  }

  void reset_signals(int /*id*/) override {}  // the words themselves are added to

  void check_put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
                 uint64_t bytes) const override {
    require(
        channel >= 0 && channel < num_channels_, "channel",
        "must be in [0, " + std::to_string(num_channels_) + "), got " + std::to_string(channel));
    const RemoteRegion& dst = target(peer, region, "put");
    check_put_range("libfabric", "put", rank_, peer, region, dst_off, src_off, bytes, dst.bytes,
                    regions_[region].bytes);
  }

  void put(int channel, int peer, int region, uint64_t dst_off, uint64_t src_off,
           uint64_t bytes) override {
    check_put(channel, peer, region, dst_off, src_off, bytes);
    Channel& ch = channel_of(channel);
    throw_if_failed(ch);
    const RemoteRegion& dst = remote(region, peer, ch.rail);
    Peer& p = ch.peers[peer];
    wait_credit(ch, channel, peer, "put");
    const uint32_t imm = fabric_imm::encode(fabric_imm::Kind::kPut, rank_, p.epoch);
    const uint64_t max_msg = rails_[ch.rail].max_msg;
    uint64_t done = 0;
    while (done < bytes) {  // pieces of at most max_msg_size, each counted as a put
      const uint64_t n = std::min(bytes - done, max_msg);
      post(ch, channel, peer, regions_[region].base + src_off + done, n,
           regions_[region].desc[ch.rail], dst.base + dst_off + done, dst.key, imm, true, "put");
      ++p.puts;
      done += n;
    }
  }

  void signal_add(int channel, int peer, int region, uint64_t sig_off, uint64_t add) override {
    Channel& ch = channel_of(channel);
    throw_if_failed(ch);
    const RemoteRegion& dst = target(peer, region, "signal_add");
    check_range("libfabric", "signal_add", "signal word", peer, region, sig_off, 8, dst.bytes);
    if (sig_off % 8 != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  where() + ": signal_add to rank " + std::to_string(peer) + " region " +
                      std::to_string(region) + ": sig_off " + std::to_string(sig_off) +
                      " is not 8-byte aligned");
    Peer& p = ch.peers[peer];
    wait_credit(ch, channel, peer, "signal_add");
    const uint64_t slot = p.epoch & (opt_.window - 1);
    auto* staged = reinterpret_cast<MailboxEntry*>(
        control_ + layout_.staged +
        ((static_cast<std::size_t>(peer) * num_channels_ + channel) * opt_.window + slot) *
            sizeof(MailboxEntry));
    // The slot's previous write (epoch - window) was read by the receiver
    // before it gave the credit that lets this epoch start.
    *staged = MailboxEntry{p.epoch, static_cast<uint32_t>(p.puts), static_cast<uint32_t>(region),
                           sig_off, add};
    const RemoteRegion& ctl = control_remote(peer, ch.rail);
    const uint64_t remote =
        ctl.base + layout_.mailbox +
        ((static_cast<uint64_t>(rank_) * num_channels_ + channel) * opt_.window + slot) *
            sizeof(MailboxEntry);
    post(ch, channel, peer, staged, sizeof(MailboxEntry), rails_[ch.rail].control_desc, remote,
         ctl.key, fabric_imm::encode(fabric_imm::Kind::kMailbox, rank_, p.epoch), true,
         "signal_add");
    ++p.epoch;
    p.puts = 0;
  }

  void mark(int channel, uint64_t token) override {
    Channel& ch = channel_of(channel);
    ch.marks.emplace_back(token, ch.posted);
  }

  uint64_t completed(int channel) override {
    Channel& ch = channel_of(channel);
    throw_if_failed(ch);
    const uint64_t done = ch.done.load(std::memory_order_acquire);
    while (!ch.marks.empty() && ch.marks.front().second <= done) {
      ch.completed_token = ch.marks.front().first;
      ch.marks.pop_front();
    }
    if (done < ch.posted) check_age(ch, channel, done);
    return ch.completed_token;
  }

  /// A channel's failure, else the oldest write incomplete for over a second.
  std::string held_call_cause() const override {
    std::string slow;
    for (int c = 0; c < num_channels_; ++c) {
      const Channel& ch = channels_[c];
      if (ch.failed.load(std::memory_order_acquire)) {
        std::lock_guard lock(ch.err_m);
        return ch.error;
      }
      const uint64_t done = ch.done.load(std::memory_order_acquire);
      const Slot& s = ch.slots[done & (opt_.max_inflight - 1)];
      const uint64_t t = s.t_ns.load(std::memory_order_relaxed);
      const uint64_t now = now_ns();
      if (slow.empty() && s.done.load(std::memory_order_relaxed) == 0 && t != 0 && now > t &&
          now - t > 1000000000ull)
        slow = where(c) + ": write " + std::to_string(done) + " to rank " +
               std::to_string(s.peer.load(std::memory_order_relaxed)) + " on channel " +
               std::to_string(c) + " has waited " + std::to_string((now - t) / 1000000000ull) +
               " s for its completion (is rank " +
               std::to_string(s.peer.load(std::memory_order_relaxed)) + " alive and progressing?)";
    }
    return slow;
  }

  LibfabricStats stats() const {
    LibfabricStats s;
    s.puts_received = st_puts_.load();
    s.signals_received = st_signals_.load();
    s.signals_applied = st_applied_.load();
    s.signals_waited = st_waited_.load();
    s.credits_sent = st_credits_.load();
    s.delivery_complete = !rails_.empty();
    for (const Rail& r : rails_) {
      s.delivery_complete = s.delivery_complete && r.delivery_complete;
      s.domains.push_back(r.name);
    }
    s.provider = prov_name_;
    for (int c = 0; c < num_channels_; ++c) {
      const Channel& ch = channels_[c];
      s.channel_domains.push_back(rails_[ch.rail].name);
      s.channel_addresses.push_back(ch.address);
      s.channel_writes_received.push_back(ch.received.load(std::memory_order_relaxed));
    }
    return s;
  }

 private:
  /// One libfabric domain (a rail) and what its fi_info says.
  struct Rail {
    std::string name;         ///< domain_attr->name
    fi_info* info = nullptr;  ///< owned
    fid_fabric* fabric = nullptr;
    fid_domain* domain = nullptr;
    bool virt_addr = false, prov_key = false, mr_endpoint = false, delivery_complete = false;
    uint64_t max_msg = 1 << 30;
    fid_mr* control_mr = nullptr;  ///< the control region's registration in this domain
    void* control_desc = nullptr;
  };
  /// A region of this rank: one registration per domain (rail).
  struct Local {
    std::vector<fid_mr*> mr;  ///< per rail; empty: not registered
    std::vector<void*> desc;
    char* base = nullptr;
    std::size_t bytes = 0;
    bool registered() const { return !mr.empty(); }
  };
  /// Sender state of one (channel, peer).
  struct Peer {
    uint64_t epoch = 0;  ///< signals sent so far
    uint64_t puts = 0;   ///< puts sent in the current epoch
  };
  /// Receiver state of one (source rank, channel), progress thread only.
  struct Source {
    uint64_t applied = 0;  ///< epochs whose signal was applied
    std::vector<uint32_t> arrivals;
    std::vector<uint8_t> have;
    std::vector<MailboxEntry> entry;
    uint64_t credit_sent = 0;
    bool credit_inflight = false;
  };
  struct Slot {
    std::atomic<uint8_t> done{0};
    std::atomic<int> peer{-1};
    std::atomic<uint64_t> t_ns{0};
  };
  struct Channel {
    int rail = 0;  ///< index into rails_: channel c uses rail c % rails
    fid_ep* ep = nullptr;
    fid_cq* cq = nullptr;
    fid_av* av = nullptr;
    std::vector<fi_addr_t> addr;
    std::string address;  ///< this endpoint's, as fi_av_straddr prints it
    // Channel thread.
    uint64_t posted = 0;
    std::deque<std::pair<uint64_t, uint64_t>> marks;  ///< (token, writes posted)
    uint64_t completed_token = 0;
    std::vector<Peer> peers;
    // Shared with the progress thread.
    std::unique_ptr<Slot[]> slots;
    std::atomic<uint64_t> done{0};  ///< writes [0, done) have completed
    mutable std::mutex err_m;
    std::string error;
    ErrorCode code = ErrorCode::kTimeout;
    std::atomic<bool> failed{false};
    // Progress thread.
    std::vector<Source> sources;
    std::atomic<uint64_t> received{0};  ///< writes with immediate data that arrived
  };
  struct Held {
    int channel;
    uint32_t imm;
  };
  static constexpr std::size_t kNameBytes = 256;  ///< room for one endpoint name

  std::string where() const {
    return "libfabric engine (provider " + prov_name_ + ") rank " + std::to_string(rank_);
  }
  std::string where(int channel) const {
    std::string out = where() + " channel " + std::to_string(channel);
    if (channels_ && rails_.size() > 1)
      out += " (domain " + rails_[channels_[channel].rail].name + ")";
    return out;
  }

  // ---- setup ------------------------------------------------------------------

  /// The setup exchange: what every rank tells the others.
  struct Card {
    uint32_t failed;     ///< this rank's setup failed: `code` and `message` say how
    int32_t code;        ///< its ErrorCode
    uint32_t num_rails;  ///< domains it uses
    char domains[512];   ///< their names, comma-separated (for messages)
    char message[1024];
    RemoteRegion control[kMaxRails];  ///< the control region in each domain
    uint32_t name_len[256];
    uint8_t names[256][kNameBytes];  ///< every channel's endpoint name
  };

  /// Opens the rails and channels, then exchanges the Card. A failure on this
  /// rank still takes part in the exchange, so the others raise naming it
  /// instead of waiting for it until their deadline.
  void open() {
    prov_name_ = opt_.provider;
    auto card = std::make_unique<Card>();  // value-initialized: zeroed
    std::optional<Error> local;
    try {
      open_local(*card);
    } catch (const Error& e) {
      local = e;
      card->failed = 1;
      card->code = static_cast<int32_t>(e.code());
      std::snprintf(card->message, sizeof card->message, "%s", e.what());
    }
    std::vector<uint8_t> all;
    try {
      all = ex_->allgather(card.get(), sizeof(Card));
    } catch (const Error& e) {
      if (local) throw *local;  // this rank's own failure says more
      throw Error(e.code(), where() + ": exchanging endpoint addresses: " + e.what());
    }
    if (local) throw *local;
    if (all.size() != sizeof(Card) * num_ranks_)
      throw Error(ErrorCode::kInternal, where() + ": the exchange returned " +
                                            std::to_string(all.size()) + " bytes, expected " +
                                            std::to_string(sizeof(Card) * num_ranks_));
    std::vector<std::unique_ptr<Card>> cards;
    for (int r = 0; r < num_ranks_; ++r) {
      cards.push_back(std::make_unique<Card>());
      std::memcpy(cards.back().get(), all.data() + sizeof(Card) * r, sizeof(Card));
      cards.back()->domains[sizeof Card::domains - 1] = 0;
      cards.back()->message[sizeof Card::message - 1] = 0;
    }
    for (int r = 0; r < num_ranks_; ++r)
      if (cards[r]->failed)
        throw Error(static_cast<ErrorCode>(cards[r]->code),
                    where() + ": rank " + std::to_string(r) +
                        " could not set up its libfabric engine: " + cards[r]->message);
    // Channel c talks to channel c of every peer, on the peer's domain c % n:
    // the keys it uses are those of that index, so n must agree.
    std::string counts;
    bool differ = false;
    for (int r = 0; r < num_ranks_; ++r) {
      differ = differ || cards[r]->num_rails != rails_.size();
      counts += std::string(r ? ", " : "") + "rank " + std::to_string(r) + " uses " +
                std::to_string(cards[r]->num_rails) + " (" + cards[r]->domains + ")";
    }
    if (differ)
      throw Error(ErrorCode::kInvalidArgument,
                  where() +
                      ": every rank must use the same number of libfabric domains (channel c "
                      "uses domain c % n on every rank; BufferOptions::fabric_domains or "
                      "EPX_FABRIC_DOMAINS): " +
                      counts);
    const std::size_t nr = rails_.size();
    control_remote_.resize(static_cast<std::size_t>(num_ranks_) * nr);
    for (int r = 0; r < num_ranks_; ++r) {
      const Card& theirs = *cards[r];
      for (std::size_t d = 0; d < nr; ++d) control_remote_[r * nr + d] = theirs.control[d];
      if (theirs.control[0].bytes != layout_.bytes)
        throw Error(ErrorCode::kInvalidArgument,
                    where() + ": rank " + std::to_string(r) +
                        " uses another channel count or window (control region of " +
                        std::to_string(theirs.control[0].bytes) + " bytes, this rank's " +
                        std::to_string(layout_.bytes) + ")");
      for (int c = 0; c < num_channels_; ++c) {
        Channel& ch = channels_[c];
        ch.addr.resize(static_cast<std::size_t>(num_ranks_), FI_ADDR_NOTAVAIL);
        const int n = fi_av_insert(ch.av, theirs.names[c], 1, &ch.addr[r], 0, nullptr);
        if (n != 1)
          throw Error(ErrorCode::kBootstrap, where(c) + ": fi_av_insert of rank " +
                                                 std::to_string(r) +
                                                 "'s address failed: " + fi_text(n));
      }
    }
    progress_ = std::thread([this] { progress_loop(); });
    barrier("setup");
  }

  /// This rank's side of the setup: the rails (a fabric and a domain per
  /// named domain), the channels on them, the control region registered in
  /// each; fills `card`.
  void open_local(Card& card) {
    const std::vector<std::string> names = parse_domains(opt_.domains);
    const std::size_t nr = names.empty() ? 1 : names.size();
    if (nr > static_cast<std::size_t>(kMaxRails) || nr > static_cast<std::size_t>(num_channels_))
      throw Error(ErrorCode::kInvalidArgument,
                  where() + ": " + std::to_string(nr) + " fabric domains (" + opt_.domains +
                      ") for " + std::to_string(num_channels_) +
                      " channels: channel c uses domain c % n, so at most one domain per "
                      "channel (num_qps_per_rank, EPX_PROXY_CHANNELS) and at most " +
                      std::to_string(kMaxRails));
    rails_.resize(nr);
    for (std::size_t d = 0; d < nr; ++d) {
      Rail& r = rails_[d];
      r.info = get_info(names.empty() ? std::string() : names[d], r.delivery_complete);
      const fi_info* info = r.info;
      prov_name_ = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : opt_.provider;
      r.name = info->domain_attr->name ? info->domain_attr->name : "";
      r.virt_addr = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0;
      r.prov_key = (info->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
      r.mr_endpoint = (info->domain_attr->mr_mode & FI_MR_ENDPOINT) != 0;
      r.max_msg = std::max<uint64_t>(info->ep_attr->max_msg_size, 4096);
      check(fi_fabric(info->fabric_attr, &r.fabric, nullptr), "fi_fabric");
      check(fi_domain(r.fabric, r.info, &r.domain, nullptr), "fi_domain");
    }
    channels_ = std::make_unique<Channel[]>(static_cast<std::size_t>(num_channels_));
    for (int c = 0; c < num_channels_; ++c) {
      Channel& ch = channels_[c];
      ch.rail = c % static_cast<int>(nr);
      const Rail& rail = rails_[ch.rail];
      ch.peers.assign(static_cast<std::size_t>(num_ranks_), Peer{});
      ch.slots = std::make_unique<Slot[]>(opt_.max_inflight);
      ch.sources.resize(static_cast<std::size_t>(num_ranks_));
      for (Source& s : ch.sources) {
        s.arrivals.assign(opt_.window, 0);
        s.have.assign(opt_.window, 0);
        s.entry.assign(opt_.window, MailboxEntry{});
      }
      fi_cq_attr cq_attr{};
      cq_attr.format = FI_CQ_FORMAT_DATA;
      cq_attr.wait_obj = FI_WAIT_NONE;
      cq_attr.size = 0;
      check(fi_cq_open(rail.domain, &cq_attr, &ch.cq, nullptr), "fi_cq_open");
      fi_av_attr av_attr{};
      av_attr.type = rail.info->domain_attr->av_type;
      av_attr.count = static_cast<std::size_t>(num_ranks_);
      check(fi_av_open(rail.domain, &av_attr, &ch.av, nullptr), "fi_av_open");
      check(fi_endpoint(rail.domain, rail.info, &ch.ep, nullptr), "fi_endpoint");
      check(fi_ep_bind(ch.ep, &ch.cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind (cq)");
      check(fi_ep_bind(ch.ep, &ch.av->fid, 0), "fi_ep_bind (av)");
      if (const int rc = fi_enable(ch.ep); rc == -FI_EBUSY && prov_name_ == "shm")
        throw Error(ErrorCode::kUnsupported,
                    where() + ": fi_enable failed: " + fi_text(rc) +
                        ": the shm provider names an endpoint's shared memory /dev/shm/" +
                        std::to_string(::getpid()) +
                        ":..., and a file of that name is left by an earlier process of this "
                        "pid that was killed; remove /dev/shm/" +
                        std::to_string(::getpid()) + ":*");
      else
        check(rc, "fi_enable");
      std::size_t len = kNameBytes;
      check(fi_getname(&ch.ep->fid, card.names[c], &len), "fi_getname");
      card.name_len[c] = static_cast<uint32_t>(len);
      char text[256] = {};
      std::size_t text_len = sizeof text;
      if (fi_av_straddr(ch.av, card.names[c], text, &text_len)) ch.address = text;
    }
    // The control region: mailboxes and credits, registered in every domain.
    layout_ = ControlLayout(num_ranks_, num_channels_, opt_.window);
    control_ = static_cast<char*>(std::aligned_alloc(4096, layout_.bytes));
    if (!control_)
      throw Error(ErrorCode::kInternal, where() + ": cannot allocate the control region");
    std::memset(control_, 0, layout_.bytes);
    for (std::size_t d = 0; d < nr; ++d) {
      Rail& r = rails_[d];
      r.control_mr = register_memory(static_cast<int>(d), control_, layout_.bytes, kMaxRegions + 1,
                                     "control region");
      r.control_desc = fi_mr_desc(r.control_mr);
      card.control[d] = {fi_mr_key(r.control_mr),
                         r.virt_addr ? reinterpret_cast<uint64_t>(control_) : 0, layout_.bytes};
    }
    card.num_rails = static_cast<uint32_t>(nr);
    std::snprintf(card.domains, sizeof card.domains, "%s", domain_names().c_str());
  }

  std::string domain_names() const {
    std::vector<std::string> v;
    for (const Rail& r : rails_) v.push_back(r.name);
    return join(v);
  }

  /// fi_getinfo for the provider on `domain` (empty: its first), telling
  /// apart "no such provider", "no such domain" and "it lacks FI_RMA / RDM /
  /// remote CQ data". `delivery` says whether FI_DELIVERY_COMPLETE was granted.
  fi_info* get_info(const std::string& domain, bool& delivery_complete) {
    InfoPtr any;
    {
      fi_info* h = make_hints(opt_.provider, "", false, false);
      const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, h, &any.p);
      fi_freeinfo(h);
      if (rc != 0 || !any.p)
        throw Error(ErrorCode::kInvalidArgument,
                    "libfabric engine: provider '" + opt_.provider +
                        "' is unknown or not available on this host (fi_getinfo: " + fi_text(rc) +
                        "; `fi_info -l` lists the providers)");
    }
    InfoPtr info;
    fi_info* chosen = nullptr;
    std::string layered;
    for (bool delivery : {true, false}) {
      fi_info* h = make_hints(opt_.provider, domain, true, delivery);
      const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, h, &info.p);
      fi_freeinfo(h);
      if (rc == 0 && info.p) {
        for (fi_info* i = info.p; i && !chosen; i = i->next)
          if (is_exact(i, opt_.provider, domain)) chosen = i;
        if (chosen) {
          delivery_complete = delivery;
          break;
        }
        if (layered.empty() && info.p->fabric_attr->prov_name)
          layered = info.p->fabric_attr->prov_name;
      }
      if (info.p) fi_freeinfo(info.p);
      info.p = nullptr;
    }
    if (!chosen && !domain.empty()) {
      const std::vector<std::string> have = domains_of(opt_.provider);
      if (std::find(have.begin(), have.end(), domain) == have.end()) {
        const char* iface = std::getenv("FI_TCP_IFACE");
        throw Error(
            ErrorCode::kInvalidArgument,
            "libfabric engine: provider '" + opt_.provider + "' has no domain '" + domain +
                "' (its domains: " + (have.empty() ? std::string("none") : join(have, ", ")) +
                "; `fi_info -p '" + opt_.provider +
                "'` lists them; BufferOptions::fabric_domains or EPX_FABRIC_DOMAINS)" +
                (iface && *iface && opt_.provider.find("tcp") != std::string::npos
                     ? std::string("; FI_TCP_IFACE=") + iface + " limits tcp to that interface"
                     : std::string()));
      }
    }
    if (!chosen) {
      bool rma = false, rdm = false;
      for (fi_info* i = any.p; i; i = i->next) {
        if (!is_exact(i, opt_.provider, "")) continue;
        rma = rma || (i->caps & FI_RMA) != 0;
        rdm = rdm || i->ep_attr->type == FI_EP_RDM;
      }
      std::string missing;
      if (!rma) missing = "FI_RMA";
      if (!rdm) missing += std::string(missing.empty() ? "" : " and ") + "FI_EP_RDM endpoints";
      if (missing.empty())
        missing = "FI_EP_RDM + FI_RMA with the memory registration modes and FI_THREAD_SAFE";
      throw Error(ErrorCode::kUnsupported,
                  "libfabric engine: provider '" + opt_.provider + "' lacks " + missing +
                      (domain.empty() ? "" : " on domain '" + domain + "'") +
                      " (the engine needs RMA writes on RDM endpoints)" +
                      (layered.empty() ? ""
                                       : "; libfabric offers them layered over it as '" + layered +
                                             "': ask for that"));
    }
    if (chosen->domain_attr->cq_data_size < 4)
      throw Error(ErrorCode::kUnsupported,
                  "libfabric engine: provider '" + opt_.provider +
                      "' lacks FI_REMOTE_CQ_DATA (cq_data_size " +
                      std::to_string(chosen->domain_attr->cq_data_size) +
                      "; the engine needs 4 bytes of immediate data per write)");
    // Only the first match is used: a copy of it alone.
    fi_info* first = fi_dupinfo(chosen);
    if (!first) throw Error(ErrorCode::kInternal, where() + ": fi_dupinfo failed");
    return first;
  }

  /// Registers [base, base + bytes) in rail `d`'s domain (bound to the rail's
  /// endpoints where the provider asks for FI_MR_ENDPOINT).
  fid_mr* register_memory(int d, void* base, std::size_t bytes, uint64_t key,
                          const std::string& what) {
    const Rail& rail = rails_[d];
    fid_mr* mr = nullptr;
    const uint64_t access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    // Keys the engine picks differ between domains (a region's key plus the
    // rail times the keys one rail uses), so a key sent on the wrong domain
    // is refused there rather than landing in another region.
    const uint64_t requested =
        rail.prov_key ? 0 : key + static_cast<uint64_t>(d) * (kMaxRegions + 2);
    int rc = fi_mr_reg(rail.domain, base, bytes, access, 0, requested, 0, &mr, nullptr);
    if (rc == 0 && rail.mr_endpoint) {
      for (int c = 0; c < num_channels_ && rc == 0; ++c)
        if (channels_[c].rail == d) rc = fi_mr_bind(mr, &channels_[c].ep->fid, 0);
      if (rc == 0) rc = fi_mr_enable(mr);
    }
    if (rc != 0) {
      if (mr) fi_close(&mr->fid);
      throw Error(ErrorCode::kUnsupported, where() + ": provider " + prov_name_ +
                                               " cannot register " + what + " (" +
                                               std::to_string(bytes) + " bytes of host memory at " +
                                               std::to_string(reinterpret_cast<uintptr_t>(base)) +
                                               ") in domain " + rail.name + ": " + fi_text(rc));
    }
    return mr;
  }

  /// Closes a region's registrations (every domain's) and forgets it.
  static void close_mrs(Local& l) {
    for (fid_mr* mr : l.mr)
      if (mr) close_fid(&mr->fid);
    l = Local{};
  }

  /// Every rank's `mine` (one entry per rail), rank-major.
  std::vector<RemoteRegion> gather(const std::vector<RemoteRegion>& mine, const std::string& what) {
    const std::size_t bytes = mine.size() * sizeof(RemoteRegion);
    std::vector<uint8_t> all;
    try {
      all = ex_->allgather(mine.data(), bytes);
    } catch (const Error& e) {
      throw Error(e.code(), where() + ": " + what + ": " + e.what());
    }
    std::vector<RemoteRegion> out(mine.size() * static_cast<std::size_t>(num_ranks_));
    if (all.size() != bytes * num_ranks_)
      throw Error(ErrorCode::kInternal, where() + ": " + what + ": the exchange returned " +
                                            std::to_string(all.size()) + " bytes");
    std::memcpy(out.data(), all.data(), all.size());
    return out;
  }

  const RemoteRegion& remote(int region, int peer, int rail) const {
    return remote_[region][static_cast<std::size_t>(peer) * rails_.size() + rail];
  }
  const RemoteRegion& control_remote(int peer, int rail) const {
    return control_remote_[static_cast<std::size_t>(peer) * rails_.size() + rail];
  }

  void barrier(const char* what) {
    try {
      ex_->barrier();
    } catch (const Error& e) {
      throw Error(e.code(), where() + ": " + what + ": " + e.what());
    }
  }

  void check(int rc, const char* call) {
    if (rc != 0)
      throw Error(ErrorCode::kUnsupported, where() + ": " + call + " failed: " + fi_text(rc));
  }

  static void close_fid(fid* f) {
    if (f) fi_close(f);
  }

  void close_all() {
    stop_.store(true, std::memory_order_relaxed);
    if (progress_.joinable()) progress_.join();
    for (auto& l : regions_) close_mrs(l);
    for (Rail& r : rails_) {
      if (r.control_mr) close_fid(&r.control_mr->fid);
      r.control_mr = nullptr;
    }
    if (channels_)
      for (int c = 0; c < num_channels_; ++c) {
        Channel& ch = channels_[c];
        if (ch.ep) close_fid(&ch.ep->fid);
        if (ch.av) close_fid(&ch.av->fid);
        if (ch.cq) close_fid(&ch.cq->fid);
        ch.ep = nullptr;
        ch.av = nullptr;
        ch.cq = nullptr;
      }
    for (Rail& r : rails_) {
      if (r.domain) close_fid(&r.domain->fid);
      if (r.fabric) close_fid(&r.fabric->fid);
      if (r.info) fi_freeinfo(r.info);
      r.domain = nullptr;
      r.fabric = nullptr;
      r.info = nullptr;
    }
    std::free(control_);
    control_ = nullptr;
  }

  // ---- the channel thread's side ----------------------------------------------

  Channel& channel_of(int c) {
    require(c >= 0 && c < num_channels_, "channel",
            "must be in [0, " + std::to_string(num_channels_) + "), got " + std::to_string(c));
    return channels_[c];
  }
  const RemoteRegion& target(int peer, int region, const char* what) const {
    if (peer < 0 || peer >= num_ranks_)
      throw Error(ErrorCode::kInvalidArgument,
                  where() + ": " + what + ": peer " + std::to_string(peer) +
                      " is not a rank (num_ranks " + std::to_string(num_ranks_) + ")");
    if (region < 0 || region >= kMaxRegions || !regions_[region].registered())
      throw Error(ErrorCode::kInvalidArgument, where() + ": " + what + " to rank " +
                                                   std::to_string(peer) + ": region " +
                                                   std::to_string(region) + " is not registered");
    return remote(region, peer, 0);  // the size, the same in every domain
  }

  void throw_if_failed(const Channel& ch) const {
    if (!ch.failed.load(std::memory_order_acquire)) return;
    std::lock_guard lock(ch.err_m);
    throw Error(ch.code, ch.error);
  }

  void fail(Channel& ch, ErrorCode code, const std::string& message) {
    std::lock_guard lock(ch.err_m);
    if (ch.failed.load(std::memory_order_relaxed)) return;
    ch.error = message;
    ch.code = code;
    ch.failed.store(true, std::memory_order_release);
  }

  /// Throws kTimeout when write `done` (the oldest incomplete one) is older than the timeout.
  void check_age(Channel& ch, int channel, uint64_t done) {
    const Slot& s = ch.slots[done & (opt_.max_inflight - 1)];
    const uint64_t t = s.t_ns.load(std::memory_order_relaxed);
    const uint64_t now = now_ns();
    if (t == 0 || now < t || now - t < timeout_ns_) return;
    const int peer = s.peer.load(std::memory_order_relaxed);
    fail(ch, ErrorCode::kTimeout,
         where(channel) + ": write " + std::to_string(done) + " to rank " + std::to_string(peer) +
             " on channel " + std::to_string(channel) + " has no completion after " +
             std::to_string(opt_.timeout_s) + " s (" + std::to_string(ch.posted - done) +
             " writes in flight; rank " + std::to_string(peer) +
             " stopped answering: did it die or stop progressing?" +
             (rails_[ch.rail].delivery_complete ? ")" : "; writes are transmit-complete only)"));
    throw_if_failed(ch);
  }

  /// Waits until epoch `p.epoch` may start for (channel, peer).
  void wait_credit(Channel& ch, int channel, int peer, const char* what) {
    const Peer& p = ch.peers[peer];
    auto* credit =
        reinterpret_cast<uint64_t*>(control_ + layout_.credit_in +
                                    (static_cast<std::size_t>(peer) * num_channels_ + channel) * 8);
    auto ok = [&] {
      return p.epoch - std::atomic_ref<uint64_t>(*credit).load(std::memory_order_acquire) <
             opt_.window;
    };
    if (ok()) return;
    const uint64_t t0 = now_ns();
    while (!ok()) {
      throw_if_failed(ch);
      if (now_ns() - t0 > timeout_ns_)
        fail(ch, ErrorCode::kTimeout,
             where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
                 std::to_string(channel) + ": no credit from rank " + std::to_string(peer) +
                 " after " + std::to_string(opt_.timeout_s) + " s (epoch " +
                 std::to_string(p.epoch) + ", rank " + std::to_string(peer) + " applied " +
                 std::to_string(std::atomic_ref<uint64_t>(*credit).load()) +
                 "; it stopped answering or its progress thread is stuck)");
      std::this_thread::yield();
    }
  }

  /// Posts one write with immediate data `imm` (FI_REMOTE_CQ_DATA) on channel
  /// `channel` and tracks its completion.
  void post(Channel& ch, int channel, int peer, void* src, uint64_t bytes, void* desc,
            uint64_t raddr, uint64_t key, uint32_t imm, bool with_data, const char* what) {
    const uint64_t seq = ch.posted;
    // A free slot in the completion window.
    if (seq - ch.done.load(std::memory_order_acquire) >= opt_.max_inflight) {
      const uint64_t t0 = now_ns();
      while (seq - ch.done.load(std::memory_order_acquire) >= opt_.max_inflight) {
        throw_if_failed(ch);
        check_age(ch, channel, ch.done.load(std::memory_order_acquire));
        if (now_ns() - t0 > timeout_ns_)  // (check_age throws first unless clocks misbehave)
          fail(ch, ErrorCode::kTimeout,
               where(channel) + ": " + what + " to rank " + std::to_string(peer) +
                   ": no free transmit slot");
        std::this_thread::yield();
      }
    }
    Slot& s = ch.slots[seq & (opt_.max_inflight - 1)];
    s.done.store(0, std::memory_order_relaxed);
    s.peer.store(peer, std::memory_order_relaxed);
    s.t_ns.store(now_ns(), std::memory_order_relaxed);
    iovec iov{src, bytes};
    fi_rma_iov rma{raddr, bytes, key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = ch.addr[peer];
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = reinterpret_cast<void*>(seq);
    msg.data = imm;
    const uint64_t flags = FI_COMPLETION | (with_data ? FI_REMOTE_CQ_DATA : 0) |
                           (rails_[ch.rail].delivery_complete ? FI_DELIVERY_COMPLETE : 0);
    // Count it before posting: its completion may come before fi_writemsg returns.
    ch.posted = seq + 1;
    const uint64_t t0 = now_ns();
    for (;;) {
      const ssize_t rc = fi_writemsg(ch.ep, &msg, flags);
      if (rc == 0) return;
      if (rc != -FI_EAGAIN) {
        fail(ch, ErrorCode::kTimeout,
             where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
                 std::to_string(channel) + ": fi_writemsg of " + std::to_string(bytes) +
                 " bytes failed: " + fi_text(static_cast<int>(rc)));
        throw_if_failed(ch);
      }
      throw_if_failed(ch);
      if (now_ns() - t0 > timeout_ns_)
        fail(ch, ErrorCode::kTimeout,
             where(channel) + ": " + what + " to rank " + std::to_string(peer) + " on channel " +
                 std::to_string(channel) + ": the transmit queue stayed full for " +
                 std::to_string(opt_.timeout_s) + " s (rank " + std::to_string(peer) +
                 " stopped answering?)");
      std::this_thread::yield();  // the progress thread drains the queue
    }
  }

  // ---- the progress thread ------------------------------------------------------

  void progress_loop() {
    std::array<fi_cq_data_entry, 64> e;
    std::vector<Held> held;
    std::mt19937 rng(static_cast<uint32_t>(rank_ * 7919 + 1));
    int idle = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      bool any = false;
      for (int c = 0; c < num_channels_; ++c) {
        Channel& ch = channels_[c];
        const ssize_t n = fi_cq_read(ch.cq, e.data(), e.size());
        if (n > 0) {
          any = true;
          for (ssize_t i = 0; i < n; ++i) {
            if (e[i].flags & FI_REMOTE_CQ_DATA) {
              ch.received.fetch_add(1, std::memory_order_relaxed);
              const uint32_t imm = static_cast<uint32_t>(e[i].data);
              if (opt_.test_reorder_window)
                held.push_back({c, imm});
              else
                on_remote(c, imm);
            } else if (e[i].flags & FI_REMOTE_WRITE) {
              // A write without data into our region (a credit): nothing to do.
            } else {
              on_local(c, reinterpret_cast<uint64_t>(e[i].op_context));
            }
          }
        } else if (n == -FI_EAVAIL) {
          any = true;
          on_error(c);
        } else if (n != -FI_EAGAIN && n < 0) {
          fail(ch, ErrorCode::kInternal,
               where(c) + ": fi_cq_read failed: " + fi_text(static_cast<int>(n)));
        }
        send_credits(c);
      }
      // The reorder hook: handle held completions in a random order, all of
      // them once a poll round brought nothing new.
      while (!held.empty() && (held.size() >= opt_.test_reorder_window || !any)) {
        const std::size_t k = rng() % held.size();
        const Held h = held[k];
        held[k] = held.back();
        held.pop_back();
        on_remote(h.channel, h.imm);
      }
      if (any) {
        idle = 0;
      } else if (++idle > 256) {
        std::this_thread::sleep_for(std::chrono::microseconds(idle > 20000 ? 50 : 2));
      }
    }
  }

  void on_local(int c, uint64_t context) {
    Channel& ch = channels_[c];
    if (context & kCreditTag) {
      const int src = static_cast<int>(context & 0xffffffu);
      if (src >= 0 && src < num_ranks_) ch.sources[src].credit_inflight = false;
      return;
    }
    ch.slots[context & (opt_.max_inflight - 1)].done.store(1, std::memory_order_relaxed);
    uint64_t d = ch.done.load(std::memory_order_relaxed);
    while (ch.slots[d & (opt_.max_inflight - 1)].done.load(std::memory_order_relaxed) == 1) {
      ch.slots[d & (opt_.max_inflight - 1)].done.store(2, std::memory_order_relaxed);
      ++d;
    }
    ch.done.store(d, std::memory_order_release);
  }

  void on_error(int c) {
    Channel& ch = channels_[c];
    fi_cq_err_entry err{};
    const ssize_t rc = fi_cq_readerr(ch.cq, &err, 0);
    if (rc < 0) return;
    char buf[256] = {};
    const char* prov = fi_cq_strerror(ch.cq, err.prov_errno, err.err_data, buf, sizeof buf);
    const uint64_t context = reinterpret_cast<uint64_t>(err.op_context);
    std::string who;
    if (err.flags & FI_REMOTE_CQ_DATA) {
      who = "an incoming write from rank " +
            std::to_string(fabric_imm::src_of(static_cast<uint32_t>(err.data)));
    } else if (context & kCreditTag) {
      who = "a credit write to rank " + std::to_string(context & 0xffffffu);
    } else {
      const int peer = ch.slots[context & (opt_.max_inflight - 1)].peer.load();
      who = "write " + std::to_string(context) + " to rank " + std::to_string(peer);
    }
    fail(ch, ErrorCode::kTimeout,
         where(c) + ": " + who + " on channel " + std::to_string(c) +
             " failed: " + fi_text(err.err) + ", provider: " + (prov ? prov : "?") +
             " (the peer died or its connection broke)");
  }

  void on_remote(int c, uint32_t imm) {
    Channel& ch = channels_[c];
    using fabric_imm::Kind;
    const Kind kind = fabric_imm::kind_of(imm);
    const int src = fabric_imm::src_of(imm);
    if ((kind != Kind::kPut && kind != Kind::kMailbox) || src >= num_ranks_) {
      fail(ch, ErrorCode::kInternal,
           where(c) + ": malformed immediate data " + std::to_string(imm) + " on channel " +
               std::to_string(c));
      return;
    }
    Source& s = ch.sources[src];
    uint64_t epoch = 0;
    if (!fabric_imm::full_epoch(imm, s.applied, opt_.window, epoch)) {
      fail(ch, ErrorCode::kInternal,
           where(c) + ": write from rank " + std::to_string(src) + " on channel " +
               std::to_string(c) + " for epoch bits " + std::to_string(fabric_imm::epoch_of(imm)) +
               " outside the window [" + std::to_string(s.applied) + ", +" +
               std::to_string(opt_.window) + ")");
      return;
    }
    const uint32_t slot = static_cast<uint32_t>(epoch & (opt_.window - 1));
    if (kind == Kind::kPut) {
      st_puts_.fetch_add(1, std::memory_order_relaxed);
      ++s.arrivals[slot];
    } else {
      st_signals_.fetch_add(1, std::memory_order_relaxed);
      const auto* box = reinterpret_cast<const MailboxEntry*>(
          control_ + layout_.mailbox +
          ((static_cast<std::size_t>(src) * num_channels_ + c) * opt_.window + slot) *
              sizeof(MailboxEntry));
      MailboxEntry m;
      std::memcpy(&m, box, sizeof m);
      if (m.epoch != epoch) {
        fail(ch, ErrorCode::kInternal,
             where(c) + ": mailbox entry " + std::to_string(slot) + " from rank " +
                 std::to_string(src) + " says epoch " + std::to_string(m.epoch) +
                 ", its immediate data " + std::to_string(epoch));
        return;
      }
      s.entry[slot] = m;
      s.have[slot] = 1;
      if (s.arrivals[slot] < m.puts) st_waited_.fetch_add(1, std::memory_order_relaxed);
    }
    apply(c, src);
  }

  /// Applies (source, channel)'s signals in epoch order while their puts are in.
  void apply(int c, int src) {
    Channel& ch = channels_[c];
    Source& s = ch.sources[src];
    for (;;) {
      const uint32_t slot = static_cast<uint32_t>(s.applied & (opt_.window - 1));
      if (!s.have[slot]) return;
      const MailboxEntry& m = s.entry[slot];
      if (s.arrivals[slot] < m.puts) return;
      if (s.arrivals[slot] > m.puts) {
        fail(ch, ErrorCode::kInternal,
             where(c) + ": rank " + std::to_string(src) + "'s epoch " + std::to_string(m.epoch) +
                 " on channel " + std::to_string(c) + " brought " +
                 std::to_string(s.arrivals[slot]) + " puts, its signal says " +
                 std::to_string(m.puts));
        return;
      }
      {
        std::lock_guard lock(region_m_);
        const Local& l = regions_[m.region < kMaxRegions ? m.region : 0];
        if (m.region >= kMaxRegions || !l.registered() || m.sig_off % 8 != 0 ||
            m.sig_off + 8 > l.bytes) {
          fail(ch, ErrorCode::kInternal,
               where(c) + ": signal from rank " + std::to_string(src) + " on channel " +
                   std::to_string(c) + " names region " + std::to_string(m.region) + " offset " +
                   std::to_string(m.sig_off) + ", not a word of a registered region");
          return;
        }
        auto* word = reinterpret_cast<uint64_t*>(l.base + m.sig_off);
        // Release: whoever reads the new value (acquire) sees the puts' bytes.
        std::atomic_ref<uint64_t>(*word).fetch_add(m.add, std::memory_order_release);
      }
      st_applied_.fetch_add(1, std::memory_order_relaxed);
      s.arrivals[slot] = 0;
      s.have[slot] = 0;
      ++s.applied;
    }
  }

  /// Writes back credits of channel c to the sources that are a quarter window behind.
  void send_credits(int c) {
    Channel& ch = channels_[c];
    const uint64_t every = std::max<uint32_t>(1, opt_.window / 4);
    for (int src = 0; src < num_ranks_; ++src) {
      Source& s = ch.sources[src];
      if (s.credit_inflight || s.applied - s.credit_sent < every) continue;
      auto* value = reinterpret_cast<uint64_t*>(
          control_ + layout_.credit_out + (static_cast<std::size_t>(src) * num_channels_ + c) * 8);
      *value = s.applied;
      const RemoteRegion& ctl = control_remote(src, ch.rail);
      const uint64_t raddr =
          ctl.base + layout_.credit_in + (static_cast<uint64_t>(rank_) * num_channels_ + c) * 8;
      void* desc = rails_[ch.rail].control_desc;
      const ssize_t rc = fi_write(ch.ep, value, 8, desc, ch.addr[src], raddr, ctl.key,
                                  reinterpret_cast<void*>(kCreditTag | static_cast<uint64_t>(src)));
      if (rc == -FI_EAGAIN) continue;  // next round
      if (rc != 0) {
        fail(ch, ErrorCode::kTimeout,
             where(c) + ": credit write to rank " + std::to_string(src) + " on channel " +
                 std::to_string(c) + " failed: " + fi_text(static_cast<int>(rc)));
        continue;
      }
      s.credit_inflight = true;
      s.credit_sent = s.applied;
      st_credits_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::shared_ptr<Exchange> ex_;
  LibfabricOptions opt_;
  int rank_ = 0, num_ranks_ = 1, num_channels_ = 1;
  uint64_t timeout_ns_ = 0;
  std::string prov_name_;
  std::vector<Rail> rails_;  ///< channel c on rails_[c % size]
  std::unique_ptr<Channel[]> channels_;
  ControlLayout layout_{1, 1, 4};
  char* control_ = nullptr;
  /// Every rank's control region, [rank * rails + rail].
  std::vector<RemoteRegion> control_remote_;
  std::array<Local, kMaxRegions> regions_{};
  /// Every rank's registration of each region, [region][rank * rails + rail].
  std::array<std::vector<RemoteRegion>, kMaxRegions> remote_;
  std::mutex region_m_;
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> st_puts_{0}, st_signals_{0}, st_applied_{0}, st_waited_{0}, st_credits_{0};
};

}  // namespace

std::unique_ptr<Exchange> make_communicator_exchange(Communicator& comm) {
  return std::make_unique<CommunicatorExchange>(comm);
}

std::unique_ptr<Engine> make_libfabric_engine(std::shared_ptr<Exchange> exchange, int num_channels,
                                              const LibfabricOptions& options) {
  return std::make_unique<LibfabricEngine>(std::move(exchange), num_channels, options);
}

std::vector<std::string> libfabric_domains(const std::string& provider) {
  return domains_of(provider);
}

LibfabricStats libfabric_stats(const Engine& engine) {
  const auto* e = dynamic_cast<const LibfabricEngine*>(&engine);
  require(e != nullptr, "engine",
          std::string("is not a libfabric engine (it is '") + engine.name() + "')");
  return e->stats();
}

}  // namespace epx::proxy
