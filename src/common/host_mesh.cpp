// common/host_mesh.cpp - the star of abstract Unix sockets.
#include "common/host_mesh.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <fstream>

namespace epx::host_mesh {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = "EPXLP01";
constexpr std::size_t kMaxBytes = 1024;

struct Header {
  uint32_t serial;  ///< which collective (0: the hello of connect)
  int32_t from;     ///< the rank whose item this is
  uint32_t has_fd;
  uint32_t bytes;
};

std::string sys(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

class Deadline {
 public:
  explicit Deadline(double s)
      : end_(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(std::min(s, 1e9)))) {}
  int ms_left() const {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
  }
  bool passed() const { return Clock::now() >= end_; }

 private:
  Clock::time_point end_;
};

sockaddr_un address_of(const char* name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::size_t n = std::min(std::strlen(name), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name, n);  // sun_path[0] = 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

/// Sends one message (header + bytes, optionally an fd). Throws MeshError.
void send_item(int sock, const Header& h, const std::string& bytes, int fd, int peer) {
  char buf[sizeof(Header) + kMaxBytes];
  std::memcpy(buf, &h, sizeof h);
  std::memcpy(buf + sizeof h, bytes.data(), bytes.size());
  iovec iov{buf, sizeof h + bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof control);
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(iov.iov_len))
    throw MeshError("sending to rank " + std::to_string(peer) + " failed" +
                    (n < 0 ? ": " + std::string(std::strerror(errno)) : " (short write)"));
}

/// Receives one message from a socket known to be readable. Throws MeshError.
void recv_item(int sock, Header* h, Mesh::Item* item, int peer) {
  char buf[sizeof(Header) + kMaxBytes];
  iovec iov{buf, sizeof buf};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n == 0)
    throw MeshError("rank " + std::to_string(peer) + " closed its connection (did it exit?)");
  if (n < 0)
    throw MeshError("receiving from rank " + std::to_string(peer) +
                    " failed: " + std::strerror(errno));
  item->fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      std::memcpy(&item->fd, CMSG_DATA(c), sizeof(int));
  if (static_cast<std::size_t>(n) < sizeof(Header) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    if (item->fd >= 0) close(item->fd);
    throw MeshError("malformed message from rank " + std::to_string(peer));
  }
  std::memcpy(h, buf, sizeof *h);
  if (h->bytes != static_cast<std::size_t>(n) - sizeof(Header) ||
      (h->has_fd != 0) != (item->fd >= 0)) {
    if (item->fd >= 0) close(item->fd);
    throw MeshError("malformed message from rank " + std::to_string(peer));
  }
  item->bytes.assign(buf + sizeof(Header), h->bytes);
}

/// Waits until `sock` is readable. Throws MeshError naming `awaited` at the deadline.
void wait_readable(int sock, const Deadline& d, double timeout_s, const std::string& awaited) {
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    const int r = poll(&p, 1, d.ms_left());
    if (r > 0) return;
    if (r < 0 && errno != EINTR) throw MeshError(sys("poll"));
    if (r == 0 && d.passed())
      throw MeshError("waited " + std::to_string(timeout_s) + " s for " + awaited);
  }
}

}  // namespace

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string s;
  std::getline(f, s);
  return s;
}

MeshListener::MeshListener(MeshHandle* handle) {
  static std::atomic<uint32_t> counter{0};
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle->magic, kMagic, sizeof kMagic);
  handle->pid = static_cast<int32_t>(getpid());
  handle->serial = counter.fetch_add(1);
  const std::string id = boot_id();
  std::snprintf(handle->boot_id, sizeof handle->boot_id, "%s", id.c_str());
  const auto now = Clock::now().time_since_epoch().count();
  std::snprintf(handle->socket_name, sizeof handle->socket_name, "epx-gin-loop-%d-%u-%llx",
                handle->pid, handle->serial, static_cast<unsigned long long>(now));
  fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw MeshError(sys("listen: socket"));
  socklen_t len;
  const sockaddr_un a = address_of(handle->socket_name, &len);
  if (bind(fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0 || ::listen(fd_, 256) != 0) {
    const std::string e = sys("listen: bind / listen on the abstract socket");
    close(fd_);
    throw MeshError(e + " (" + handle->socket_name + ")");
  }
}

MeshListener::~MeshListener() {
  if (fd_ >= 0) close(fd_);
}

Mesh::Mesh(const std::vector<const MeshHandle*>& handles, int rank, MeshListener& listener,
           double timeout_s)
    : rank_(rank), num_ranks_(static_cast<int>(handles.size())), timeout_s_(timeout_s) {
  if (num_ranks_ < 1) throw MeshError("connect: nranks must be >= 1");
  if (rank < 0 || rank >= num_ranks_)
    throw MeshError("connect: rank " + std::to_string(rank) + " is not in [0, " +
                    std::to_string(num_ranks_) + ")");
  for (int r = 0; r < num_ranks_; ++r) {
    const MeshHandle* h = handles[r];
    if (!h || std::memcmp(h->magic, kMagic, sizeof kMagic) != 0)
      throw MeshError("connect: the handle of rank " + std::to_string(r) +
                      " was not made by this plugin's listen (or by another version of it)");
    if (std::strncmp(h->boot_id, handles[rank]->boot_id, sizeof h->boot_id) != 0)
      throw MeshError("connect: rank " + std::to_string(r) + " (pid " + std::to_string(h->pid) +
                      ") runs on another host (boot id " + std::string(h->boot_id) + " vs " +
                      handles[rank]->boot_id + "); the loopback plugin serves ranks of one host");
  }
  const Deadline deadline(timeout_s);
  if (rank == 0) {
    peers_.assign(static_cast<std::size_t>(num_ranks_), -1);
    int joined = 1;
    try {
      while (joined < num_ranks_) {
        std::string missing;
        for (int r = 1; r < num_ranks_; ++r)
          if (peers_[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        wait_readable(listener.fd(), deadline, timeout_s,
                      "rank(s) " + missing + " to connect to rank 0");
        const int s = accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
        if (s < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          throw MeshError(sys("connect: accept"));
        }
        Header h{};
        Item hello;
        try {
          wait_readable(s, deadline, timeout_s, "the hello of a connecting rank");
          recv_item(s, &h, &hello, -1);
        } catch (...) {
          close(s);
          throw;
        }
        if (hello.fd >= 0) close(hello.fd);
        const int from = h.from;
        if (h.serial != 0 || from <= 0 || from >= num_ranks_ || peers_[from] >= 0 ||
            hello.bytes != std::to_string(num_ranks_)) {
          close(s);
          throw MeshError("connect: unexpected hello (rank " + std::to_string(from) + ", nranks " +
                          hello.bytes + ") while expecting ranks 1.." +
                          std::to_string(num_ranks_ - 1) + " of " + std::to_string(num_ranks_));
        }
        peers_[from] = s;
        ++joined;
      }
    } catch (...) {
      for (int s : peers_)
        if (s >= 0) close(s);
      throw;
    }
    return;
  }
  // Not rank 0: connect to rank 0 (its socket exists since its listen, which
  // preceded the handle exchange), retrying while its backlog is full.
  root_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (root_fd_ < 0) throw MeshError(sys("connect: socket"));
  socklen_t len;
  const sockaddr_un a = address_of(handles[0]->socket_name, &len);
  while (::connect(root_fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
    if ((errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) || deadline.passed()) {
      const std::string e = sys("connect to rank 0's socket");
      close(root_fd_);
      throw MeshError("connect: rank " + std::to_string(rank) + ": " + e + " (rank 0 is pid " +
                      std::to_string(handles[0]->pid) + ")");
    }
    usleep(1000);
  }
  try {  // the hello: this rank and the rank count it was given
    const std::string n = std::to_string(num_ranks_);
    send_item(root_fd_, Header{0, rank, 0, static_cast<uint32_t>(n.size())}, n, -1, 0);
  } catch (...) {
    close(root_fd_);
    throw;
  }
}

Mesh::~Mesh() {
  if (root_fd_ >= 0) close(root_fd_);
  for (int s : peers_)
    if (s >= 0) close(s);
}

std::vector<Mesh::Item> Mesh::allgather(const std::string& bytes, int fd, const char* what) {
  if (bytes.size() > kMaxBytes) throw MeshError(std::string(what) + ": payload too large");
  const uint32_t serial = ++serial_;
  const Deadline deadline(timeout_s_);
  std::vector<Item> items(static_cast<std::size_t>(num_ranks_));
  auto header_for = [&](int from, bool has_fd, const std::string& b) {
    return Header{serial, from, has_fd ? 1u : 0u, static_cast<uint32_t>(b.size())};
  };
  auto close_items = [&] {
    for (auto& it : items)
      if (it.fd >= 0) close(it.fd), it.fd = -1;
  };
  auto check = [&](const Header& h, int peer) {
    if (h.serial != serial || h.from < 0 || h.from >= num_ranks_)
      throw MeshError(std::string(what) + ": rank " + std::to_string(peer) + " is at collective #" +
                      std::to_string(h.serial) + ", this rank (" + std::to_string(rank_) +
                      ") at #" + std::to_string(serial) +
                      " (are the ranks calling the same collectives in the same order?)");
  };
  try {
    if (rank_ == 0) {
      items[0].bytes = bytes;
      std::vector<char> got(static_cast<std::size_t>(num_ranks_), 0);
      got[0] = 1;
      for (int left = num_ranks_ - 1; left > 0;) {
        std::vector<pollfd> ps;
        std::vector<int> who;
        std::string missing;
        for (int r = 1; r < num_ranks_; ++r)
          if (!got[r]) {
            ps.push_back({peers_[r], POLLIN, 0});
            who.push_back(r);
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          }
        const int n = poll(ps.data(), ps.size(), deadline.ms_left());
        if (n < 0 && errno != EINTR) throw MeshError(sys("poll"));
        if (n == 0 && deadline.passed())
          throw MeshError(std::string(what) + ": rank 0 waited " + std::to_string(timeout_s_) +
                          " s for rank(s) " + missing);
        for (std::size_t i = 0; i < ps.size(); ++i) {
          if (!ps[i].revents) continue;
          Header h{};
          recv_item(ps[i].fd, &h, &items[who[i]], who[i]);
          check(h, who[i]);
          got[who[i]] = 1;
          --left;
        }
      }
      for (int r = 1; r < num_ranks_; ++r)
        for (int q = 0; q < num_ranks_; ++q) {
          const int qfd = q == 0 ? fd : items[q].fd;
          send_item(peers_[r], header_for(q, qfd >= 0, items[q].bytes), items[q].bytes, qfd, r);
        }
    } else {
      send_item(root_fd_, header_for(rank_, fd >= 0, bytes), bytes, fd, 0);
      for (int q = 0; q < num_ranks_; ++q) {
        wait_readable(root_fd_, deadline, timeout_s_,
                      std::string(what) + " (rank " + std::to_string(rank_) +
                          " waiting for rank 0 to forward every rank's item)");
        Header h{};
        Item it;
        recv_item(root_fd_, &h, &it, 0);
        check(h, 0);
        if (items[h.from].fd >= 0) close(items[h.from].fd);
        items[h.from] = std::move(it);
      }
      if (items[rank_].fd >= 0) close(items[rank_].fd), items[rank_].fd = -1;
    }
  } catch (...) {
    close_items();
    throw;
  }
  return items;
}

}  // namespace epx::host_mesh
