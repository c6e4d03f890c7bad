// Per-device preparation: raise the dynamic shared-memory limits once.
#include <cstdio>
#include <mutex>

#include "common.cuh"

namespace jt {
int prepare_gemv_kernels(int max_smem);
int prepare_topk_kernels(int max_smem);
int prepare_moe_kernels(int max_smem);
}  // namespace jt

namespace {
std::mutex g_prep_mu;
bool g_prepared[64] = {};
}  // namespace

extern "C" int jt_prepare_device(int dev, char* err, int errlen) {
  std::lock_guard<std::mutex> lock(g_prep_mu);
  if (dev < 0 || dev >= 64) {
    if (err && errlen > 0) std::snprintf(err, (size_t)errlen, "bad device %d", dev);
    return -1;
  }
  if (g_prepared[dev]) return 0;
  int prev = 0;
  cudaGetDevice(&prev);
  int rc = 0;
  int max_smem = 0;
  cudaError_t e = cudaSetDevice(dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               dev);
  if (e == cudaSuccess) {
    // the kernels also use a few bytes of static shared memory
    max_smem -= 1024;
    rc = jt::prepare_gemv_kernels(max_smem);
    if (rc == 0) rc = jt::prepare_topk_kernels(max_smem);
    if (rc == 0) rc = jt::prepare_moe_kernels(max_smem);
    if (rc != 0) e = (cudaError_t)rc;
  }
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (err && errlen > 0)
      std::snprintf(err, (size_t)errlen, "prepare device %d: %s", dev,
                    cudaGetErrorString(e));
    return -1;
  }
  g_prepared[dev] = true;
  return 0;
}
