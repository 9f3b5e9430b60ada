// common/host_mesh.hpp - how the ranks of one host reach each other for
// setup (the loopback GIN plugin's collComms, the CUDA IPC engine's cuMem
// regions): MeshListener binds an abstract Unix socket (SOCK_SEQPACKET) and
// describes it in a 128-byte handle the ranks allgather (through NCCL, or
// EPX's Communicator); Mesh builds a star around rank 0 (every other rank
// connects to rank 0's socket), which carries the owners' own collectives:
// allgather of a few bytes and at most one file descriptor per rank
// (SCM_RIGHTS; memfds of windows and inboxes, cuMem allocations).
// A star needs n - 1 connections instead of n(n-1)/2 and is enough for the
// few collectives of setup and registration; data never crosses it.
//
// Ranks may be threads of one process or processes of one host (a different
// boot id is refused). Every wait has a deadline; failures throw MeshError
// naming the rank(s) and what was awaited.
//
// Any local process can connect to an abstract socket, so rank 0 admits a
// connection only when its peer has this process's uid (SO_PEERCRED) and its
// first message presents the mesh's secret: random bytes made at listen and
// carried in the handle, which only the ranks learn (through their own
// allgather). Rank 0 sends nothing before that check. A connection that fails
// it is refused and closed, and rank 0 goes on accepting: a stray process
// costs the ranks nothing but a line in rejected() (and in a timeout's
// message). Two admitted connections claiming one rank are an error naming
// both pids. Connecting ranks check rank 0's uid the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace epx::host_mesh {

class MeshError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr std::size_t kSecretBytes = 32;

/// The listen handle (fits NCCL_NET_HANDLE_MAXSIZE = 128 bytes).
struct MeshHandle {
  char magic[8];    ///< "EPXLP" + version
  int32_t pid;      ///< of the listening process (diagnostics)
  uint32_t serial;  ///< per-process listen counter (diagnostics)
  char boot_id[40];
  uint8_t secret[kSecretBytes];  ///< what connecting ranks present to this listener (getrandom)
  char socket_name[40];          ///< abstract socket name, NUL-terminated, without the leading NUL
};
static_assert(sizeof(MeshHandle) <= 128);

/// This rank's listening socket.
class MeshListener {
 public:
  /// Binds and listens; fills `handle`.
  explicit MeshListener(MeshHandle* handle);
  ~MeshListener();
  MeshListener(const MeshListener&) = delete;
  MeshListener& operator=(const MeshListener&) = delete;
  int fd() const { return fd_; }
  /// The secret this listener's handle carries (what rank 0 checks).
  const uint8_t* secret() const { return secret_; }

 private:
  int fd_ = -1;
  uint8_t secret_[kSecretBytes] = {};
};

class Mesh {
 public:
  /// Collective over `handles.size()` ranks: rank 0 accepts a connection from
  /// every other rank, the others connect to rank 0. Waits at most `timeout_s`.
  Mesh(const std::vector<const MeshHandle*>& handles, int rank, MeshListener& listener,
       double timeout_s);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const { return rank_; }
  int num_ranks() const { return num_ranks_; }
  /// Rank 0: one sentence per connection it refused while the mesh formed
  /// (pid, uid, why), for the mesh's creator to log; empty elsewhere.
  const std::vector<std::string>& rejected() const { return rejected_; }
  /// The pid of each rank's process as its socket reported it (SO_PEERCRED;
  /// rank 0 knows every rank's, the others rank 0's and their own).
  const std::vector<int>& pids() const { return pids_; }

  struct Item {
    std::string bytes;
    int fd = -1;  ///< a received descriptor (the caller closes it), or -1
  };
  /// Collective: every rank contributes `bytes` (at most 1024) and an optional
  /// descriptor (-1: none; it stays the caller's); returns every rank's item,
  /// indexed by rank (this rank's with fd -1). `what` names the collective in
  /// errors. Collectives are numbered: ranks calling different ones fail.
  std::vector<Item> allgather(const std::string& bytes, int fd, const char* what);
  /// Collective: returns once every rank entered.
  void barrier(const char* what) { allgather({}, -1, what); }

 private:
  /// Rank 0's part of the constructor: admits ranks 1..n-1 (see the top).
  void accept_ranks(MeshListener& listener);

  int rank_ = 0;
  int num_ranks_ = 0;
  double timeout_s_ = 0;
  uint32_t serial_ = 0;     ///< collectives done so far
  int root_fd_ = -1;        ///< non-root: the connection to rank 0
  std::vector<int> peers_;  ///< root: connection of each rank (-1 for itself)
  std::vector<int> pids_;   ///< per rank: its pid (0: unknown)
  std::vector<std::string> rejected_;
};

/// This host's boot id (/proc/sys/kernel/random/boot_id), "" if unreadable.
std::string boot_id();

}  // namespace epx::host_mesh
