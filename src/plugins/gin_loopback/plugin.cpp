// plugins/gin_loopback/plugin.cpp - the tables libnccl-net-epxloop.so exports:
// ncclNetPlugin_v11 (a stub net device, which NCCL requires before it takes a
// GIN table) and ncclGinPlugin_v11 (GIN_PROXY: NCCL runs the GPU-side queues
// and its progress thread; this plugin carries the puts and signals between
// the ranks of one host). No exception crosses the C boundary: every entry
// point turns errors into an NCCL result code and a WARN through NCCL's logger.
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <new>

#include "plugins/gin_loopback/abi.hpp"
#include "plugins/gin_loopback/loop.hpp"

namespace epx::gin_loop {
namespace {

constexpr char kName[] = "EPX-LOOP";
std::atomic<ncclDebugLogger_t> g_log{nullptr};  ///< the last logger init was given

template <class F>
ncclResult_t guarded(ncclDebugLogger_t log, const char* where, F&& f) noexcept {
  if (!log) log = g_log.load();
  try {
    f();
    return ncclSuccess;
  } catch (const PluginError& e) {
    log_warn(log, where, e.what());
    return e.code;
  } catch (const MeshError& e) {
    log_warn(log, where, e.what());
    return ncclSystemError;
  } catch (const MemOpsError& e) {
    log_warn(log, where, e.what());
    return ncclSystemError;
  } catch (const std::bad_alloc&) {
    log_warn(log, where, "out of host memory");
    return ncclSystemError;
  } catch (const std::exception& e) {
    log_warn(log, where, std::string("unexpected error: ") + e.what());
    return ncclInternalError;
  } catch (...) {
    log_warn(log, where, "unexpected non-standard exception");
    return ncclInternalError;
  }
}

template <class T>
void need(T* p, const char* arg) {
  if (!p) throw PluginError(ncclInvalidArgument, std::string(arg) + " must not be NULL");
}

/// The ABI here is 2.28's: refuse another NCCL already loaded in the process.
void check_nccl_version() {
  using GetVersion = int (*)(int*);
  auto fn = reinterpret_cast<GetVersion>(dlsym(RTLD_DEFAULT, "ncclGetVersion"));
  if (!fn) return;  // no libnccl in the process (CPU tests)
  int v = 0;
  if (fn(&v) != 0) return;
  if (v < 22800 || v >= 22900)
    throw PluginError(ncclInvalidUsage,
                      "NCCL " + std::to_string(v) +
                          " is loaded, but this plugin declares the v11 plugin ABI of NCCL 2.28 "
                          "(docs/nccl_gin.md); unset NCCL_NET_PLUGIN or use NCCL 2.28.x");
}

Context* context(void* ctx) {
  need(ctx, "ctx");
  return static_cast<Context*>(ctx);
}
Comm* comm_of(void* c) {
  need(c, "collComm");
  return static_cast<Comm*>(c);
}

// ---- the stub net table -------------------------------------------------------------

void fill_common(ncclNetProperties_v11_t* p) {
  std::memset(p, 0, sizeof *p);
  static char name[] = "EPX-LOOP";
  p->name = name;
  p->pciPath = nullptr;        // NCCL attaches the device to the first CPU of its topology
  p->guid = 0x4550584c4f4f50;  // "EPXLOOP"
  p->speed = 100000;
  p->port = 0;
  p->latency = 0;
  p->maxComms = 1 << 20;
  p->netDeviceVersion = 0;
  p->vProps.ndevs = 1;
  p->vProps.devs[0] = 0;
  p->maxP2pBytes = std::size_t{1} << 30;
  p->maxCollBytes = std::size_t{1} << 30;
  p->maxMultiRequestSize = 1;
}

ncclResult_t stub(const char* fn) {
  log_warn(g_log.load(), fn,
           "the EPX-LOOP net device is a stub for GIN on one host; NCCL chose the net "
           "transport (ranks on two hosts, NCCL_HOSTID set, or no P2P / SHM path?): "
           "use a real net plugin there");
  return ncclInternalError;
}

ncclResult_t net_init(void** ctx, uint64_t, ncclNetCommConfig_v11_t*, ncclDebugLogger_t log,
                      ncclProfilerCallback_t) {
  if (log) g_log.store(log);
  return guarded(log, "net init", [&] {
    need(ctx, "ctx");
    check_nccl_version();
    static int token;
    *ctx = &token;
  });
}
ncclResult_t net_devices(int* n) {
  return guarded(nullptr, "net devices", [&] {
    need(n, "ndev");
    *n = 1;
  });
}
ncclResult_t net_properties(int dev, ncclNetProperties_v11_t* p) {
  return guarded(nullptr, "net getProperties", [&] {
    need(p, "props");
    if (dev != 0)
      throw PluginError(ncclInvalidArgument, "dev " + std::to_string(dev) + " is not 0");
    fill_common(p);
    p->ptrSupport = NCCL_PTR_HOST;
    p->maxRecvs = 1;
    p->netDeviceType = NCCL_NET_DEVICE_HOST;
  });
}
ncclResult_t net_listen(void*, int, void*, void**) {
  return stub("net listen");
}
ncclResult_t net_connect(void*, int, void*, void**, ncclNetDeviceHandle_v11_t**) {
  return stub("net connect");
}
ncclResult_t net_accept(void*, void**, ncclNetDeviceHandle_v11_t**) {
  return stub("net accept");
}
ncclResult_t net_reg_mr(void*, void*, std::size_t, int, void**) {
  return stub("net regMr");
}
ncclResult_t net_reg_mr_dmabuf(void*, void*, std::size_t, int, uint64_t, int, void**) {
  return stub("net regMrDmaBuf");
}
ncclResult_t net_dereg_mr(void*, void*) {
  return stub("net deregMr");
}
ncclResult_t net_isend(void*, void*, std::size_t, int, void*, void*, void**) {
  return stub("net isend");
}
ncclResult_t net_irecv(void*, int, void**, std::size_t*, int*, void**, void**, void**) {
  return stub("net irecv");
}
ncclResult_t net_iflush(void*, int, void**, int*, void**, void**) {
  return stub("net iflush");
}
ncclResult_t net_test(void*, int*, int*) {
  return stub("net test");
}
ncclResult_t net_close_send(void*) {
  return stub("net closeSend");
}
ncclResult_t net_close_recv(void*) {
  return stub("net closeRecv");
}
ncclResult_t net_close_listen(void*) {
  return stub("net closeListen");
}
ncclResult_t net_finalize(void*) {
  return ncclSuccess;
}

// ---- the GIN table ------------------------------------------------------------------------

ncclResult_t gin_init(void** ctx, uint64_t comm_id, ncclDebugLogger_t log) {
  if (log) g_log.store(log);
  return guarded(log, "gin init", [&] {
    need(ctx, "ctx");
    check_nccl_version();
    auto c = std::make_unique<Context>();
    c->comm_id = comm_id;
    c->log = log;
    c->config = read_config();
    *ctx = c.release();
  });
}
ncclResult_t gin_devices(int* n) {
  return guarded(nullptr, "gin devices", [&] {
    need(n, "ndev");
    *n = 1;
  });
}
ncclResult_t gin_properties(int dev, ncclNetProperties_v11_t* p) {
  return guarded(nullptr, "gin getProperties", [&] {
    need(p, "props");
    if (dev != 0)
      throw PluginError(ncclInvalidArgument, "dev " + std::to_string(dev) + " is not 0");
    const Config cfg = read_config();
    fill_common(p);
    p->ptrSupport = memops_ptr_support();  // HOST, plus CUDA where the CUDA memops are built
    p->maxRecvs = cfg.depth / 32;
    p->netDeviceType = NCCL_NET_DEVICE_GIN_PROXY;
  });
}
ncclResult_t gin_listen(void* ctx, int dev, void* handle, void** listen_comm) {
  return guarded(nullptr, "gin listen", [&] {
    Context* c = context(ctx);
    need(handle, "handle");
    need(listen_comm, "listenComm");
    if (dev != 0)
      throw PluginError(ncclInvalidArgument, "dev " + std::to_string(dev) + " is not 0");
    auto l = std::make_unique<ListenComm>();
    l->ctx = c;
    l->listener = std::make_unique<MeshListener>(&l->handle);
    std::memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
    std::memcpy(handle, &l->handle, sizeof l->handle);
    *listen_comm = l.release();
  });
}
ncclResult_t gin_connect(void* ctx, void* handles[], int nranks, int rank, void* listen_comm,
                         void** coll_comm) {
  return guarded(nullptr, "gin connect", [&] {
    need(handles, "handles");
    need(listen_comm, "listenComm");
    // NCCL 2.28 passes comm->ginContext here, which its plugin loader sets
    // (by init) only for the first communicator of a process: a split
    // communicator brings NULL. The listen comm's context (from the init that
    // NCCL's GIN setup makes per communicator) is the same kind of object.
    auto* listen = static_cast<ListenComm*>(listen_comm);
    Context* c = ctx ? context(ctx) : listen->ctx;
    if (!c) throw PluginError(ncclInvalidArgument, "ctx is NULL and the listen comm has none");
    need(coll_comm, "collComm");
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw PluginError(ncclInvalidArgument, "rank " + std::to_string(rank) + " of nranks " +
                                                 std::to_string(nranks) + " is out of range");
    std::vector<const MeshHandle*> hs(static_cast<std::size_t>(nranks));
    for (int r = 0; r < nranks; ++r) {
      if (!handles[r])
        throw PluginError(ncclInvalidArgument, "handles[" + std::to_string(r) + "] is NULL");
      hs[r] = static_cast<const MeshHandle*>(handles[r]);
    }
    *coll_comm = new Comm(*c, *listen, hs, rank);
  });
}
ncclResult_t gin_reg_mr_sym(void* coll_comm, void* data, std::size_t size, int type, uint64_t flags,
                            void** mhandle, void** gin_handle) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin regMrSym", [&] {
    need(mhandle, "mhandle");
    need(gin_handle, "ginHandle");
    Registration* r = comm_of(coll_comm)->reg_mr_sym(data, size, type, flags);
    *mhandle = r;  // NCCL passes mhandle for some regions and ginHandle for others
    *gin_handle = r;
  });
}
ncclResult_t gin_dereg_mr_sym(void* coll_comm, void* mhandle) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin deregMrSym",
                 [&] { comm_of(coll_comm)->dereg_mr_sym(mhandle); });
}
ncclResult_t gin_close_coll(void* coll_comm) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin closeColl", [&] {
    std::unique_ptr<Comm> owned(comm_of(coll_comm));
    owned->close();  // the barrier; the Comm is freed even if it fails
  });
}
ncclResult_t gin_close_listen(void* listen_comm) {
  return guarded(nullptr, "gin closeListen", [&] {
    need(listen_comm, "listenComm");
    delete static_cast<ListenComm*>(listen_comm);
  });
}
ncclResult_t gin_iput(void* coll_comm, uint64_t src_off, void* src_mh, std::size_t size,
                      uint64_t dst_off, void* dst_mh, uint32_t rank, void** request) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin iput", [&] {
    need(request, "request");
    *request = comm_of(coll_comm)->iput(src_off, src_mh, size, dst_off, dst_mh, rank, false, 0,
                                        nullptr, 0, 0);
  });
}
ncclResult_t gin_iput_signal(void* coll_comm, uint64_t src_off, void* src_mh, std::size_t size,
                             uint64_t dst_off, void* dst_mh, uint32_t rank, uint64_t sig_off,
                             void* sig_mh, uint64_t sig_value, uint32_t sig_op, void** request) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin iputSignal", [&] {
    need(request, "request");
    *request = comm_of(coll_comm)->iput(src_off, src_mh, size, dst_off, dst_mh, rank, true, sig_off,
                                        sig_mh, sig_value, sig_op);
  });
}
ncclResult_t gin_test(void* coll_comm, void* request, int* done) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin test", [&] {
    need(done, "done");
    *done = comm_of(coll_comm)->test(request) ? 1 : 0;
  });
}
ncclResult_t gin_progress(void* coll_comm) {
  Comm* c = static_cast<Comm*>(coll_comm);
  return guarded(c ? c->logger() : nullptr, "gin ginProgress",
                 [&] { comm_of(coll_comm)->progress(); });
}
ncclResult_t gin_finalize(void* ctx) {
  // NCCL 2.28 finalizes a split communicator's NULL context too (connect then
  // used the listen comm's): nothing to free, as free(NULL).
  if (ctx == nullptr) return ncclSuccess;
  return guarded(nullptr, "gin finalize", [&] { delete context(ctx); });
}

}  // namespace
}  // namespace epx::gin_loop

using namespace epx::gin_loop;

extern "C" {

__attribute__((visibility("default"))) ncclNet_v11_t ncclNetPlugin_v11 = {
    kName,        net_init,   net_devices,       net_properties, net_listen,       net_connect,
    net_accept,   net_reg_mr, net_reg_mr_dmabuf, net_dereg_mr,   net_isend,        net_irecv,
    net_iflush,   net_test,   net_close_send,    net_close_recv, net_close_listen,
    nullptr,  // getDeviceMr: no device offload
    nullptr,  // irecvConsumed: no device offload
    nullptr,  // makeVDevice: no virtual NICs
    net_finalize,
    nullptr,  // setNetAttr: nothing to tune
};

__attribute__((visibility("default"))) ncclGin_v11_t ncclGinPlugin_v11 = {
    kName,
    gin_init,
    gin_devices,
    gin_properties,
    gin_listen,
    gin_connect,
    nullptr,  // createContext: GIN_PROXY mode, NCCL builds its own proxy context
    gin_reg_mr_sym,
    nullptr,  // regMrSymDmaBuf: DMABUF is not advertised
    gin_dereg_mr_sym,
    nullptr,  // destroyContext
    gin_close_coll,
    gin_close_listen,
    gin_iput,
    gin_iput_signal,
    gin_test,
    gin_progress,
    nullptr,  // queryLastError: unused in GIN_PROXY mode; errors are sticky on iput
    gin_finalize,
};

/// Test hooks (EPX's own, not NCCL's): shared host memory the host memops
/// export, what CPU tests register as windows. 0 on success.
__attribute__((visibility("default"))) int epxGinLoopHostAlloc(std::size_t bytes, void** out) {
  try {
    *out = host_alloc_shared(bytes);
    return 0;
  } catch (...) {
    return 1;
  }
}
__attribute__((visibility("default"))) int epxGinLoopHostFree(void* base) {
  try {
    host_free_shared(base);
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // extern "C"
