// The host mesh (common/host_mesh.hpp) against local processes that are not
// its ranks: a connection without the mesh's secret, one that never speaks,
// a second claim to an admitted rank, another uid. Ranks are threads of this
// process; the intruders are threads or forked processes. No GPU.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/host_mesh.hpp"

namespace epx::host_mesh {
namespace {

/// Listeners and handles of `n` ranks, as the ranks' allgather would give them.
struct Ranks {
  explicit Ranks(int n) : handles(static_cast<std::size_t>(n)) {
    for (int r = 0; r < n; ++r) listeners.push_back(std::make_unique<MeshListener>(&handles[r]));
  }
  std::vector<const MeshHandle*> views() const {
    std::vector<const MeshHandle*> v;
    for (const auto& h : handles) v.push_back(&h);
    return v;
  }
  std::vector<MeshHandle> handles;
  std::vector<std::unique_ptr<MeshListener>> listeners;
};

/// Runs `f` on a thread; join() returns its MeshError's message ("" if none).
class Rank {
 public:
  explicit Rank(std::function<void()> f)
      : t_([this, f = std::move(f)] {
          try {
            f();
          } catch (const std::exception& e) {
            error_ = e.what();
            if (error_.empty()) error_ = "(empty message)";
          }
        }) {}
  std::string join() {
    t_.join();
    return error_;
  }

 private:
  std::string error_;
  std::thread t_;
};

/// Whether some entry of `v` contains every one of `parts`.
bool has_entry(const std::vector<std::string>& v, const std::vector<std::string>& parts) {
  for (const auto& s : v) {
    bool all = true;
    for (const auto& p : parts) all = all && s.find(p) != std::string::npos;
    if (all) return true;
  }
  return false;
}
std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

/// A raw connection to rank 0's socket (the abstract name of its handle).
int raw_connect(const MeshHandle& h) {
  const int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::size_t n = strnlen(h.socket_name, sizeof h.socket_name);
  std::memcpy(a.sun_path + 1, h.socket_name, n);
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  if (s >= 0 && connect(s, reinterpret_cast<const sockaddr*>(&a), len) != 0) {
    close(s);
    return -1;
  }
  return s;
}

/// Waits up to 10 s for one byte on `fd`; false if none came.
bool wait_byte(int fd) {
  pollfd p{fd, POLLIN, 0};
  char c;
  return poll(&p, 1, 10000) == 1 && read(fd, &c, 1) == 1;
}

TEST(HostMesh, HandleFitsNcclAndCarriesASecret) {
  static_assert(sizeof(MeshHandle) <= 128);  // NCCL_NET_HANDLE_MAXSIZE
  Ranks ranks(2);
  EXPECT_NE(std::memcmp(ranks.handles[0].secret, ranks.handles[1].secret, kSecretBytes), 0)
      << "every listener draws its own secret";
  EXPECT_EQ(std::memcmp(ranks.handles[0].secret, ranks.listeners[0]->secret(), kSecretBytes), 0);
  EXPECT_LT(strnlen(ranks.handles[0].socket_name, sizeof ranks.handles[0].socket_name),
            sizeof ranks.handles[0].socket_name);
}

// A process that connects first as rank 1 but with a wrong secret is refused
// (it is told why), and so is one that connects and never speaks; the real
// ranks still form the mesh and exchange descriptors, and rank 0 names both
// intruders (pid, uid, why) in rejected().
TEST(HostMesh, WrongSecretAndSilentConnectionsAreRefusedAndTheMeshForms) {
  constexpr int kN = 3;
  Ranks ranks(kN);
  std::unique_ptr<Mesh> meshes[kN];
  Rank root([&] { meshes[0] = std::make_unique<Mesh>(ranks.views(), 0, *ranks.listeners[0], 10); });

  // A silent connection, opened first: it must not hold the others up.
  const int silent = raw_connect(ranks.handles[0]);
  ASSERT_GE(silent, 0) << std::strerror(errno);

  // The impostor: rank 1 with rank 0's handle but a secret of its own.
  std::vector<MeshHandle> forged = ranks.handles;
  forged[0].secret[0] ^= 0x5a;
  std::vector<const MeshHandle*> forged_views;
  for (const auto& h : forged) forged_views.push_back(&h);
  MeshHandle spare{};
  MeshListener rogue_listener(&spare);
  std::string rogue_error;
  try {
    Mesh rogue(forged_views, 1, rogue_listener, 10);
  } catch (const MeshError& e) {
    rogue_error = e.what();
  }
  EXPECT_NE(rogue_error.find("did not admit rank 1"), std::string::npos) << rogue_error;
  EXPECT_NE(rogue_error.find("did not present this mesh's secret"), std::string::npos)
      << rogue_error;

  // The real ranks 1 and 2, after the impostor.
  Rank r1([&] { meshes[1] = std::make_unique<Mesh>(ranks.views(), 1, *ranks.listeners[1], 10); });
  Rank r2([&] { meshes[2] = std::make_unique<Mesh>(ranks.views(), 2, *ranks.listeners[2], 10); });
  EXPECT_EQ(root.join(), "");
  EXPECT_EQ(r1.join(), "");
  EXPECT_EQ(r2.join(), "");
  close(silent);
  ASSERT_TRUE(meshes[0] && meshes[1] && meshes[2]);

  const std::string me = "pid " + std::to_string(getpid()) + " (uid " + std::to_string(geteuid());
  const auto& rejected = meshes[0]->rejected();
  EXPECT_EQ(rejected.size(), 2u) << joined(rejected);
  EXPECT_TRUE(has_entry(rejected, {me, "did not present this mesh's secret"})) << joined(rejected);
  EXPECT_TRUE(has_entry(rejected, {me, "had sent no hello when every rank was connected"}))
      << joined(rejected);
  EXPECT_TRUE(meshes[1]->rejected().empty());
  EXPECT_EQ(meshes[0]->pids()[1], getpid());

  // The mesh works: an allgather with a descriptor from each rank.
  std::vector<Mesh::Item> got[kN];
  std::vector<std::unique_ptr<Rank>> gather;
  for (int r = 0; r < kN; ++r)
    gather.push_back(std::make_unique<Rank>([&, r] {
      const int fd = memfd_create("mesh-test", MFD_CLOEXEC);
      got[r] = meshes[r]->allgather("from " + std::to_string(r), fd, "test allgather");
      close(fd);
    }));
  for (auto& g : gather) EXPECT_EQ(g->join(), "");
  for (int r = 0; r < kN; ++r) {
    ASSERT_EQ(got[r].size(), static_cast<std::size_t>(kN));
    for (int q = 0; q < kN; ++q) {
      EXPECT_EQ(got[r][q].bytes, "from " + std::to_string(q));
      EXPECT_EQ(got[r][q].fd >= 0, q != r) << "rank " << r << " item of rank " << q;
      if (got[r][q].fd >= 0) close(got[r][q].fd);
    }
  }
}

// A forked process with the right secret claims rank 1 and is admitted; when
// the real rank 1 claims it too (rank 2 still to come), rank 0 fails naming
// both pids (it cannot tell which one is the rank), and the second claimer
// is told so.
TEST(HostMesh, RankClaimedTwiceNamesBothPids) {
  Ranks ranks(3);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 1;
    try {
      Mesh m(ranks.views(), 1, *ranks.listeners[1], 10);
      code = 2;
      (void)!write(ready[1], "x", 1);
      m.barrier("held until rank 0 gives up");  // fails once rank 0 closes
    } catch (const MeshError&) {
      code = code == 2 ? 0 : 1;
    }
    _exit(code);
  }
  close(ready[1]);
  std::unique_ptr<Mesh> root_mesh;
  Rank root([&] { root_mesh = std::make_unique<Mesh>(ranks.views(), 0, *ranks.listeners[0], 10); });
  const bool child_admitted = wait_byte(ready[0]);
  close(ready[0]);
  std::string second;
  if (child_admitted) {
    try {
      Mesh m(ranks.views(), 1, *ranks.listeners[1], 10);
    } catch (const MeshError& e) {
      second = e.what();
    }
  }
  const std::string root_error = root.join();
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(child_admitted) << "the forked claimer of rank 1 was not admitted";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_EQ(root_mesh, nullptr);
  const std::string first_pid = "pid " + std::to_string(child);
  const std::string second_pid = "pid " + std::to_string(getpid());
  EXPECT_NE(root_error.find("rank 1 is claimed twice"), std::string::npos) << root_error;
  EXPECT_NE(root_error.find(first_pid), std::string::npos) << root_error;
  EXPECT_NE(root_error.find(second_pid), std::string::npos) << root_error;
  EXPECT_NE(second.find("rank 1 is claimed twice"), std::string::npos) << second;
}

// A process of another uid is refused by rank 0 before it may speak, and a
// connecting rank refuses a rank 0 of another uid (it would learn the
// secret); the real rank still joins. (Needs root to change uid.)
TEST(HostMesh, OtherUidIsRefusedBothWays) {
  if (geteuid() != 0) GTEST_SKIP() << "changing uid needs root";
  Ranks ranks(2);
  std::unique_ptr<Mesh> meshes[2];
  Rank root([&] { meshes[0] = std::make_unique<Mesh>(ranks.views(), 0, *ranks.listeners[0], 10); });
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 1;
    if (setresuid(65534, 65534, 65534) == 0) {
      try {
        Mesh m(ranks.views(), 1, *ranks.listeners[1], 10);
      } catch (const MeshError& e) {
        code =
            std::string(e.what()).find("refusing to present the mesh's secret") != std::string::npos
                ? 0
                : 3;
      }
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the other uid's rank 1 did not refuse rank 0 for its uid (status " << status << ")";
  Rank r1([&] { meshes[1] = std::make_unique<Mesh>(ranks.views(), 1, *ranks.listeners[1], 10); });
  EXPECT_EQ(root.join(), "");
  EXPECT_EQ(r1.join(), "");
  ASSERT_TRUE(meshes[0]);
  EXPECT_TRUE(has_entry(meshes[0]->rejected(),
                        {"pid " + std::to_string(child) + " (uid 65534)", "its uid is not"}))
      << joined(meshes[0]->rejected());
}

}  // namespace
}  // namespace epx::host_mesh
