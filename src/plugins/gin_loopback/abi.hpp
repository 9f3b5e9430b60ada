// plugins/gin_loopback/abi.hpp - EPX's own statement of the parts of NCCL's
// external net plugin ABI (version 11, as NCCL 2.28.9 loads it) that the
// loopback GIN plugin exports: the net table, the GIN table, the properties
// struct and the constants the plugin reads or writes.
//
// NCCL ships no plugin header in its wheel (docs/nccl_gin.md, Risks 3), so
// the layouts are declared here. The type and member names follow NCCL's so
// that the tables read the same way as NCCL's documentation; the layouts must
// be binary identical, which the static_asserts at the end pin down (sizes and
// offsets checked against NCCL 2.28.9's net_v11.h). Everything lives in
// epx::gin_loop, so this header can sit next to nccl.h in one translation unit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx::gin_loop {

// ---- result codes (nccl.h's ncclResult_t, values as in 2.28.9) ---------------
enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
};

// ---- logging (the logger NCCL hands to init) -----------------------------------
enum ncclDebugLogLevel : int {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
};
/// Subsystem bits passed as the logger's `flags`; the plugin logs under NET.
inline constexpr unsigned long NCCL_INIT = 0x1;
inline constexpr unsigned long NCCL_NET = 0x10;

using ncclDebugLogger_t = void (*)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                   int line, const char* fmt, ...);
/// The profiler callback the net table's init receives (unused by EPX).
using ncclProfilerCallback_t = ncclResult_t (*)(void** eHandle, int type, void* pHandle,
                                                int64_t pluginId, void* extData);

// ---- constants of the net plugin interface --------------------------------------
/// Bytes of the opaque handle listen() fills and NCCL allgathers.
inline constexpr std::size_t NCCL_NET_HANDLE_MAXSIZE = 128;
/// ptrSupport bits and regMr types.
inline constexpr int NCCL_PTR_HOST = 0x1;
inline constexpr int NCCL_PTR_CUDA = 0x2;
inline constexpr int NCCL_PTR_DMABUF = 0x4;
/// regMrSym flag: accesses to the region must be strongly ordered (signal buffers).
inline constexpr uint64_t NCCL_NET_MR_FLAG_FORCE_SO = 1u << 0;
/// iputSignal operations.
inline constexpr uint32_t NCCL_NET_SIGNAL_OP_INC = 0x1;
inline constexpr uint32_t NCCL_NET_SIGNAL_OP_ADD = 0x2;
/// Length of the vProps.devs array.
inline constexpr int NCCL_NET_MAX_DEVS_PER_NIC = 4;

/// What a device offers (nccl_device/net_device.h): the net table must say
/// HOST, the GIN table GIN_PROXY (NCCL then runs its own proxy queues).
enum ncclNetDeviceType : int {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1,
  NCCL_NET_DEVICE_GIN_PROXY = 2,
  NCCL_NET_DEVICE_GIN_GDAKI = 3,
};

struct ncclNetDeviceHandle_v11_t {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  std::size_t size;
  int needsProxyProgress;
};

struct ncclNetVDeviceProps_v11_t {
  int ndevs;
  int devs[NCCL_NET_MAX_DEVS_PER_NIC];
};

struct ncclNetCommConfig_v11_t {
  int trafficClass;
};

struct ncclNetProperties_v11_t {
  char* name;
  char* pciPath;  ///< NULL: NCCL hangs the device off the first CPU of its topology
  uint64_t guid;
  int ptrSupport;  ///< NCCL_PTR_* bits
  int regIsGlobal;
  int forceFlush;
  int speed;  ///< Mbps
  int port;
  float latency;
  int maxComms;
  int maxRecvs;  ///< GIN proxy: NCCL queues 32 * maxRecvs descriptors per (context, peer)
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v11_t vProps;
  std::size_t maxP2pBytes;
  std::size_t maxCollBytes;
  int maxMultiRequestSize;
};

/// Attributes setNetAttr may hand the net table (the stub ignores them).
struct ncclNetCommAttr_v11_t {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
};
struct ncclNetAttr_v11_t {
  ncclNetCommAttr_v11_t sendCommAttr;
  ncclNetCommAttr_v11_t recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
};

/// The net table (symbol ncclNetPlugin_v11): a name and 21 entry points.
struct ncclNet_v11_t {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                       ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v11_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v11_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm,
                         ncclNetDeviceHandle_v11_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, std::size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, std::size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, std::size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, std::size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v11_t* props);
  ncclResult_t (*finalize)(void* ctx);
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_v11_t* netAttr);
};

/// The GIN table (symbol ncclGinPlugin_v11): a name and 18 entry points.
struct ncclGin_v11_t {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v11_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(void* ctx, void* handles[], int nranks, int rank, void* listenComm,
                          void** collComm);
  ncclResult_t (*createContext)(void* collComm, int nSignals, int nCounters, void** ginCtx,
                                ncclNetDeviceHandle_v11_t** devHandle);
  ncclResult_t (*regMrSym)(void* collComm, void* data, std::size_t size, int type, uint64_t mrFlags,
                           void** mhandle, void** ginHandle);
  ncclResult_t (*regMrSymDmaBuf)(void* collComm, void* data, std::size_t size, int type,
                                 uint64_t offset, int fd, uint64_t mrFlags, void** mhandle,
                                 void** ginHandle);
  ncclResult_t (*deregMrSym)(void* collComm, void* mhandle);
  ncclResult_t (*destroyContext)(void* ginCtx);
  ncclResult_t (*closeColl)(void* collComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*iput)(void* collComm, uint64_t srcOff, void* srcMhandle, std::size_t size,
                       uint64_t dstOff, void* dstMhandle, uint32_t rank, void** request);
  ncclResult_t (*iputSignal)(void* collComm, uint64_t srcOff, void* srcMhandle, std::size_t size,
                             uint64_t dstOff, void* dstMhandle, uint32_t rank, uint64_t signalOff,
                             void* signalMhandle, uint64_t signalValue, uint32_t signalOp,
                             void** request);
  ncclResult_t (*test)(void* collComm, void* request, int* done);
  ncclResult_t (*ginProgress)(void* collComm);
  ncclResult_t (*queryLastError)(void* ginCtx, bool* hasError);
  ncclResult_t (*finalize)(void* ctx);
};

// ---- the layout NCCL 2.28.9 was compiled with (x86-64 / aarch64 LP64) -----------
static_assert(sizeof(ncclResult_t) == 4 && sizeof(ncclNetDeviceType) == 4);
static_assert(sizeof(ncclNetDeviceHandle_v11_t) == 32);
static_assert(offsetof(ncclNetDeviceHandle_v11_t, handle) == 8 &&
              offsetof(ncclNetDeviceHandle_v11_t, size) == 16 &&
              offsetof(ncclNetDeviceHandle_v11_t, needsProxyProgress) == 24);
static_assert(sizeof(ncclNetVDeviceProps_v11_t) == 20);
static_assert(sizeof(ncclNetProperties_v11_t) == 112);
static_assert(offsetof(ncclNetProperties_v11_t, ptrSupport) == 24 &&
              offsetof(ncclNetProperties_v11_t, maxRecvs) == 52 &&
              offsetof(ncclNetProperties_v11_t, netDeviceType) == 56 &&
              offsetof(ncclNetProperties_v11_t, vProps) == 64 &&
              offsetof(ncclNetProperties_v11_t, maxP2pBytes) == 88 &&
              offsetof(ncclNetProperties_v11_t, maxMultiRequestSize) == 104);
static_assert(sizeof(ncclNet_v11_t) == 176);  // name + 21 pointers
static_assert(offsetof(ncclNet_v11_t, test) == 8 * 13 &&
              offsetof(ncclNet_v11_t, makeVDevice) == 8 * 19 &&
              offsetof(ncclNet_v11_t, setNetAttr) == 8 * 21);
static_assert(sizeof(ncclGin_v11_t) == 152);  // name + 18 pointers
static_assert(offsetof(ncclGin_v11_t, connect) == 8 * 5 &&
              offsetof(ncclGin_v11_t, regMrSym) == 8 * 7 &&
              offsetof(ncclGin_v11_t, iput) == 8 * 13 &&
              offsetof(ncclGin_v11_t, iputSignal) == 8 * 14 &&
              offsetof(ncclGin_v11_t, test) == 8 * 15 &&
              offsetof(ncclGin_v11_t, finalize) == 8 * 18);

}  // namespace epx::gin_loop
