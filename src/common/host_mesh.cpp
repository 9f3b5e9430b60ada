// common/host_mesh.cpp - the star of abstract Unix sockets.
#include "common/host_mesh.hpp"

#include <poll.h>
#include <sys/random.h>
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
constexpr char kMagic[8] = "EPXLP02";
constexpr std::size_t kMaxBytes = 1024;
/// Accepted connections that have not sent their hello yet; past this the
/// oldest is refused (a process cannot hold rank 0's accept loop with many).
constexpr std::size_t kMaxPending = 64;
constexpr char kAdmitted[] = "admitted";

struct Header {
  uint32_t serial;  ///< which collective (0: the hello of connect)
  int32_t from;     ///< the rank whose item this is
  uint32_t has_fd;
  uint32_t bytes;
};

/// The first message of a connecting rank (collective #0).
struct Hello {
  uint8_t secret[kSecretBytes];  ///< the secret of rank 0's handle
  uint32_t nranks;
  int32_t rank;  ///< also in the header's `from`
};

/// A peer's credentials as its socket reports them (SO_PEERCRED).
struct Cred {
  int pid = 0;
  unsigned uid = 0;
};

std::string text_of(const Cred& c) {
  return "pid " + std::to_string(c.pid) + " (uid " + std::to_string(c.uid) + ")";
}
std::string rank_text(int r) {
  return "rank " + std::to_string(r);
}

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

/// False (errno set) when the credentials cannot be read.
bool peer_cred(int sock, Cred* c) {
  ucred u{};
  socklen_t len = sizeof u;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &u, &len) != 0) return false;
  c->pid = static_cast<int>(u.pid);
  c->uid = static_cast<unsigned>(u.uid);
  return true;
}

/// Compares in time independent of where the secrets differ.
bool same_secret(const uint8_t* a, const uint8_t* b) {
  volatile uint8_t diff = 0;
  for (std::size_t i = 0; i < kSecretBytes; ++i) diff = diff | static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

void random_bytes(uint8_t* out, std::size_t n) {
  while (n > 0) {
    const ssize_t got = getrandom(out, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw MeshError(sys("listen: getrandom (the mesh's secret)"));
    }
    out += got;
    n -= static_cast<std::size_t>(got);
  }
}

sockaddr_un address_of(const char* name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::size_t n = std::min(std::strlen(name), sizeof(a.sun_path) - 2);
  std::memcpy(a.sun_path + 1, name, n);  // sun_path[0] = 0: the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return a;
}

/// Sends one message (header + bytes, optionally an fd); false (errno set)
/// when it did not go out whole. `flags`: added to sendmsg's.
bool try_send_item(int sock, const Header& h, const std::string& bytes, int fd, int flags) {
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
    n = sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
  } while (n < 0 && errno == EINTR);
  if (n >= 0 && n != static_cast<ssize_t>(iov.iov_len)) errno = EMSGSIZE;
  return n == static_cast<ssize_t>(iov.iov_len);
}

/// Sends one message (header + bytes, optionally an fd). Throws MeshError.
void send_item(int sock, const Header& h, const std::string& bytes, int fd, int peer) {
  if (!try_send_item(sock, h, bytes, fd, 0))
    throw MeshError("sending to rank " + std::to_string(peer) +
                    " failed: " + std::string(std::strerror(errno)));
}

/// Receives one message from a socket known to be readable. Throws MeshError
/// naming `who`.
void recv_item(int sock, Header* h, Mesh::Item* item, const std::string& who) {
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
  if (n == 0) throw MeshError(who + " closed its connection (did it exit?)");
  if (n < 0) throw MeshError("receiving from " + who + " failed: " + std::strerror(errno));
  item->fd = -1;
  int fds = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      if (item->fd >= 0) close(item->fd);
      std::memcpy(&item->fd, CMSG_DATA(c), sizeof(int));
      ++fds;
    }
  if (static_cast<std::size_t>(n) < sizeof(Header) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
      fds > 1) {
    if (item->fd >= 0) close(item->fd);
    throw MeshError("malformed message from " + who + " (" + std::to_string(n) + " bytes" +
                    ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ? ", truncated" : "") + ")");
  }
  std::memcpy(h, buf, sizeof *h);
  if (h->bytes != static_cast<std::size_t>(n) - sizeof(Header) ||
      (h->has_fd != 0) != (item->fd >= 0)) {
    if (item->fd >= 0) close(item->fd);
    throw MeshError("malformed message from " + who + " (its header does not match its " +
                    std::to_string(n) + " bytes and " + std::to_string(fds) + " descriptor(s))");
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
  random_bytes(secret_, sizeof secret_);
  std::memcpy(handle->secret, secret_, sizeof secret_);
  // pid, serial and a clock reading: unique on the host (the name is public,
  // the secret is not part of it).
  const auto now = static_cast<unsigned long long>(Clock::now().time_since_epoch().count());
  std::snprintf(handle->socket_name, sizeof handle->socket_name, "epxmesh-%x-%x-%llx",
                static_cast<unsigned>(handle->pid), handle->serial, now & 0xffffffffffffull);
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
      throw MeshError(
          "connect: rank " + std::to_string(r) + " (pid " + std::to_string(h->pid) +
          ") runs on another host (boot id " +
          std::string(h->boot_id, strnlen(h->boot_id, sizeof h->boot_id)) + " vs " +
          std::string(handles[rank]->boot_id, strnlen(handles[rank]->boot_id, sizeof h->boot_id)) +
          "); the loopback plugin serves ranks of one host");
  }
  pids_.assign(static_cast<std::size_t>(num_ranks_), 0);
  pids_[rank] = static_cast<int>(getpid());
  if (rank == 0) {
    accept_ranks(listener);
    return;
  }
  const unsigned my_uid = static_cast<unsigned>(geteuid());
  const Deadline deadline(timeout_s);
  // Not rank 0: connect to rank 0 (its socket exists since its listen, which
  // preceded the handle exchange), retrying while its backlog is full.
  root_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (root_fd_ < 0) throw MeshError(sys("connect: socket"));
  const MeshHandle& root = *handles[0];
  const std::string name(root.socket_name, strnlen(root.socket_name, sizeof root.socket_name));
  socklen_t len;
  const sockaddr_un a = address_of(name.c_str(), &len);
  try {
    while (::connect(root_fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
      if ((errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) || deadline.passed())
        throw MeshError("connect: rank " + std::to_string(rank) + ": " +
                        sys("connect to rank 0's socket") + " (rank 0 is pid " +
                        std::to_string(root.pid) + ")");
      usleep(1000);
    }
    // Whoever listens there learns the secret: it must be one of ours.
    Cred c;
    if (!peer_cred(root_fd_, &c))
      throw MeshError("connect: rank " + std::to_string(rank) + ": " +
                      sys("SO_PEERCRED of rank 0's socket"));
    if (c.uid != my_uid)
      throw MeshError("connect: rank " + std::to_string(rank) + ": the process listening on rank " +
                      "0's socket " + name + " is " + text_of(c) + ", not of this process's uid " +
                      std::to_string(my_uid) + "; refusing to present the mesh's secret to it");
    pids_[0] = c.pid;
    // The hello: the secret, this rank and the rank count it was given.
    Hello hello{};
    std::memcpy(hello.secret, root.secret, sizeof hello.secret);
    hello.nranks = static_cast<uint32_t>(num_ranks_);
    hello.rank = rank;
    const std::string bytes(reinterpret_cast<const char*>(&hello), sizeof hello);
    send_item(root_fd_, Header{0, rank, 0, static_cast<uint32_t>(bytes.size())}, bytes, -1, 0);
    // Rank 0's verdict.
    wait_readable(root_fd_, deadline, timeout_s,
                  "rank 0 (" + text_of(c) + ") to admit rank " + std::to_string(rank));
    Header h{};
    Item verdict;
    recv_item(root_fd_, &h, &verdict, "rank 0");
    if (verdict.fd >= 0) close(verdict.fd);
    if (h.serial != 0 || verdict.bytes != kAdmitted)
      throw MeshError("connect: rank 0 (" + text_of(c) + ") did not admit rank " +
                      std::to_string(rank) + ": " + verdict.bytes);
  } catch (...) {
    close(root_fd_);
    root_fd_ = -1;
    throw;
  }
}

void Mesh::accept_ranks(MeshListener& listener) {
  const unsigned my_uid = static_cast<unsigned>(geteuid());
  const Deadline deadline(timeout_s_);
  struct Pending {
    int fd;
    Cred cred;
  };
  std::vector<Pending> pending;  // accepted, no hello yet
  peers_.assign(static_cast<std::size_t>(num_ranks_), -1);
  std::vector<Cred> creds(static_cast<std::size_t>(num_ranks_));
  // A refused connection is told why (it may be a rank with a wrong handle)
  // and closed; the creator learns of it through rejected().
  auto refuse = [&](int s, const Cred& c, const std::string& why) {
    const std::string v = "refused: " + why;
    try_send_item(s, Header{0, 0, 0, static_cast<uint32_t>(v.size())}, v, -1, MSG_DONTWAIT);
    close(s);
    rejected_.push_back("rank 0 refused a connection from " + text_of(c) + ": " + why);
  };
  auto refused_so_far = [&] {
    std::string t;
    for (const auto& r : rejected_) t += "; " + r;
    return t;
  };
  // Reads the hello of `p` and admits it, or refuses it. Throws when a rank
  // is claimed twice (both pids named).
  auto admit = [&](const Pending& p) {
    Header h{};
    Item item;
    try {
      recv_item(p.fd, &h, &item, text_of(p.cred));
    } catch (const MeshError& e) {
      return refuse(p.fd, p.cred, e.what());
    }
    if (item.fd >= 0) {
      close(item.fd);
      return refuse(p.fd, p.cred, "its first message carried a file descriptor");
    }
    Hello hello{};
    if (h.serial != 0 || item.bytes.size() != sizeof hello)
      return refuse(p.fd, p.cred,
                    "its first message is no hello (collective #" + std::to_string(h.serial) +
                        ", " + std::to_string(item.bytes.size()) + " bytes)");
    std::memcpy(&hello, item.bytes.data(), sizeof hello);
    if (!same_secret(hello.secret, listener.secret()))
      return refuse(p.fd, p.cred, "it did not present this mesh's secret");
    const int from = h.from;
    if (hello.rank != from || hello.nranks != static_cast<uint32_t>(num_ranks_) || from <= 0 ||
        from >= num_ranks_)
      return refuse(p.fd, p.cred,
                    "it claims rank " + std::to_string(hello.rank) + " of " +
                        std::to_string(hello.nranks) + ", while this mesh expects ranks 1.." +
                        std::to_string(num_ranks_ - 1) + " of " + std::to_string(num_ranks_));
    if (peers_[from] >= 0) {
      const std::string why = "rank " + std::to_string(from) + " is claimed twice: by " +
                              text_of(creds[from]) + ", admitted first, and by " + text_of(p.cred) +
                              ", both presenting this mesh's secret";
      refuse(p.fd, p.cred, why);
      throw MeshError("connect: " + why + refused_so_far());
    }
    const std::string ok = kAdmitted;
    if (!try_send_item(p.fd, Header{0, 0, 0, static_cast<uint32_t>(ok.size())}, ok, -1, 0))
      return refuse(p.fd, p.cred,
                    "claiming rank " + std::to_string(from) + ", it could not be told it was " +
                        "admitted: " + std::strerror(errno));
    peers_[from] = p.fd;
    creds[from] = p.cred;
    pids_[from] = p.cred.pid;
  };
  try {
    for (;;) {
      std::string missing;
      for (int r = 1; r < num_ranks_; ++r)
        if (peers_[r] < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (missing.empty()) break;
      std::vector<pollfd> ps{{listener.fd(), POLLIN, 0}};
      for (const auto& p : pending) ps.push_back({p.fd, POLLIN, 0});
      const int n = poll(ps.data(), ps.size(), deadline.ms_left());
      if (n < 0 && errno != EINTR) throw MeshError(sys("connect: poll"));
      if (n <= 0) {
        if (deadline.passed())
          throw MeshError("connect: waited " + std::to_string(timeout_s_) + " s for rank(s) " +
                          missing + " to connect to rank 0" + refused_so_far());
        continue;
      }
      // Hellos first (ps[1..] match `pending` as it was when polled).
      std::vector<Pending> readable, waiting;
      for (std::size_t i = 0; i < pending.size(); ++i)
        (ps[i + 1].revents ? readable : waiting).push_back(pending[i]);
      pending = std::move(waiting);
      for (std::size_t i = 0; i < readable.size(); ++i) {
        try {
          admit(readable[i]);
        } catch (...) {
          for (std::size_t j = i + 1; j < readable.size(); ++j) close(readable[j].fd);
          throw;
        }
      }
      if (!ps[0].revents) continue;
      const int s = accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
      if (s < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
        throw MeshError(sys("connect: accept"));
      }
      Cred c;
      if (!peer_cred(s, &c)) {
        rejected_.push_back("rank 0 refused a connection: " + sys("SO_PEERCRED"));
        close(s);
        continue;
      }
      if (c.uid != my_uid) {
        refuse(s, c, "its uid is not this process's (" + std::to_string(my_uid) + ")");
        continue;
      }
      if (pending.size() >= kMaxPending) {
        refuse(pending.front().fd, pending.front().cred,
               "it sent no hello while " + std::to_string(kMaxPending) + " newer connections came");
        pending.erase(pending.begin());
      }
      pending.push_back({s, c});
    }
  } catch (...) {
    for (const auto& p : pending) close(p.fd);
    for (int& s : peers_)
      if (s >= 0) close(s), s = -1;
    throw;
  }
  for (const auto& p : pending)
    refuse(p.fd, p.cred, "it had sent no hello when every rank was connected");
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
          recv_item(ps[i].fd, &h, &items[who[i]], rank_text(who[i]));
          check(h, who[i]);
          if (h.from != who[i])
            throw MeshError(std::string(what) + ": rank " + std::to_string(who[i]) +
                            " sent an item as rank " + std::to_string(h.from));
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
        recv_item(root_fd_, &h, &it, "rank 0");
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
