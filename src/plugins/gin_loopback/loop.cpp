// plugins/gin_loopback/loop.cpp - the loopback GIN plugin's logic.
#include "plugins/gin_loopback/loop.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace epx::gin_loop {
namespace {

std::string num(uint64_t v) {
  return std::to_string(v);
}

void* map_fd(int fd, std::size_t bytes, const std::string& what) {
  // A descriptor from a peer: mapping past its end would fault at first use.
  struct stat st {};
  if (fstat(fd, &st) != 0)
    throw PluginError(ncclSystemError, "fstat of " + what + " failed: " + std::strerror(errno));
  if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < bytes)
    throw PluginError(ncclInvalidUsage, what + " is a descriptor of " + num(st.st_size) +
                                            " bytes, shorter than the " + num(bytes) +
                                            " bytes to map");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    throw PluginError(ncclSystemError, "mapping " + what + " failed: " + std::strerror(errno));
  return p;
}

// Request handles encode (peer, seq) instead of pointing at a slot, so a stale
// or foreign handle is detected without dereferencing it.
constexpr int kSeqBits = 40;
void* encode(uint32_t peer, uint64_t seq) {
  return reinterpret_cast<void*>((static_cast<uintptr_t>(peer) << kSeqBits) |
                                 (seq & ((uint64_t{1} << kSeqBits) - 1)));
}

}  // namespace

Config read_config() {
  Config c;
  if (const char* s = std::getenv("EPX_GIN_LOOP_DEPTH")) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (!*s || *end || v < 32 || v > 65536 || (v & (v - 1)))
      throw PluginError(ncclInvalidArgument, std::string("EPX_GIN_LOOP_DEPTH='") + s +
                                                 "': must be a power of two in [32, 65536]");
    c.depth = static_cast<int>(v);
  }
  if (const char* s = std::getenv("EPX_GIN_LOOP_STALL_AFTER_S")) {
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    if (!*s || *end || !(v >= 0))
      throw PluginError(ncclInvalidArgument, std::string("EPX_GIN_LOOP_STALL_AFTER_S='") + s +
                                                 "': must be a number of seconds >= 0");
    c.stall_after_s = v;
  }
  for (const char* name : {"EPX_GIN_LOOP_TIMEOUT_S", "EPX_TIMEOUT_S"}) {
    const char* s = std::getenv(name);
    if (!s) continue;
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    if (!*s || *end || !(v > 0))
      throw PluginError(ncclInvalidArgument,
                        std::string(name) + "='" + s + "': must be a number of seconds > 0");
    c.timeout_s = v;
    break;
  }
  return c;
}

void log_warn(ncclDebugLogger_t log, const char* where, const std::string& text) {
  if (log) log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, "EPX-LOOP %s: %s", where, text.c_str());
}

// ---- connect / close ---------------------------------------------------------------

Comm::Comm(const Context& ctx, ListenComm& listen, const std::vector<const MeshHandle*>& handles,
           int rank)
    : log_(ctx.log),
      config_(ctx.config),
      rank_(rank),
      nranks_(static_cast<int>(handles.size())),
      memops_(make_memops(nranks_, config_.depth, config_.timeout_s)) {
  try {
    mesh_ = std::make_unique<Mesh>(handles, rank, *listen.listener, config_.timeout_s);
  } catch (const MeshError& e) {
    throw PluginError(ncclSystemError, e.what());
  }
  for (const std::string& r : mesh_->rejected()) log_warn(log_, "connect", r);
  // This rank's inbox: one ring per source rank, in a memfd every rank maps.
  ring_bytes_ = SignalRing::bytes_for(static_cast<uint64_t>(config_.depth));
  const std::size_t inbox_bytes = ring_bytes_ * static_cast<std::size_t>(nranks_);
  inbox_fd_ = memfd_create("epx-gin-loop-inbox", MFD_CLOEXEC);
  if (inbox_fd_ < 0)
    throw PluginError(ncclSystemError, std::string("memfd_create: ") + std::strerror(errno));
  if (ftruncate(inbox_fd_, static_cast<off_t>(inbox_bytes)) != 0) {
    const int e = errno;
    free_all();
    throw PluginError(ncclSystemError, std::string("inbox ftruncate: ") + std::strerror(e));
  }
  try {
    inbox_ = map_fd(inbox_fd_, inbox_bytes, "this rank's signal inbox");
  } catch (...) {
    free_all();
    throw;
  }
  peer_inboxes_.assign(static_cast<std::size_t>(nranks_), nullptr);
  for (int s = 0; s < nranks_; ++s)
    from_.emplace_back(static_cast<char*>(inbox_) + ring_bytes_ * s,
                       static_cast<uint64_t>(config_.depth));
  std::vector<Mesh::Item> items;
  try {
    items = mesh_->allgather("inbox", inbox_fd_, "connect (signal inbox exchange)");
    for (int t = 0; t < nranks_; ++t) {
      if (t == rank_) {
        peer_inboxes_[t] = inbox_;
        continue;
      }
      if (items[t].fd < 0)
        throw PluginError(ncclInternalError, "rank " + num(t) + " sent no inbox descriptor");
      peer_inboxes_[t] = map_fd(items[t].fd, inbox_bytes, "rank " + num(t) + "'s signal inbox");
    }
  } catch (const MeshError& e) {
    for (auto& it : items)
      if (it.fd >= 0) ::close(it.fd);
    free_all();
    throw PluginError(ncclSystemError, e.what());
  } catch (...) {
    for (auto& it : items)
      if (it.fd >= 0) ::close(it.fd);
    free_all();
    throw;
  }
  for (auto& it : items)
    if (it.fd >= 0) ::close(it.fd);
  peers_.resize(static_cast<std::size_t>(nranks_));
  for (int t = 0; t < nranks_; ++t) {
    peers_[t].slots.resize(static_cast<std::size_t>(config_.depth));
    peers_[t].ring = SignalRing(static_cast<char*>(peer_inboxes_[t]) + ring_bytes_ * rank_,
                                static_cast<uint64_t>(config_.depth));
  }
}

Comm::~Comm() {
  free_all();
}

void Comm::free_all() {
  for (Registration* r : regs_) {
    for (auto& p : r->peers)
      if (p.map_base) release_quietly(p);
    delete r;
  }
  regs_.clear();
  const std::size_t inbox_bytes = ring_bytes_ * static_cast<std::size_t>(nranks_);
  for (int t = 0; t < static_cast<int>(peer_inboxes_.size()); ++t)
    if (peer_inboxes_[t] && t != rank_) munmap(peer_inboxes_[t], inbox_bytes);
  peer_inboxes_.clear();
  if (inbox_) munmap(inbox_, inbox_bytes), inbox_ = nullptr;
  if (inbox_fd_ >= 0) ::close(inbox_fd_), inbox_fd_ = -1;
  mesh_.reset();
}

void Comm::close() {
  try {
    mesh_->barrier("closeColl");
  } catch (const MeshError& e) {
    throw PluginError(ncclSystemError, e.what());
  }
}

// ---- registration --------------------------------------------------------------------

Registration* Comm::reg_mr_sym(void* data, std::size_t size, int type, uint64_t /*flags*/) {
  if (!data || size == 0)
    throw PluginError(ncclInvalidArgument, "data must be non-null and size > 0 (got data " +
                                               std::string(data ? "set" : "NULL") + ", size " +
                                               num(size) + ")");
  Export ex;
  try {
    ex = memops_->classify(data, size, type);
  } catch (const MemOpsError& e) {
    throw PluginError(ncclInvalidArgument, e.what());
  }
  uint64_t id;
  {
    std::lock_guard lock(m_);
    id = next_reg_id_++;
    registering_ = id;
  }
  RegRecord mine{id,
                 size,
                 ex.alloc_bytes,
                 ex.offset,
                 static_cast<uint32_t>(ex.kind),
                 static_cast<uint32_t>(type),
                 ex.device ? 1u : 0u,
                 0};
  std::vector<Mesh::Item> items;
  auto reg = std::make_unique<Registration>();
  reg->comm = this;
  reg->id = id;
  reg->local = static_cast<char*>(data);
  reg->size = size;
  reg->device = ex.device;
  reg->peers.resize(static_cast<std::size_t>(nranks_));
  auto close_export = [&] {
    if (ex.close_fd && ex.fd >= 0) ::close(ex.fd), ex.fd = -1;
  };
  auto cleanup = [&] {
    close_export();
    for (auto& it : items)
      if (it.fd >= 0) ::close(it.fd), it.fd = -1;
    for (auto& p : reg->peers)
      if (p.map_base) release_quietly(p);
    std::lock_guard lock(m_);
    registering_ = 0;
  };
  try {
    items = mesh_->allgather(std::string(reinterpret_cast<const char*>(&mine), sizeof mine),
                             ex.kind == RegionKind::kExportable ? ex.fd : -1, "regMrSym");
    for (int r = 0; r < nranks_; ++r) {
      RegRecord rec{};
      if (items[r].bytes.size() != sizeof rec)
        throw PluginError(ncclInternalError, "malformed registration record from rank " + num(r));
      std::memcpy(&rec, items[r].bytes.data(), sizeof rec);
      if (rec.id != id)
        throw PluginError(ncclInvalidUsage, "regMrSym is collective: rank " + num(r) +
                                                " made its registration #" + num(rec.id) +
                                                " while rank " + num(rank_) + " made #" + num(id));
      if (rec.kind != static_cast<uint32_t>(RegionKind::kExportable) &&
          rec.kind != static_cast<uint32_t>(RegionKind::kLocalOnly))
        throw PluginError(ncclInternalError, "rank " + num(r) + " sent region kind " +
                                                 num(rec.kind) + ", which is none");
      // What this rank maps and writes of the peer's range: [offset, offset +
      // size) of its allocation of alloc_bytes (checked without overflow).
      if (r != rank_ && rec.kind == static_cast<uint32_t>(RegionKind::kExportable) &&
          (rec.offset > rec.alloc_bytes || rec.size > rec.alloc_bytes - rec.offset))
        throw PluginError(ncclInvalidUsage,
                          "rank " + num(r) + " describes its registration as " + num(rec.size) +
                              " bytes at offset " + num(rec.offset) + " of an allocation of " +
                              num(rec.alloc_bytes) + " bytes, which does not hold it");
      auto& p = reg->peers[r];
      p.kind = static_cast<RegionKind>(rec.kind);
      p.device = rec.device != 0;
      p.size = rec.size;
      if (r == rank_) {
        p.ptr = reg->local;
      } else if (p.kind == RegionKind::kExportable) {
        if (items[r].fd < 0)
          throw PluginError(ncclInternalError, "rank " + num(r) + " sent no descriptor");
        p.map_base = memops_->import(items[r].fd, rec.alloc_bytes, p.device, r);
        p.map_bytes = rec.alloc_bytes;
        p.ptr = static_cast<char*>(p.map_base) + rec.offset;
      }
    }
  } catch (const MeshError& e) {
    cleanup();
    throw PluginError(ncclSystemError, e.what());
  } catch (const MemOpsError& e) {
    cleanup();
    throw PluginError(ncclSystemError, e.what());
  } catch (...) {
    cleanup();
    throw;
  }
  close_export();
  for (auto& it : items)
    if (it.fd >= 0) ::close(it.fd);
  std::lock_guard lock(m_);
  registering_ = 0;
  regs_.insert(reg.get());
  return reg.release();
}

void Comm::dereg_mr_sym(void* mhandle) {
  Registration* r;
  {
    std::lock_guard lock(m_);
    r = lookup(mhandle, "mhandle");
    regs_.erase(r);
  }
  std::unique_ptr<Registration> owned(r);
  std::string first_error;
  for (auto& p : r->peers) {
    if (!p.map_base) continue;
    void* base = std::exchange(p.map_base, nullptr);
    try {
      memops_->release(base, p.map_bytes, p.device);
    } catch (const MemOpsError& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  if (!first_error.empty())  // every mapping was still released (or tried)
    throw PluginError(ncclSystemError, "deregMrSym: " + first_error);
}

void Comm::release_quietly(Registration::Peer& p) {
  void* base = std::exchange(p.map_base, nullptr);
  try {
    memops_->release(base, p.map_bytes, p.device);
  } catch (const MemOpsError& e) {
    log_warn(log_, "release", e.what());
  }
}

Registration* Comm::lookup(void* mh, const char* arg) const {
  auto* r = static_cast<Registration*>(mh);
  if (!regs_.count(r))
    throw PluginError(
        ncclInvalidArgument,
        std::string(arg) + " " + (mh ? "is not a live registration of this collComm" : "is NULL"));
  return r;
}

// ---- errors --------------------------------------------------------------------------

void Comm::fail(ncclResult_t code, const std::string& what) {
  if (sticky_ == ncclSuccess) {
    sticky_ = code;
    sticky_what_ = "rank " + num(rank_) + ": " + what;
  }
  throw PluginError(code, "rank " + num(rank_) + ": " + what);
}

void Comm::check_sticky() const {
  if (sticky_ != ncclSuccess)
    throw PluginError(sticky_, "an earlier error stopped this collComm: " + sticky_what_);
}

// ---- puts ------------------------------------------------------------------------------

void* Comm::iput(uint64_t src_off, void* src_mh, std::size_t size, uint64_t dst_off, void* dst_mh,
                 uint32_t peer, bool signal, uint64_t sig_off, void* sig_mh, uint64_t sig_value,
                 uint32_t sig_op) {
  std::lock_guard lock(m_);
  check_sticky();
  const char* op = signal ? "iputSignal" : "iput";
  if (peer >= static_cast<uint32_t>(nranks_))
    fail(ncclInvalidArgument,
         std::string(op) + ": rank " + num(peer) + " is not in [0, " + num(nranks_) + ")");
  char* src = nullptr;
  char* dst = nullptr;
  bool src_device = false, dst_device = false;  // GPU memory: the CUDA path
  if (size > 0) {
    Registration* s;
    Registration* d;
    try {
      s = lookup(src_mh, "srcMhandle");
      d = lookup(dst_mh, "dstMhandle");
    } catch (const PluginError& e) {
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": " + e.what());
    }
    if (src_off > s->size || size > s->size - src_off)
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": source [" +
                                    num(src_off) + ", +" + num(size) +
                                    ") is outside its registration of " + num(s->size) + " bytes");
    const auto& dp = d->peers[peer];
    if (dst_off > dp.size || size > dp.size - dst_off)
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": destination [" +
                                    num(dst_off) + ", +" + num(size) + ") is outside rank " +
                                    num(peer) + "'s registration of " + num(dp.size) + " bytes");
    if (!dp.ptr)
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) +
                                    ": the destination registration is " + to_string(dp.kind) +
                                    " at rank " + num(peer) +
                                    "; only its own process can write it");
    src = s->local + src_off;
    dst = dp.ptr + dst_off;
    src_device = s->device;
    dst_device = dp.device;
  } else if (!signal) {
    // A size-0 iput moves nothing; it is still a request in order.
  }
  SignalEntry entry{};
  if (signal) {
    Registration* g;
    try {
      g = lookup(sig_mh, "signalMhandle");
    } catch (const PluginError& e) {
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": " + e.what());
    }
    const uint64_t target_size = g->peers[peer].size;
    if (sig_off % 8 || sig_off > target_size || target_size - sig_off < 8)
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": signalOff " +
                                    num(sig_off) + " is not an 8-byte word of rank " + num(peer) +
                                    "'s signal registration of " + num(target_size) + " bytes");
    if (sig_op != NCCL_NET_SIGNAL_OP_INC && sig_op != NCCL_NET_SIGNAL_OP_ADD)
      fail(ncclInvalidArgument, std::string(op) + " to rank " + num(peer) + ": signalOp " +
                                    num(sig_op) + " is neither INC (1) nor ADD (2)");
    entry = SignalEntry{g->id, sig_off, sig_op == NCCL_NET_SIGNAL_OP_INC ? 1 : sig_value, 0};
  }
  Peer& p = peers_[peer];
  const uint64_t seq = p.next_seq;
  Slot& slot = p.slots[seq & static_cast<uint64_t>(config_.depth - 1)];
  if (slot.busy)
    fail(ncclInternalError,
         std::string(op) + " to rank " + num(peer) + ": ring overrun: " + num(config_.depth) +
             " requests to this peer are live (not yet tested done); NCCL keeps at most " +
             "32 * maxRecvs = " + num(config_.depth) + " per (context, peer)");
  try {
    if (size > 0)
      memops_->copy_async(static_cast<int>(peer), dst, dst_device, src, src_device, size);
    memops_->mark(static_cast<int>(peer), seq);
  } catch (const MemOpsError& e) {
    fail(ncclSystemError, std::string(op) + " to rank " + num(peer) + ": " + e.what());
  }
  ++p.next_seq;
  slot = Slot{seq, true, signal};
  if (signal) {
    p.outbox.push_back(Pending{seq, entry});
    pump(static_cast<int>(peer));
  }
  return encode(peer, seq);
}

void Comm::pump(int peer) {
  Peer& p = peers_[peer];
  if (p.outbox.empty()) return;
  const uint64_t completed = memops_->completed(peer);
  while (!p.outbox.empty() && p.outbox.front().seq <= completed) {
    if (!p.ring.push(p.outbox.front().entry)) return;  // the target's ring is full: later
    p.posted = p.outbox.front().seq;
    p.outbox.pop_front();
  }
}

bool Comm::test(void* request) {
  std::lock_guard lock(m_);
  const auto bits = reinterpret_cast<uintptr_t>(request);
  const auto peer = static_cast<uint64_t>(bits >> kSeqBits);
  const uint64_t seq_low = bits & ((uint64_t{1} << kSeqBits) - 1);
  if (peer >= static_cast<uint64_t>(nranks_) || seq_low == 0)
    fail(ncclInvalidArgument, "test: request " + num(bits) + " was not returned by iput");
  Peer& p = peers_[peer];
  Slot& slot = p.slots[seq_low & static_cast<uint64_t>(config_.depth - 1)];
  if (!slot.busy || (slot.seq & ((uint64_t{1} << kSeqBits) - 1)) != seq_low)
    fail(ncclInvalidArgument, "test: request " + num(seq_low) + " to rank " + num(peer) +
                                  " is not live (already reported done, or never issued)");
  pump(static_cast<int>(peer));
  if (config_.stall_after_s >= 0 &&
      std::chrono::duration<double>(std::chrono::steady_clock::now() - connected_).count() >=
          config_.stall_after_s)
    return false;  // a network that stopped completing (EPX_GIN_LOOP_STALL_AFTER_S)
  if (memops_->completed(static_cast<int>(peer)) < slot.seq) return false;
  if (slot.signalled && p.posted < slot.seq) return false;
  slot.busy = false;
  return true;
}

// ---- signals at the target -------------------------------------------------------------

// Every entry of the inbox is a put that completed at its source, so the
// adds of one drain may land in any order: they are gathered from every
// source first and applied together (memops merge the adds to one word and
// read the GPU words back with one wait, instead of one per add).
void Comm::drain_inbox() {
  adds_.clear();
  for (int s = 0; s < nranks_; ++s) {
    from_[s].drain([&](const SignalEntry& e) {
      Registration* g = nullptr;
      for (Registration* r : regs_)
        if (r->id == e.reg_id) g = r;
      if (!g) {
        if (e.reg_id == registering_) return false;  // our registration is still in its collective
        fail(ncclInternalError, "a signal from rank " + num(s) + " names registration #" +
                                    num(e.reg_id) + ", which this rank does not hold");
      }
      if (e.offset % 8 || e.offset > g->size || g->size - e.offset < 8)
        fail(ncclInternalError, "a signal from rank " + num(s) + " names offset " + num(e.offset) +
                                    " of registration #" + num(e.reg_id) + " (" + num(g->size) +
                                    " bytes)");
      adds_.push_back({reinterpret_cast<uint64_t*>(g->local + e.offset), e.add, g->device});
      return true;
    });
  }
  if (adds_.empty()) return;
  const std::size_t n = adds_.size();
  try {
    memops_->add_words(adds_);
  } catch (const MemOpsError& err) {
    fail(ncclSystemError, "applying " + num(n) + " signal add(s) from the inbox: " + err.what());
  }
}

void Comm::progress() {
  std::lock_guard lock(m_);
  try {
    memops_->poll();  // a copy or mark that failed on its stream
  } catch (const MemOpsError& e) {
    fail(ncclSystemError, e.what());
  }
  for (int t = 0; t < nranks_; ++t) pump(t);
  drain_inbox();
}

}  // namespace epx::gin_loop
