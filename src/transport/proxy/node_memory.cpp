// Host memory shared by the processes of one node (node_memory.hpp).
#include "transport/proxy/node_memory.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/check.hpp"
#include "common/host_mesh.hpp"
#include "transport/proxy/bounds.hpp"
#include "transport/proxy/libfabric_engine.hpp"  // Exchange

namespace epx::proxy {
namespace {

std::string errno_text() {
  return std::strerror(errno);
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void* map_fd(int fd, std::size_t bytes, const std::string& where) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    throw Error(ErrorCode::kInternal,
                where + ": mmap of " + std::to_string(bytes) + " bytes failed: " + errno_text());
  return p;
}

}  // namespace

struct NodeMemory::Mesh {
  host_mesh::MeshHandle handle{};
  std::unique_ptr<host_mesh::MeshListener> listener;
  std::unique_ptr<host_mesh::Mesh> mesh;
  int me = 0;  ///< this rank's index in node_
};

NodeMemory::NodeMemory(Exchange& ex, std::vector<int> node, double timeout_s)
    : node_(std::move(node)), rank_(ex.rank()), num_ranks_(ex.num_ranks()) {
  const auto it = std::find(node_.begin(), node_.end(), rank_);
  require(it != node_.end(), "node", "must list this rank (" + std::to_string(rank_) + ")");
  require(std::is_sorted(node_.begin(), node_.end()) &&
              std::adjacent_find(node_.begin(), node_.end()) == node_.end() && node_.front() >= 0 &&
              node_.back() < num_ranks_,
          "node", "must be distinct ranks of [0, " + std::to_string(num_ranks_) + ") in order");
  mesh_ = std::make_unique<Mesh>();
  mesh_->me = static_cast<int>(it - node_.begin());
  mesh_->listener = std::make_unique<host_mesh::MeshListener>(&mesh_->handle);
  // Every rank's handle (collective over all ranks), then a star over the node's.
  const std::vector<uint8_t> all = ex.allgather(&mesh_->handle, sizeof(mesh_->handle));
  std::vector<host_mesh::MeshHandle> handles(node_.size());
  std::vector<const host_mesh::MeshHandle*> views;
  for (std::size_t i = 0; i < node_.size(); ++i) {
    std::memcpy(&handles[i], all.data() + sizeof(host_mesh::MeshHandle) * node_[i],
                sizeof(host_mesh::MeshHandle));
    views.push_back(&handles[i]);
  }
  try {
    mesh_->mesh = std::make_unique<host_mesh::Mesh>(views, mesh_->me, *mesh_->listener, timeout_s);
  } catch (const host_mesh::MeshError& e) {
    throw Error(ErrorCode::kTimeout, "node memory: rank " + std::to_string(rank_) +
                                         ": the host mesh of its node did not form: " + e.what());
  }
}

NodeMemory::~NodeMemory() = default;

NodeMemory::Region NodeMemory::alloc(std::size_t bytes) {
  const std::string where = "node memory: rank " + std::to_string(rank_) + ": alloc";
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  require(bytes > 0, "bytes", "must be > 0");
  Region r;
  r.bytes = (bytes + page - 1) / page * page;
  Fd mine;
  mine.fd = ::memfd_create("epx-proxy-region", MFD_CLOEXEC);
  if (mine.fd < 0)
    throw Error(ErrorCode::kInternal, where + ": memfd_create failed: " + errno_text());
  if (::ftruncate(mine.fd, static_cast<off_t>(r.bytes)) != 0)
    throw Error(ErrorCode::kInternal, where + ": ftruncate to " + std::to_string(r.bytes) +
                                          " bytes failed: " + errno_text());
  r.local = map_fd(mine.fd, r.bytes, where);
  r.peers.assign(static_cast<std::size_t>(num_ranks_), nullptr);
  r.peers[rank_] = r.local;
  std::vector<host_mesh::Mesh::Item> items;
  try {
    const uint64_t size = r.bytes;
    items = mesh_->mesh->allgather(std::string(reinterpret_cast<const char*>(&size), sizeof size),
                                   mine.fd, "node memory alloc (region descriptors)");
  } catch (const host_mesh::MeshError& e) {
    free(r);
    throw Error(ErrorCode::kTimeout, where + ": " + e.what());
  }
  std::vector<Fd> received(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) received[i].fd = items[i].fd;
  try {
    for (std::size_t i = 0; i < node_.size(); ++i) {
      if (static_cast<int>(i) == mesh_->me) continue;
      const int peer = node_[i];
      uint64_t said = 0;
      if (items[i].bytes.size() != sizeof said || received[i].fd < 0)
        throw Error(ErrorCode::kInvalidArgument,
                    where + ": rank " + std::to_string(peer) + " sent no region descriptor");
      std::memcpy(&said, items[i].bytes.data(), sizeof said);
      if (said != r.bytes)
        throw Error(ErrorCode::kInvalidArgument,
                    where + ": every rank of the node must ask for the same size: rank " +
                        std::to_string(peer) + " has " + std::to_string(said) + " bytes, rank " +
                        std::to_string(rank_) + " " + std::to_string(r.bytes));
      struct stat st {};
      if (::fstat(received[i].fd, &st) != 0)
        throw Error(ErrorCode::kInternal, where + ": fstat of rank " + std::to_string(peer) +
                                              "'s descriptor failed: " + errno_text());
      check_peer_region(where, peer, said, 0, static_cast<uint64_t>(st.st_size));
      r.peers[peer] = map_fd(received[i].fd, r.bytes, where);
    }
  } catch (...) {
    free(r);
    throw;
  }
  return r;
}

void NodeMemory::free(Region& r) {
  for (int p = 0; p < static_cast<int>(r.peers.size()); ++p)
    if (r.peers[p] && p != rank_) ::munmap(r.peers[p], r.bytes);
  if (r.local) ::munmap(r.local, r.bytes);
  r = Region{};
}

}  // namespace epx::proxy
