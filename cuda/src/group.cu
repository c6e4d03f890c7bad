// Host-side group management: buffers, peer access, status records.
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "group.h"

namespace jt {

static Group g_groups[JT_MAX_GROUPS];
static std::atomic<int> g_ngroups{0};
static std::mutex g_mu;

__attribute__((format(printf, 3, 4))) static void set_err(char* err,
                                                          int errlen,
                                                          const char* fmt,
                                                          ...) {
  if (err == nullptr || errlen <= 0) return;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, (size_t)errlen, fmt, ap);
  va_end(ap);
}

const Group* get_group(int gid) {
  if (gid < 0 || gid >= g_ngroups.load(std::memory_order_acquire))
    return nullptr;
  return &g_groups[gid];
}

bool make_comm(int gid, int rank, CommParams* c) {
  const Group* g = get_group(gid);
  if (g == nullptr || rank < 0 || rank >= g->world) return false;
  std::memset(c, 0, sizeof(*c));
  for (int r = 0; r < g->world; ++r) c->inbox[r] = g->inbox[r];
  c->epoch_ctr = g->ctrs[rank];
  c->done_ctr = g->ctrs[rank] + 1;
  c->status = g->status + rank;
  c->cap_lines = g->cap_lines;
  c->timeout_ns = g->timeout_ns;
  c->rank = rank;
  c->world = g->world;
  return true;
}

}  // namespace jt

using jt::g_groups;
using jt::g_mu;
using jt::g_ngroups;

extern "C" {

const char* jt_version(void) { return "jtilert-engine 0.1"; }

int jt_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return n;
}

int jt_sm_count(int dev) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) !=
      cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return v;
}

int jt_can_access_peers(const int* devices, int n, char* err, int errlen) {
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int ok = 0;
      cudaError_t e = cudaDeviceCanAccessPeer(&ok, devices[i], devices[j]);
      if (e != cudaSuccess) {
        cudaGetLastError();
        jt::set_err(err, errlen, "cudaDeviceCanAccessPeer: %s (%d -> %d)",
                    cudaGetErrorString(e), devices[i], devices[j]);
        return -1;
      }
      if (!ok) {
        jt::set_err(err, errlen, "device %d cannot access device %d",
                    devices[i], devices[j]);
        return 0;
      }
    }
  }
  return 1;
}

int jt_group_find(const int* devices, int world) {
  int n = g_ngroups.load(std::memory_order_acquire);
  for (int g = 0; g < n; ++g) {
    if (g_groups[g].world != world) continue;
    bool same = true;
    for (int r = 0; r < world; ++r) same &= g_groups[g].devices[r] == devices[r];
    if (same) return g;
  }
  return -1;
}

int jt_group_lookup(const int* groups, int ngroups, int world, int device,
                    int* rank) {
  for (int k = 0; k < ngroups; ++k) {
    const int* devs = groups + (long long)k * world;
    for (int r = 0; r < world; ++r) {
      if (devs[r] == device) {
        int gid = jt_group_find(devs, world);
        if (gid >= 0 && rank != nullptr) *rank = r;
        return gid;
      }
    }
  }
  return -1;
}

int64_t jt_group_payload_cap(int gid) {
  const jt::Group* g = jt::get_group(gid);
  return g == nullptr ? -1 : g->cap_lines * 8;
}

int jt_group_status(int gid, int rank, JtStatus* out) {
  const jt::Group* g = jt::get_group(gid);
  if (g == nullptr || rank < 0 || rank >= g->world || out == nullptr) return -1;
  std::memcpy(out, (const void*)(g->status + rank), sizeof(JtStatus));
  return 0;
}

#define JT_TRY(call, what)                                                   \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                 \
      cudaGetLastError();                                                    \
      jt::set_err(err, errlen, "%s failed: %s (device %d)", what,            \
                  cudaGetErrorString(e_), dev);                              \
      cudaSetDevice(prev_dev);                                               \
      return -1;                                                             \
    }                                                                        \
  } while (0)

int jt_group_create(const int* devices, int world, int64_t payload_cap,
                    int64_t timeout_ms, char* err, int errlen) {
  std::lock_guard<std::mutex> lock(g_mu);
  int found = jt_group_find(devices, world);
  if (found >= 0) {
    if (g_groups[found].cap_lines * 8 < payload_cap) {
      jt::set_err(err, errlen, "group exists with a smaller payload cap");
      return -1;
    }
    return found;
  }
  if (world < 1 || world > JT_MAX_WORLD) {
    jt::set_err(err, errlen, "world %d outside [1, %d]", world,
                JT_MAX_WORLD);
    return -1;
  }
  int n = g_ngroups.load(std::memory_order_relaxed);
  if (n >= JT_MAX_GROUPS) {
    jt::set_err(err, errlen, "too many groups (%d)", n);
    return -1;
  }
  int ndev = jt_device_count();
  for (int r = 0; r < world; ++r) {
    if (devices[r] < 0 || devices[r] >= ndev) {
      jt::set_err(err, errlen, "device %d not visible (%d devices)",
                  devices[r], ndev);
      return -1;
    }
    for (int q = 0; q < r; ++q) {
      if (devices[q] == devices[r]) {
        jt::set_err(err, errlen, "device %d listed twice", devices[r]);
        return -1;
      }
    }
  }
  if (world > 1) {
    int ok = jt_can_access_peers(devices, world, err, errlen);
    if (ok != 1) return -1;
  }
  if (payload_cap < 8) payload_cap = 8;
  jt::Group& g = g_groups[n];
  std::memset(&g, 0, sizeof(g));
  g.world = world;
  g.cap_lines = (payload_cap + 7) / 8;
  g.timeout_ns = (long long)timeout_ms * 1000000LL;
  for (int r = 0; r < world; ++r) g.devices[r] = devices[r];

  int prev_dev = 0;
  cudaGetDevice(&prev_dev);
  int dev = devices[0];
  size_t inbox_bytes = (size_t)4 * world * g.cap_lines * sizeof(uint4);
  JT_TRY(cudaHostAlloc((void**)&g.status, sizeof(JtStatus) * world,
                       cudaHostAllocMapped | cudaHostAllocPortable),
         "cudaHostAlloc");
  std::memset((void*)g.status, 0, sizeof(JtStatus) * world);
  for (int r = 0; r < world; ++r) {
    dev = devices[r];
    JT_TRY(cudaSetDevice(dev), "cudaSetDevice");
    JT_TRY(cudaMalloc((void**)&g.inbox[r], inbox_bytes), "cudaMalloc(inbox)");
    JT_TRY(cudaMemset(g.inbox[r], 0, inbox_bytes), "cudaMemset(inbox)");
    JT_TRY(cudaMalloc((void**)&g.ctrs[r], 64), "cudaMalloc(counters)");
    JT_TRY(cudaMemset(g.ctrs[r], 0, 64), "cudaMemset(counters)");
    for (int q = 0; q < world; ++q) {
      if (q == r) continue;
      cudaError_t e = cudaDeviceEnablePeerAccess(devices[q], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else {
        JT_TRY(e, "cudaDeviceEnablePeerAccess");
      }
    }
    JT_TRY(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  cudaSetDevice(prev_dev);
  g_ngroups.store(n + 1, std::memory_order_release);
  return n;
}

}  // extern "C"
