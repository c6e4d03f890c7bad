// The token ring: where a decode step leaves its new tokens for the host,
// at an address that never changes.
//
// Why: a step that returns its token as an output (even into pinned host
// memory) gets a new output buffer on every call, and XLA updates its
// command buffer for the moved address before launching it, which adds to
// every call's host time. Written by a kernel into one fixed pinned
// buffer, the token leaves the step's outputs alone: every call's buffers
// are the donated ones of the call before.
//
// What: per device, JT_RING_SLOTS slots of JT_RING_SLOT_INTS int32s in
// host-mapped pinned memory: slot[0] the step's position (its key), slot[1]
// the count of values, slot[2..] the values. The step with position p writes
// slot p mod JT_RING_SLOTS.
//
// Protocol: the kernel writes the values and the count, makes them visible
// to the host (__threadfence_system), then writes the key last, and returns
// the next step's position (the key plus the count) in device memory: the
// step carries it, which is what keeps the call in XLA's program (a
// side-effecting call would keep it too, but XLA then spends about a
// millisecond more on every launch of the step). A count of 0 writes
// nothing. The host
// waits until the slot's key equals the position it expects and only then
// reads the count and the values (x86 keeps the order of loads). Positions
// only grow within a generation, so a slot is written again only after
// JT_RING_SLOTS / 2 steps or more, long after the host read it; the host sets
// every key to -1 before a generation starts, so a key left by an earlier
// generation at the same position is never taken for a new one.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <mutex>

#include "jtilert/engine.h"

namespace jt {
namespace {

struct Ring {
  int32_t* host = nullptr;    // the slots, as the host sees them
  int32_t* device = nullptr;  // the same memory, as kernels see it
};

constexpr int kMaxDevices = 64;
std::mutex g_ring_mutex;
Ring g_rings[kMaxDevices];

__global__ void ring_write_kernel(int32_t* ring, const int32_t* pos,
                                  const int32_t* __restrict__ values, int n_values,
                                  const int32_t* __restrict__ count, int32_t* next) {
  // `next` may be `pos`'s buffer (XLA aliases them): the key is read before the result is written.
  const int32_t p = *pos;
  const int32_t n = count != nullptr ? *count : n_values;
  next[0] = p + n;
  if (n == 0) return;  // no tokens: the slot is left alone
  const int32_t s = ((p % JT_RING_SLOTS) + JT_RING_SLOTS) % JT_RING_SLOTS;
  volatile int32_t* slot = ring + (int64_t)s * JT_RING_SLOT_INTS;
  for (int i = 0; i < n_values; ++i) slot[2 + i] = values[i];
  slot[1] = n;
  __threadfence_system();  // the values and count reach the host before the key
  slot[0] = p;
}

}  // namespace
}  // namespace jt

extern "C" int32_t* jt_token_ring(int dev, char* err, int errlen) {
  if (dev < 0 || dev >= jt::kMaxDevices) {
    std::snprintf(err, (size_t)errlen, "token ring: device %d out of range", dev);
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(jt::g_ring_mutex);
  jt::Ring& r = jt::g_rings[dev];
  if (r.host != nullptr) return r.host;
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess) e = cudaSetDevice(dev);
  void* host = nullptr;
  const size_t bytes = sizeof(int32_t) * JT_RING_SLOTS * JT_RING_SLOT_INTS;
  if (e == cudaSuccess) e = cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  void* device = nullptr;
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(&device, host, 0);
  if (cur >= 0) cudaSetDevice(cur);
  if (e != cudaSuccess) {
    if (host != nullptr) cudaFreeHost(host);
    std::snprintf(err, (size_t)errlen, "token ring on device %d: %s", dev, cudaGetErrorString(e));
    return nullptr;
  }
  int32_t* h = static_cast<int32_t*>(host);
  for (int s = 0; s < JT_RING_SLOTS * JT_RING_SLOT_INTS; ++s) h[s] = -1;
  r.host = h;
  r.device = static_cast<int32_t*>(device);
  return r.host;
}

extern "C" cudaError_t jt_token_ring_write(cudaStream_t stream, int dev, const int32_t* pos,
                                           const int32_t* values, int n_values,
                                           const int32_t* count, int32_t* next) {
  if (dev < 0 || dev >= jt::kMaxDevices || pos == nullptr || values == nullptr ||
      next == nullptr || n_values < 1 || n_values > JT_RING_MAX_VALUES)
    return cudaErrorInvalidValue;
  int32_t* ring = nullptr;
  {
    std::lock_guard<std::mutex> lock(jt::g_ring_mutex);
    ring = jt::g_rings[dev].device;
  }
  if (ring == nullptr) return cudaErrorNotReady;  // jt_token_ring(dev) was never called
  jt::ring_write_kernel<<<1, 1, 0, stream>>>(ring, pos, values, n_values, count, next);
  return cudaGetLastError();
}
