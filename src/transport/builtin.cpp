// The backends built into libepx, one line each (transport/registry.hpp).
#include "transport/registry.hpp"

namespace epx::transport {

const BackendInfo& nvlink_backend_info();      // transport/nvlink/
const BackendInfo& in_process_backend_info();  // transport/in_process/
const BackendInfo& proxy_backend_info();       // transport/proxy/
const BackendInfo& nccl_backend_info();        // transport/nccl/
const BackendInfo& nvshmem_backend_info();     // transport/nvshmem/ (loads its module)

const std::vector<const BackendInfo*>& backends() {
  static const std::vector<const BackendInfo*> all = {
      &nvlink_backend_info(), &in_process_backend_info(), &proxy_backend_info(),
      &nccl_backend_info(),   &nvshmem_backend_info(),
  };
  return all;
}

}  // namespace epx::transport
