// plugins/gin_loopback/loop.hpp - the loopback GIN plugin's logic, below the
// C tables of plugin.cpp: contexts, listen / connect, symmetric registration,
// the request-slot rings, the signal outboxes and inboxes, sticky errors.
//
// One Comm per GIN collComm (one per NCCL GIN context). Threading: NCCL's
// progress thread calls iput / iput_signal / test / progress while the user
// thread may call reg_mr_sym / dereg_mr_sym; a per-Comm mutex guards the
// state, and the mesh collectives run outside it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/host_mesh.hpp"
#include "plugins/gin_loopback/abi.hpp"
#include "plugins/gin_loopback/inbox.hpp"
#include "plugins/gin_loopback/memops.hpp"

namespace epx::gin_loop {

using host_mesh::Mesh;
using host_mesh::MeshError;
using host_mesh::MeshHandle;
using host_mesh::MeshListener;

/// An error for NCCL: the result code and the sentence logged with it.
class PluginError : public std::runtime_error {
 public:
  PluginError(ncclResult_t code, const std::string& what) : std::runtime_error(what), code(code) {}
  ncclResult_t code;
};

/// Knobs read at init.
struct Config {
  int depth = 512;        ///< EPX_GIN_LOOP_DEPTH: requests per (collComm, peer), power of 2
  double timeout_s = 60;  ///< EPX_GIN_LOOP_TIMEOUT_S, else EPX_TIMEOUT_S: every wait
  /// EPX_GIN_LOOP_STALL_AFTER_S (tests; < 0: never): seconds after a
  /// communicator connects from which `test` reports no request done again,
  /// as a network that stopped completing (the bytes still move): what a
  /// quiet with a deadline must name instead of hanging.
  double stall_after_s = -1;
};
/// Reads the environment; throws PluginError(ncclInvalidArgument) naming a bad variable.
Config read_config();

/// Logs through NCCL's logger (may be null) as "EPX-LOOP <where>: <text>".
void log_warn(ncclDebugLogger_t log, const char* where, const std::string& text);

struct Context {
  uint64_t comm_id = 0;
  ncclDebugLogger_t log = nullptr;
  Config config;
};

struct ListenComm {
  Context* ctx = nullptr;
  MeshHandle handle{};
  std::unique_ptr<MeshListener> listener;
};

class Comm;

/// What regMrSym allgathers of each rank's range (the mesh's wire format).
struct RegRecord {
  uint64_t id, size, alloc_bytes, offset;
  uint32_t kind, type, device, pad;
};

/// A symmetric registration: mhandle == ginHandle.
struct Registration {
  Comm* comm = nullptr;
  uint64_t id = 0;  ///< collective sequence number, equal on every rank
  char* local = nullptr;
  std::size_t size = 0;
  bool device = false;  ///< this rank's range is GPU memory (MemOps' CUDA path)
  struct Peer {
    RegionKind kind = RegionKind::kLocalOnly;
    bool device = false;  ///< that rank's range is GPU memory
    uint64_t size = 0;
    char* ptr = nullptr;       ///< where this process reaches the peer's range (nullptr: it cannot)
    void* map_base = nullptr;  ///< imported allocation (released at deregistration)
    uint64_t map_bytes = 0;
  };
  std::vector<Peer> peers;
};

class Comm {
 public:
  /// Collective (connect): builds the mesh and exchanges the signal inboxes.
  Comm(const Context& ctx, ListenComm& listen, const std::vector<const MeshHandle*>& handles,
       int rank);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return nranks_; }
  ncclDebugLogger_t logger() const { return log_; }

  /// Collective: registers [data, data + size) and learns every rank's range.
  Registration* reg_mr_sym(void* data, std::size_t size, int type, uint64_t flags);
  void dereg_mr_sym(void* mhandle);

  /// Returns the request (opaque, non-null). Throws PluginError; every error
  /// of this Comm is sticky and thrown again by later iput / iput_signal.
  void* iput(uint64_t src_off, void* src_mh, std::size_t size, uint64_t dst_off, void* dst_mh,
             uint32_t peer, bool signal, uint64_t sig_off, void* sig_mh, uint64_t sig_value,
             uint32_t sig_op);
  /// Whether `request` is done (then its slot is free); drives the outboxes.
  bool test(void* request);
  /// Moves signals to the targets' inboxes and applies this rank's inbox.
  void progress();
  /// Collective teardown barrier (deadline); the destructor frees the rest.
  void close();

 private:
  struct Slot {
    uint64_t seq = 0;
    bool busy = false;
    bool signalled = false;
  };
  struct Pending {
    uint64_t seq;
    SignalEntry entry;
  };
  struct Peer {
    std::vector<Slot> slots;
    uint64_t next_seq = 1;
    uint64_t posted = 0;  ///< seq of the last signal pushed to the target
    std::deque<Pending> outbox;
    SignalRing ring;  ///< this rank's ring in the peer's inbox
  };

  [[noreturn]] void fail(ncclResult_t code, const std::string& what);
  void check_sticky() const;
  Registration* lookup(void* mh, const char* arg) const;
  void pump(int peer);
  void drain_inbox();
  void release_quietly(Registration::Peer& p);  ///< teardown: logs a failure
  void free_all();  ///< idempotent: registrations, inbox mappings, the mesh

  const ncclDebugLogger_t log_;
  const Config config_;
  const int rank_;
  const int nranks_;
  std::unique_ptr<MemOps> memops_;  ///< before every member holding its imports
  std::unique_ptr<Mesh> mesh_;

  std::size_t ring_bytes_ = 0;
  int inbox_fd_ = -1;
  void* inbox_ = nullptr;            ///< this rank's inbox: nranks rings, one per source
  std::vector<void*> peer_inboxes_;  ///< every rank's inbox mapped here
  std::vector<SignalRing> from_;     ///< rings of this rank's inbox, by source
  std::vector<WordAdd> adds_;        ///< drain_inbox's adds (kept for its capacity)

  mutable std::mutex m_;
  std::vector<Peer> peers_;
  std::unordered_set<Registration*> regs_;
  uint64_t next_reg_id_ = 1;
  std::chrono::steady_clock::time_point connected_ = std::chrono::steady_clock::now();
  uint64_t registering_ = 0;  ///< id of a registration in its collective (0: none)
  ncclResult_t sticky_ = ncclSuccess;
  std::string sticky_what_;
};

}  // namespace epx::gin_loop
