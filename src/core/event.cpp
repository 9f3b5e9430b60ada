#include "epx/event.hpp"

#include "common/check.hpp"

namespace epx {

Event Event::record(cudaStream_t stream) {
  Event e;
  cudaEvent_t ev = nullptr;
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  e.ev_ = std::shared_ptr<cudaEvent_t>(new cudaEvent_t(ev), [](cudaEvent_t* p) {
    cudaEventDestroy(*p);  // destructor: nothing sensible to do on failure
    delete p;
  });
  EPX_CUDA_CHECK(cudaEventRecord(ev, stream));
  return e;
}

void Event::stream_wait(cudaStream_t stream) const {
  if (ev_) EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, *ev_, 0));
}

void Event::synchronize() const {
  if (ev_) EPX_CUDA_CHECK(cudaEventSynchronize(*ev_));
}

bool Event::done() const {
  if (!ev_) return true;
  const cudaError_t e = cudaEventQuery(*ev_);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error; not left for a later check
    return false;
  }
  EPX_CUDA_CHECK(e);
  return true;
}

namespace {
/// Keeps freed memory in the device's default pool (release threshold: never)
/// so stream-ordered allocations are recycled instead of remapped every call.
/// Setting it again is harmless, so nothing remembers which devices are done.
void keep_pool_memory() {
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  EPX_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = UINT64_MAX;
  EPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
}
}  // namespace

Allocator default_allocator() {
  keep_pool_memory();
  return [](DType dtype, const std::vector<int64_t>& shape, cudaStream_t stream) {
    int device = 0;
    EPX_CUDA_CHECK(cudaGetDevice(&device));
    Tensor t;
    t.view = TensorView::contiguous(nullptr, dtype, shape, device);
    const std::size_t bytes = t.view.nbytes();
    void* p = nullptr;
    if (bytes > 0) EPX_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    t.view.data = p;
    t.owner = std::shared_ptr<void>(p, [stream](void* q) {
      if (q) cudaFreeAsync(q, stream);
    });
    return t;
  };
}

}  // namespace epx
