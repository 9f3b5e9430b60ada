// transport/nvshmem/nvshmem_backend.cpp - the NVSHMEM backend's host half in
// libepx (docs/nvshmem.md): it loads the NVSHMEM module (libepx_nvshmem.so,
// which alone links NVSHMEM) with dlopen and drives it through its table.
// The regions are blocks of NVSHMEM's symmetric heap; peers of this rank's
// node (virtual nodes included) are reached through nvshmem_ptr's mappings,
// the others through the module's kernels (dev::ModuleTransport).
#include "transport/nvshmem/nvshmem_backend.hpp"
#include "transport/registry.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/env.hpp"
#include "common/plan.hpp"
#include "epx/communicator.hpp"
#include "epx/error.hpp"
#include "transport/nvshmem/module.hpp"

namespace epx::transport {

namespace {

using nvshmem_module::Api;

constexpr const char* kModuleName = "libepx_nvshmem.so";

/// The directory of the object (executable or shared library) that holds this code.
std::string own_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_directory), &info) == 0 || info.dli_fname == nullptr)
    return {};
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

/// Where the module may be, in order: EPX_NVSHMEM_MODULE, beside the code
/// that holds libepx (the executable, or the Python package's _core), the
/// directory above it (a build tree's tests/ and bench/), the loader's path.
std::vector<std::string> module_candidates() {
  std::vector<std::string> c;
  if (auto p = env::get("EPX_NVSHMEM_MODULE")) {
    c.push_back(*p);
    return c;
  }
  const std::string dir = own_directory();
  if (!dir.empty()) {
    c.push_back(dir + "/" + kModuleName);
    c.push_back(dir + "/../" + kModuleName);
  }
  c.push_back(kModuleName);
  return c;
}

bool exists(const std::string& path) {
  return path.find('/') == std::string::npos || ::access(path.c_str(), F_OK) == 0;
}

}  // namespace

const nvshmem_module::Api& load_nvshmem_module() {
  static std::mutex mutex;
  static const Api* api = nullptr;  // never unloaded: NVSHMEM stays mapped until exit
  std::lock_guard<std::mutex> lock(mutex);
  if (api != nullptr) return *api;
  std::string tried, load_error;
  for (const std::string& path : module_candidates()) {
    tried += (tried.empty() ? "" : ", ") + path;
    if (!exists(path)) continue;
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* why = ::dlerror();  // (a second call would return null)
      const std::string e = why ? why : "dlopen failed";
      // By bare name: not on the loader's path at all is "no module".
      if (path.find('/') == std::string::npos &&
          e.rfind(path + ": cannot open shared object file", 0) == 0)
        continue;
      // Found but not loadable: most often NVSHMEM's own library is missing.
      load_error = path + ": " + e;
      break;
    }
    using Entry = const Api* (*)();
    auto entry = reinterpret_cast<Entry>(::dlsym(h, "epx_nvshmem_module_api"));
    if (entry == nullptr || entry() == nullptr) {
      load_error = path + ": no epx_nvshmem_module_api";
      break;
    }
    const Api* a = entry();
    if (a->abi_version != nvshmem_module::kAbiVersion) {
      load_error = path + ": built for module ABI " + std::to_string(a->abi_version) +
                   ", this EPX needs " + std::to_string(nvshmem_module::kAbiVersion) +
                   " (a module of another build)";
      break;
    }
    api = a;
    return *api;
  }
  std::string failure = "backend 'nvshmem': ";
  if (!load_error.empty())
    failure += "the NVSHMEM module could not be loaded (" + load_error +
               "); it needs NVSHMEM 3.4.5's libnvshmem_host.so.3 (pip nvidia-nvshmem-cu13==3.4.5, "
               "or its lib/ on LD_LIBRARY_PATH)";
  else
    failure += "this build has no NVSHMEM module (looked for " + tried +
               "); build with EPX_WITH_NVSHMEM=ON or AUTO where NVSHMEM 3.4.5 is installed, or set "
               "EPX_NVSHMEM_MODULE to the module's path";
  throw Error(ErrorCode::kUnsupported, failure);
}

namespace {

/// Raises what a module call reported.
void check(int rc, const char* err) {
  if (rc != 0) throw Error(nvshmem_module::decode(rc), std::string("nvshmem: ") + err);
}

class NvshmemBackend final : public Backend {
 public:
  NvshmemBackend(Communicator& comm, const Topology& topology, const BackendOptions& options,
                 const Api& api)
      : comm_(comm), topo_(topology), api_(api) {
    // NVSHMEM's device API has no contexts: queue pairs per peer are its
    // environment. num_qps_per_rank sets IBGDA's when the user has not.
    if (options.num_contexts > 1)
      ::setenv("NVSHMEM_IBGDA_NUM_RC_PER_PE", std::to_string(options.num_contexts).c_str(), 0);
    nvshmem_module::Host host;
    host.ctx = &comm_;
    host.rank = comm.rank();
    host.num_ranks = comm.num_ranks();
    host.device = comm.device();
    host.allgather = [](void* ctx, const void* in, std::size_t bytes, void* out, char* err,
                        std::size_t n) {
      return nvshmem_module::guarded(err, n, [&] {
        const auto all = static_cast<Communicator*>(ctx)->allgather(in, bytes);
        std::memcpy(out, all.data(), all.size());
      });
    };
    char err[1024] = {0};
    check(api_.init(host, options.heap_bytes, err, sizeof(err)), err);
  }

  /// nvshmem_finalize is collective with no deadline: it runs only after
  /// every rank met in EPX's barrier (which has one). A rank that cannot
  /// meet them (a peer died, or a constructor threw on some ranks) leaves
  /// NVSHMEM up rather than hang in it.
  ~NvshmemBackend() override {
    try {
      comm_.barrier();
    } catch (...) {
      return;
    }
    char err[1024] = {0};
    api_.finalize(err, sizeof(err));  // best effort: destructors do not throw
  }

  const char* name() const override { return "nvshmem"; }
  int rank() const override { return comm_.rank(); }
  int num_ranks() const override { return comm_.num_ranks(); }
  const Topology& topology() const override { return topo_; }

  SymmetricRegion alloc(std::size_t bytes) override {
    SymmetricRegion r;
    r.bytes = plan::align_up(bytes == 0 ? plan::kAlign : bytes, 4096);
    comm_.barrier();  // EPX's deadline first: a missing rank is named, not waited for in NVSHMEM
    char err[1024] = {0};
    check(api_.alloc(r.bytes, &r.local, err, sizeof(err)), err);
    r.peers.assign(static_cast<std::size_t>(comm_.num_ranks()), nullptr);
    const int first = topo_.node_of(comm_.rank()) * topo_.ranks_per_node;
    for (int i = 0; i < topo_.ranks_per_node; ++i) {
      const int pe = first + i;
      r.peers[pe] = pe == comm_.rank() ? r.local : api_.peer_ptr(r.local, pe);
      if (r.peers[pe] == nullptr)
        throw Error(ErrorCode::kUnsupported,
                    "backend 'nvshmem': rank " + std::to_string(pe) + " is in rank " +
                        std::to_string(comm_.rank()) + "'s node (ranks_per_node " +
                        std::to_string(topo_.ranks_per_node) +
                        ") but NVSHMEM cannot map its memory here (nvshmem_ptr is null): a node "
                        "must be ranks that NVLink or P2P reaches");
    }
    // A rank of another node that NVSHMEM maps here is reached over P2P:
    // its puts are copies by the calling threads.
    for (int pe = 0; pe < comm_.num_ranks() && !sms_copy_; ++pe)
      if (!topo_.same_node(pe, comm_.rank()) && api_.peer_ptr(r.local, pe) != nullptr)
        sms_copy_ = true;
    return r;
  }

  void free(SymmetricRegion& r) override {
    if (r.local == nullptr) return;
    comm_.barrier();
    char err[1024] = {0};
    check(api_.free(r.local, err, sizeof(err)), err);
    r = SymmetricRegion{};
  }

  void barrier() override { comm_.barrier(); }

  void start() override {
    if (comm_.ranks_on_device() != 1) return;
    char err[1024] = {0};
    check(api_.preload(err, sizeof(err)), err);
  }

  dev::AnyTransport device(const SymmetricRegion& r) const override {
    dev::ModuleTransport t{};
    t.rank = comm_.rank();
    t.num_ranks = comm_.num_ranks();
    t.ranks_per_node = topo_.ranks_per_node;
    t.node_first = topo_.node_of(comm_.rank()) * topo_.ranks_per_node;
    t.num_contexts = 1;
    for (int i = 0; i < kMaxRanksPerNode; ++i)
      t.base[i] =
          i < topo_.ranks_per_node ? static_cast<char*>(r.peers[t.node_first + i]) : nullptr;
    t.local = static_cast<char*>(r.local);
    t.kernels = api_.kernels;
    return t;
  }

  bool puts_copy_on_sms() const override { return sms_copy_; }

  /// Every put this rank issued has landed, then all ranks meet.
  void quiesce() override {
    comm_.barrier();
    char err[1024] = {0};
    check(api_.quiesce(err, sizeof(err)), err);
  }

 private:
  Communicator& comm_;
  Topology topo_;
  const Api& api_;
  bool sms_copy_ = false;  ///< some rank of another node is reached over P2P
};

}  // namespace

std::unique_ptr<Backend> make_nvshmem_backend(Communicator& comm, const Topology& topology,
                                              const BackendOptions& options) {
  if (comm.in_process())
    throw Error(ErrorCode::kUnsupported,
                "backend 'nvshmem': NVSHMEM runs one PE per process; ranks from "
                "Communicator::create_in_process share one (use 'proxy' for in-process virtual "
                "nodes)");
  return std::make_unique<NvshmemBackend>(comm, topology, options, load_nvshmem_module());
}

/// By name only (EPX_BACKEND=nvshmem): it loads the NVSHMEM module.
const BackendInfo& nvshmem_backend_info() {
  static const BackendInfo info{"nvshmem", /*auto_order=*/-1, nullptr, &make_nvshmem_backend};
  return info;
}

}  // namespace epx::transport
