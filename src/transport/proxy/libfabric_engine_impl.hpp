// transport/proxy/libfabric_engine_impl.hpp - the libfabric engine's class, shared by
// its setup (libfabric_setup.cpp), its channel and progress threads
// (libfabric_progress.cpp) and its factories (libfabric_engine.cpp).
#pragma once

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

#include "transport/proxy/libfabric_engine.hpp"

namespace epx::proxy::fabric {

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

inline uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline std::string fi_text(int err) {
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
inline fi_info* make_hints(const std::string& provider, const std::string& domain, bool full,
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
inline bool is_exact(const fi_info* i, const std::string& provider, const std::string& domain) {
  if (!i->fabric_attr->prov_name || provider != i->fabric_attr->prov_name) return false;
  return domain.empty() || (i->domain_attr->name && domain == i->domain_attr->name);
}

inline std::vector<std::string> domains_of(const std::string& provider) {
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

inline std::string join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

/// LibfabricOptions::domains as names: split at commas, blanks around a name
/// dropped; an empty name or a name given twice is an error.
inline std::vector<std::string> parse_domains(const std::string& list) {
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
    /// An incoming write's error completion, held for incoming_grace_ns() (0: none): a
    /// target's view of a broken transfer, which a peer's death also gives the
    /// other ranks' incoming writes (seen over shm: a survivor's incoming write from
    /// another survivor failed as the first one's deadline for the dead rank passed).
    /// The channel fails with it only if nothing else failed it meanwhile, so a
    /// deadline that names the rank that stopped answering wins.
    std::string incoming_error;
    uint64_t incoming_error_ns = 0;
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
  void open();

  /// This rank's side of the setup: the rails (a fabric and a domain per
  /// named domain), the channels on them, the control region registered in
  /// each; fills `card`.
  void open_local(Card& card);

  std::string domain_names() const;

  /// fi_getinfo for the provider on `domain` (empty: its first), telling
  /// apart "no such provider", "no such domain" and "it lacks FI_RMA / RDM /
  /// remote CQ data". `delivery` says whether FI_DELIVERY_COMPLETE was granted.
  fi_info* get_info(const std::string& domain, bool& delivery_complete);

  /// Registers [base, base + bytes) in rail `d`'s domain (bound to the rail's
  /// endpoints where the provider asks for FI_MR_ENDPOINT).
  fid_mr* register_memory(int d, void* base, std::size_t bytes, uint64_t key,
                          const std::string& what);

  /// Closes a region's registrations (every domain's) and forgets it.
  static void close_mrs(Local& l);

  /// Every rank's `mine` (one entry per rail), rank-major.
  std::vector<RemoteRegion> gather(const std::vector<RemoteRegion>& mine, const std::string& what);

  const RemoteRegion& remote(int region, int peer, int rail) const;
  const RemoteRegion& control_remote(int peer, int rail) const;

  void barrier(const char* what);

  void check(int rc, const char* call);

  static void close_fid(fid* f);

  void close_all();

  // ---- the channel thread's side ----------------------------------------------

  Channel& channel_of(int c);
  const RemoteRegion& target(int peer, int region, const char* what) const;

  void throw_if_failed(const Channel& ch) const;

  void fail(Channel& ch, ErrorCode code, const std::string& message);

  /// Throws kTimeout when write `done` (the oldest incomplete one) is older than the timeout.
  void check_age(Channel& ch, int channel, uint64_t done);

  /// Waits until epoch `p.epoch` may start for (channel, peer).
  void wait_credit(Channel& ch, int channel, int peer, const char* what);

  /// Posts one write with immediate data `imm` (FI_REMOTE_CQ_DATA) on channel
  /// `channel` and tracks its completion.
  void post(Channel& ch, int channel, int peer, void* src, uint64_t bytes, void* desc,
            uint64_t raddr, uint64_t key, uint32_t imm, bool with_data, const char* what);

  // ---- the progress thread ------------------------------------------------------

  void progress_loop();

  void on_local(int c, uint64_t context);

  void on_error(int c);

  void on_remote(int c, uint32_t imm);

  /// Applies (source, channel)'s signals in epoch order while their puts are in.
  void apply(int c, int src);

  /// Writes back credits of channel c to the sources that are a quarter window behind.
  void send_credits(int c);

  std::shared_ptr<Exchange> ex_;
  LibfabricOptions opt_;
  int rank_ = 0, num_ranks_ = 1, num_channels_ = 1;
  uint64_t timeout_ns_ = 0;
  /// How long an incoming write's error waits for another failure (Channel::incoming_error).
  uint64_t incoming_grace_ns() const {
    return std::min<uint64_t>(2'000'000'000ull, timeout_ns_ / 2);
  }
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

}  // namespace epx::proxy::fabric
