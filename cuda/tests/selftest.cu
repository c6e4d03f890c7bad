// Standalone multi-GPU self-test and micro-benchmark of the engine (no XLA).
//
//   jtilert_selftest [--small] [--iters N] [--bench] [--world W] [--select-only]
//
// One host thread per GPU, like XLA. Checks, against a CPU reference:
// all-reduce (one-shot, two-shot; bf16/f32; odd sizes), GEMV + all-reduce
// (bf16 and fp8 with block scales), merge_topk; results bit-identical across
// ranks; many consecutive calls alternating ops (epoch / parity reuse); the
// stacked-layer forms of GEMV and expert-down (one launch in a CUDA graph,
// replayed with the layer index rewritten in device memory); the one-GPU
// exact top-k (topk_select) against a sorted reference on device 0; the
// token ring on device 0.
// --small keeps sizes tiny for compute-sanitizer. --bench also times the ops
// inside CUDA graphs, one token ring write and a NVLink ping-pong (the latency
// floor). --select-only runs the one-GPU tests alone (top-k, token ring).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "jtilert/engine.h"

#define CK(call)                                                         \
  do {                                                                   \
    cudaError_t e_ = (call);                                             \
    if (e_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(e_));                              \
      std::exit(2);                                                      \
    }                                                                    \
  } while (0)

namespace {

int g_world = 1;
int g_fail = 0;
std::mutex g_print_mu;

void report(bool ok, const std::string& what) {
  std::lock_guard<std::mutex> l(g_print_mu);
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++g_fail;
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> l(mu_);
    int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

// Runs fn(rank) on one thread per rank, device = rank.
void run_ranks(const std::function<void(int)>& fn) {
  std::vector<std::thread> th;
  for (int r = 0; r < g_world; ++r)
    th.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      fn(r);
    });
  for (auto& t : th) t.join();
}

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
T* dev_copy(const std::vector<T>& h) {
  T* d = nullptr;
  CK(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty())
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
std::vector<T> host_copy(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// ---------------- all-reduce ----------------

struct ArCase {
  int64_t n;
  int dtype;
  int algo;
  int blocks, threads;
};

// inputs[r] as raw bytes; reference = fp32 sum in rank order, rounded.
void test_all_reduce(int gid, const std::vector<ArCase>& cases, int iters,
                     unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const ArCase& cs : cases) {
    const size_t es = cs.dtype == JT_F32 ? 4 : 2;
    std::vector<std::vector<unsigned char>> in(g_world,
                                               std::vector<unsigned char>(cs.n * es));
    for (int r = 0; r < g_world; ++r) {
      for (int64_t i = 0; i < cs.n; ++i) {
        float v = nd(rng);
        if (cs.dtype == JT_F32) {
          std::memcpy(&in[r][i * 4], &v, 4);
        } else {
          uint16_t b = f2bf(v);
          std::memcpy(&in[r][i * 2], &b, 2);
        }
      }
    }
    std::vector<unsigned char> ref(cs.n * es);
    for (int64_t i = 0; i < cs.n; ++i) {
      float acc = 0.f;
      for (int r = 0; r < g_world; ++r) {
        if (cs.dtype == JT_F32) {
          float v;
          std::memcpy(&v, &in[r][i * 4], 4);
          acc += v;
        } else {
          uint16_t b;
          std::memcpy(&b, &in[r][i * 2], 2);
          acc += bf2f(b);
        }
      }
      if (cs.dtype == JT_F32) {
        std::memcpy(&ref[i * 4], &acc, 4);
      } else {
        uint16_t b = f2bf(acc);
        std::memcpy(&ref[i * 2], &b, 2);
      }
    }
    std::vector<std::vector<unsigned char>> out(g_world);
    run_ranks([&](int r) {
      cudaStream_t st;
      CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      unsigned char* dx = dev_copy(in[r]);
      unsigned char* dy = nullptr;
      CK(cudaMalloc(&dy, cs.n * es));
      for (int it = 0; it < iters; ++it) {
        CK(cudaMemsetAsync(dy, 0xff, cs.n * es, st));  // poison
        CK(jt_all_reduce(gid, r, st, dx, dy, cs.n, cs.dtype, cs.algo,
                         cs.blocks, cs.threads));
      }
      CK(cudaStreamSynchronize(st));
      out[r] = host_copy(dy, cs.n * es);
      CK(cudaFree(dx));
      CK(cudaFree(dy));
      CK(cudaStreamDestroy(st));
    });
    bool same = true, exact = true;
    for (int r = 0; r < g_world; ++r) {
      same &= out[r] == out[0];
      exact &= out[r] == ref;
    }
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "all_reduce n=%lld %s %s grid=%dx%d iters=%d: "
                  "bit-identical=%d equals-ref=%d",
                  (long long)cs.n, cs.dtype == JT_F32 ? "f32" : "bf16",
                  cs.algo == JT_AR_TWOSHOT ? "two-shot" : "one-shot",
                  cs.blocks, cs.threads, iters, (int)same, (int)exact);
    report(same && exact, buf);
  }
}

// ---------------- GEMV + all-reduce ----------------

struct Plan {
  std::vector<int32_t> table;
  int num_ctas, max_tasks, T;
};

Plan make_plan(int N, int T, int sms) {
  int tiles = (N + T - 1) / T;
  int m = (tiles + sms - 1) / sms;
  int C = (tiles + m - 1) / m;
  Plan p;
  p.T = T;
  p.num_ctas = C;
  p.max_tasks = 0;
  p.table.push_back(C);
  p.table.push_back(T);
  int base = tiles / C, extra = tiles % C, off = 0;
  std::vector<int32_t> offs;
  for (int c = 0; c <= C; ++c) {
    offs.push_back(off);
    if (c < C) {
      int cnt = base + (c < extra ? 1 : 0);
      p.max_tasks = std::max(p.max_tasks, cnt);
      off += cnt;
    }
  }
  p.table.insert(p.table.end(), offs.begin(), offs.end());
  for (int t = 0; t < tiles; ++t) p.table.push_back(t * T);
  return p;
}

// Device copies on one rank's GPU, freed together.
struct DevBufs {
  int dev = 0;
  std::vector<void*> ptrs;
  DevBufs() = default;
  DevBufs(const DevBufs&) = delete;
  DevBufs& operator=(const DevBufs&) = delete;
  template <typename T>
  T* copy(const std::vector<T>& h) {
    if (h.empty()) return nullptr;
    CK(cudaSetDevice(dev));
    T* d = dev_copy(h);
    ptrs.push_back(d);
    return d;
  }
  ~DevBufs() {
    CK(cudaSetDevice(dev));
    for (void* p : ptrs) CK(cudaFree(p));
  }
};

std::vector<DevBufs> rank_bufs() {
  std::vector<DevBufs> b(g_world);
  for (int r = 0; r < g_world; ++r) b[r].dev = r;
  return b;
}

// Runs launch(r, stream, y) `iters` times on every rank into y (N bf16,
// poisoned before each launch); returns every rank's y.
std::vector<std::vector<uint16_t>> run_launches(
    int N, int iters,
    const std::function<void(int, cudaStream_t, uint16_t*)>& launch) {
  std::vector<std::vector<uint16_t>> out(g_world);
  run_ranks([&](int r) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint16_t* dy = nullptr;
    CK(cudaMalloc(&dy, N * 2));
    for (int it = 0; it < iters; ++it) {
      CK(cudaMemsetAsync(dy, 0xff, N * 2, st));
      launch(r, st, dy);
    }
    CK(cudaStreamSynchronize(st));
    out[r] = host_copy(dy, N);
    CK(cudaFree(dy));
    CK(cudaStreamDestroy(st));
  });
  return out;
}

// `mats` random weight matrices [N, K]: bf16, or fp8 e4m3 with a power-of-two
// scale per 128x128 block (scales [mats][ceil(N/128)][ceil(K/128)]).
struct HostWeights {
  int N, K, NB, KB;
  bool fp8;
  std::vector<uint16_t> b;
  std::vector<uint8_t> q;
  std::vector<float> s;

  HostWeights(std::mt19937& rng, int mats, int n, int k, bool f8)
      : N(n), K(k), NB((n + 127) / 128), KB((k + 127) / 128), fp8(f8) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const size_t elems = (size_t)mats * N * K;
    if (fp8) {
      const float pw[4] = {0.25f, 0.5f, 1.f, 2.f};
      s.resize((size_t)mats * NB * KB);
      for (auto& v : s) v = pw[rng() & 3u];
      q.resize(elems);
      for (auto& v : q)
        v = (uint8_t)__nv_cvt_float_to_fp8(nd(rng) * 8.f, __NV_SATFINITE,
                                           __NV_E4M3);
    } else {
      b.resize(elems);
      for (auto& v : b) v = f2bf(nd(rng) * 0.05f);
    }
  }
  // dequantised W_m[n, k]
  double at(int m, int n, int k) const {
    const size_t i = ((size_t)m * N + n) * K + k;
    if (!fp8) return bf2f(b[i]);
    __half_raw h = __nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3);
    return (double)__half2float(__half(h)) *
           s[((size_t)m * NB + n / 128) * KB + k / 128];
  }
  void* upload_w(DevBufs& d) const {
    return fp8 ? (void*)d.copy(q) : (void*)d.copy(b);
  }
  float* upload_s(DevBufs& d) const { return d.copy(s); }
};

std::vector<uint16_t> rand_bf16(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f2bf(nd(rng));
  return v;
}

// Reports rank 0's output against the fp64 reference (relative L2 error) and
// whether ranks [0, same_ranks) agree bit for bit.
void check_output(const std::vector<std::vector<uint16_t>>& out,
                  const std::vector<double>& ref, int same_ranks,
                  const std::string& what) {
  bool same = true;
  for (int r = 0; r < same_ranks; ++r) same &= out[r] == out[0];
  double num = 0, den = 0;
  bool finite = true;
  for (size_t n = 0; n < ref.size(); ++n) {
    double y = bf2f(out[0][n]);
    finite &= std::isfinite(y);
    num += (y - ref[n]) * (y - ref[n]);
    den += ref[n] * ref[n];
  }
  double rel = std::sqrt(num / std::max(den, 1e-30));
  char buf[64];
  std::snprintf(buf, sizeof(buf), ": bit-identical=%d rel-err=%.2e", (int)same,
                rel);
  report(same && finite && rel < 8e-3, what + buf);
}

void test_gemv(int gid, int N, int K, bool fp8, int nwc, int rpw, int iters,
               unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<uint16_t>> xs(g_world);
  std::vector<HostWeights> ws;
  std::vector<double> ref(N, 0.0);
  // gid < 0: every rank runs a local GEMV; rank 0's is checked
  const int ref_ranks = gid < 0 ? 1 : g_world;
  for (int r = 0; r < g_world; ++r) {
    xs[r] = rand_bf16(rng, K);
    ws.emplace_back(rng, 1, N, K, fp8);
    for (int n = 0; n < N && r < ref_ranks; ++n) {
      double acc = 0.0;
      for (int k = 0; k < K; ++k) acc += ws[r].at(0, n, k) * bf2f(xs[r][k]);
      ref[n] += acc;
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  std::vector<DevBufs> bufs = rank_bufs();
  std::vector<const void*> dx(g_world), dw(g_world);
  std::vector<const float*> ds(g_world);
  std::vector<const int32_t*> dt(g_world);
  for (int r = 0; r < g_world; ++r) {
    dx[r] = bufs[r].copy(xs[r]);
    dw[r] = ws[r].upload_w(bufs[r]);
    ds[r] = ws[r].upload_s(bufs[r]);
    dt[r] = bufs[r].copy(plan.table);
  }
  auto out = run_launches(N, iters, [&](int r, cudaStream_t st, uint16_t* dy) {
    CK(jt_gemv_all_reduce(gid, r, st, dx[r], dw[r], ds[r], dt[r], dy, N, K,
                          fp8 ? JT_F8E4M3 : JT_BF16, nwc, rpw, plan.num_ctas,
                          plan.max_tasks));
  });
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "gemv_all_reduce N=%d K=%d %s nwc=%d rpw=%d ctas=%d tasks<=%d "
                "iters=%d (gid %d)",
                N, K, fp8 ? "fp8" : "bf16", nwc, rpw, plan.num_ctas,
                plan.max_tasks, iters, gid);
  check_output(out, ref, ref_ranks, buf);
}

// ---------------- MoE down + shared expert + all-reduce ----------------

// y = sum over ranks of (sum_j w_j Down_r[ids_j] h_r[j] + Shared_r h_s,r).
// The router is replicated, so every rank gets the same ids and weights; ids
// include an out-of-range value on purpose when `clamp` (the kernel clamps it
// into [0, E) like an XLA gather).
void test_expert_down(int gid, int N, int nsel, int I, int E, int Is, bool fp8,
                      int nwc, int rpw, int iters, unsigned seed,
                      bool clamp = false) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(nsel);
  std::vector<float> wts(nsel);
  for (int j = 0; j < nsel; ++j) {
    ids[j] = (int32_t)((j * 7 + 3) % E);
    wts[j] = 0.1f + 0.9f * (float)(rng() % 1000) / 1000.f;
  }
  if (clamp) ids[0] = E + 5;
  std::vector<std::vector<uint16_t>> hs(g_world), hsh(g_world);
  std::vector<HostWeights> down, shared;
  std::vector<double> ref(N, 0.0);
  const int ref_ranks = gid < 0 ? 1 : g_world;
  for (int r = 0; r < g_world; ++r) {
    hs[r] = rand_bf16(rng, (size_t)nsel * I);
    hsh[r] = rand_bf16(rng, Is);
    down.emplace_back(rng, E, N, I, fp8);
    shared.emplace_back(rng, 1, N, Is, fp8);
    for (int n = 0; n < N && r < ref_ranks; ++n) {
      double acc = 0.0;
      for (int j = 0; j < nsel; ++j) {
        const int e = std::min(std::max(ids[j], 0), E - 1);
        double a = 0.0;
        for (int i = 0; i < I; ++i)
          a += down[r].at(e, n, i) * bf2f(hs[r][(size_t)j * I + i]);
        acc += (double)wts[j] * a;
      }
      for (int i = 0; i < Is; ++i) acc += shared[r].at(0, n, i) * bf2f(hsh[r][i]);
      ref[n] += acc;
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  struct In {
    const void *h, *hs, *w, *sw;
    const float *wts, *s, *ss;
    const int32_t *ids, *table;
  };
  std::vector<DevBufs> bufs = rank_bufs();
  std::vector<In> in(g_world);
  for (int r = 0; r < g_world; ++r) {
    DevBufs& b = bufs[r];
    in[r] = In{b.copy(hs[r]), b.copy(hsh[r]), down[r].upload_w(b),
               shared[r].upload_w(b), b.copy(wts), down[r].upload_s(b),
               shared[r].upload_s(b), b.copy(ids), b.copy(plan.table)};
  }
  auto out = run_launches(N, iters, [&](int r, cudaStream_t st, uint16_t* dy) {
    const In& a = in[r];
    CK(jt_expert_down_all_reduce(gid, r, st, a.h, a.wts, a.ids, a.w, a.s, a.hs,
                                 a.sw, a.ss, a.table, dy, N, nsel, I, E, Is,
                                 fp8 ? JT_F8E4M3 : JT_BF16, nwc, rpw,
                                 plan.num_ctas, plan.max_tasks));
  });
  char buf[240];
  std::snprintf(buf, sizeof(buf),
                "expert_down_all_reduce N=%d %dx[%d] of E=%d + shared[%d] %s "
                "nwc=%d rpw=%d ctas=%d tasks<=%d iters=%d (gid %d)%s",
                N, nsel, I, E, Is, fp8 ? "fp8" : "bf16", nwc, rpw,
                plan.num_ctas, plan.max_tasks, iters, gid,
                clamp ? " id out of range" : "");
  check_output(out, ref, ref_ranks, buf);
}

// ---------------- stacked layers ----------------

// Effective layer of index v for L layers: negative from the end, then
// clamped into [0, L) (jnp's w[layer]).
int layer_of(int v, int L) {
  if (v < 0) v += L;
  return std::min(std::max(v, 0), L - 1);
}

// Layer indices every stacked test runs: the last, the first, -1 (the last
// again), L + 2 (clamped to the last), 1.
std::vector<int> layer_values(int L) { return {L - 1, 0, -1, L + 2, 1 % L}; }

// One launch per rank captured in a CUDA graph (as XLA's command buffers do),
// replayed once per value of `layers` with the layer index rewritten in device
// memory before each replay and y poisoned: out[i][r] is rank r's y for
// layers[i]. The index is two device int32s, base and offset, whose sum is
// layers[i] (the offset varies: -1, 0, 1, ...). The launch itself never
// changes, only the device values.
std::vector<std::vector<std::vector<uint16_t>>> run_layer_graph(
    int N, const std::vector<int>& layers,
    const std::function<void(int, cudaStream_t, const int32_t*, const int32_t*,
                             uint16_t*)>& launch) {
  const size_t nl = layers.size();
  std::vector<std::vector<std::vector<uint16_t>>> out(
      nl, std::vector<std::vector<uint16_t>>(g_world));
  run_ranks([&](int r) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int32_t* dl = nullptr;
    int32_t* hl = nullptr;
    uint16_t *dy = nullptr, *all = nullptr;
    CK(cudaMalloc(&dl, 8));
    CK(cudaMalloc(&dy, (size_t)N * 2));
    CK(cudaMalloc(&all, nl * N * 2));
    CK(cudaMallocHost(&hl, nl * 8));
    for (size_t i = 0; i < nl; ++i) {
      const int offset = (int)(i % 3) - 1;
      hl[2 * i] = layers[i] - offset;
      hl[2 * i + 1] = offset;
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    launch(r, st, dl, dl + 1, dy);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (size_t i = 0; i < nl; ++i) {
      CK(cudaMemsetAsync(dy, 0xff, (size_t)N * 2, st));
      CK(cudaMemcpyAsync(dl, hl + 2 * i, 8, cudaMemcpyHostToDevice, st));
      CK(cudaGraphLaunch(exec, st));
      CK(cudaMemcpyAsync(all + i * N, dy, (size_t)N * 2,
                         cudaMemcpyDeviceToDevice, st));
    }
    CK(cudaStreamSynchronize(st));
    const std::vector<uint16_t> h = host_copy(all, nl * N);
    for (size_t i = 0; i < nl; ++i)
      out[i][r].assign(h.begin() + i * N, h.begin() + (i + 1) * N);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaFreeHost(hl));
    CK(cudaFree(dl));
    CK(cudaFree(dy));
    CK(cudaFree(all));
    CK(cudaStreamDestroy(st));
  });
  return out;
}

// jt_gemv_all_reduce_layer: w [L, N, K] (scales [L, ...]) per rank, every
// layer different; each layer index of layer_values against the fp64
// reference of its layer's weights.
void test_gemv_layers(int gid, int N, int K, bool fp8, int nwc, int rpw, int L,
                      unsigned seed) {
  std::mt19937 rng(seed);
  const int ref_ranks = gid < 0 ? 1 : g_world;
  std::vector<std::vector<uint16_t>> xs(g_world);
  std::vector<HostWeights> ws;
  for (int r = 0; r < g_world; ++r) {
    xs[r] = rand_bf16(rng, K);
    ws.emplace_back(rng, L, N, K, fp8);
  }
  const std::vector<int> layers = layer_values(L);
  std::vector<std::vector<double>> ref(L);
  for (int v : layers) {
    const int l = layer_of(v, L);
    if (!ref[l].empty()) continue;
    ref[l].assign(N, 0.0);
    for (int r = 0; r < ref_ranks; ++r)
      for (int n = 0; n < N; ++n) {
        double acc = 0.0;
        for (int k = 0; k < K; ++k) acc += ws[r].at(l, n, k) * bf2f(xs[r][k]);
        ref[l][n] += acc;
      }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  std::vector<DevBufs> bufs = rank_bufs();
  std::vector<const void*> dx(g_world), dw(g_world);
  std::vector<const float*> ds(g_world);
  std::vector<const int32_t*> dt(g_world);
  for (int r = 0; r < g_world; ++r) {
    dx[r] = bufs[r].copy(xs[r]);
    dw[r] = ws[r].upload_w(bufs[r]);
    ds[r] = ws[r].upload_s(bufs[r]);
    dt[r] = bufs[r].copy(plan.table);
  }
  auto out = run_layer_graph(
      N, layers,
      [&](int r, cudaStream_t st, const int32_t* dl, const int32_t* doff,
          uint16_t* dy) {
        CK(jt_gemv_all_reduce_layer(gid, r, st, dx[r], dw[r], ds[r], dl, doff,
                                    L, dt[r], dy, N, K,
                                    fp8 ? JT_F8E4M3 : JT_BF16, nwc, rpw,
                                    plan.num_ctas, plan.max_tasks));
      });
  for (size_t i = 0; i < layers.size(); ++i) {
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "gemv_all_reduce_layer N=%d K=%d %s L=%d layer=%d (-> %d) "
                  "nwc=%d rpw=%d graph (gid %d)",
                  N, K, fp8 ? "fp8" : "bf16", L, layers[i],
                  layer_of(layers[i], L), nwc, rpw, gid);
    check_output(out[i], ref[layer_of(layers[i], L)], ref_ranks, buf);
  }
}

// jt_expert_down_all_reduce_layer: down [L, E, N, I] and shared [L, N, Is]
// (scales likewise) per rank, every layer different, the same hidden vectors,
// routing weights and ids for every layer.
void test_expert_down_layers(int gid, int N, int nsel, int I, int E, int Is,
                             bool fp8, int nwc, int rpw, int L,
                             unsigned seed) {
  std::mt19937 rng(seed);
  const int ref_ranks = gid < 0 ? 1 : g_world;
  std::vector<int32_t> ids(nsel);
  std::vector<float> wts(nsel);
  for (int j = 0; j < nsel; ++j) {
    ids[j] = (int32_t)((j * 5 + 1) % E);
    wts[j] = 0.1f + 0.9f * (float)(rng() % 1000) / 1000.f;
  }
  std::vector<std::vector<uint16_t>> hs(g_world), hsh(g_world);
  std::vector<HostWeights> down, shared;
  for (int r = 0; r < g_world; ++r) {
    hs[r] = rand_bf16(rng, (size_t)nsel * I);
    hsh[r] = rand_bf16(rng, Is);
    down.emplace_back(rng, L * E, N, I, fp8);  // [L * E, N, I] = [L, E, N, I]
    shared.emplace_back(rng, L, N, Is, fp8);
  }
  const std::vector<int> layers = layer_values(L);
  std::vector<std::vector<double>> ref(L);
  for (int v : layers) {
    const int l = layer_of(v, L);
    if (!ref[l].empty()) continue;
    ref[l].assign(N, 0.0);
    for (int r = 0; r < ref_ranks; ++r)
      for (int n = 0; n < N; ++n) {
        double acc = 0.0;
        for (int j = 0; j < nsel; ++j) {
          double a = 0.0;
          for (int i = 0; i < I; ++i)
            a += down[r].at(l * E + ids[j], n, i) *
                 bf2f(hs[r][(size_t)j * I + i]);
          acc += (double)wts[j] * a;
        }
        for (int i = 0; i < Is; ++i)
          acc += shared[r].at(l, n, i) * bf2f(hsh[r][i]);
        ref[l][n] += acc;
      }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  struct In {
    const void *h, *hs, *w, *sw;
    const float *wts, *s, *ss;
    const int32_t *ids, *table;
  };
  std::vector<DevBufs> bufs = rank_bufs();
  std::vector<In> in(g_world);
  for (int r = 0; r < g_world; ++r) {
    DevBufs& b = bufs[r];
    in[r] = In{b.copy(hs[r]), b.copy(hsh[r]), down[r].upload_w(b),
               shared[r].upload_w(b), b.copy(wts), down[r].upload_s(b),
               shared[r].upload_s(b), b.copy(ids), b.copy(plan.table)};
  }
  auto out = run_layer_graph(
      N, layers,
      [&](int r, cudaStream_t st, const int32_t* dl, const int32_t* doff,
          uint16_t* dy) {
        const In& a = in[r];
        CK(jt_expert_down_all_reduce_layer(
            gid, r, st, a.h, a.wts, a.ids, a.w, a.s, a.hs, a.sw, a.ss, dl, doff,
            L, a.table, dy, N, nsel, I, E, Is, fp8 ? JT_F8E4M3 : JT_BF16, nwc,
            rpw, plan.num_ctas, plan.max_tasks));
      });
  for (size_t i = 0; i < layers.size(); ++i) {
    char buf[240];
    std::snprintf(buf, sizeof(buf),
                  "expert_down_all_reduce_layer N=%d %dx[%d] of E=%d + "
                  "shared[%d] %s L=%d layer=%d (-> %d) nwc=%d rpw=%d graph "
                  "(gid %d)",
                  N, nsel, I, E, Is, fp8 ? "fp8" : "bf16", L, layers[i],
                  layer_of(layers[i], L), nwc, rpw, gid);
    check_output(out[i], ref[layer_of(layers[i], L)], ref_ranks, buf);
  }
}

// ---------------- merge top-k ----------------

void test_merge(int gid, int m, int k, int blocks, int threads, int iters,
                unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> sc(g_world);
  std::vector<std::vector<int32_t>> ix(g_world);
  struct Cand {
    float s;
    int32_t i;
  };
  std::vector<Cand> all;
  for (int r = 0; r < g_world; ++r) {
    std::vector<Cand> c(m);
    for (int j = 0; j < m; ++j) {
      // few distinct scores: many ties, broken by the global index
      c[j].s = (float)(int)(rng() % 97) * 0.25f - 3.f;
      c[j].i = r * 100000 + j * 3 + (int)(rng() % 3);
      if (j % 17 == 5) c[j].s = -INFINITY;
    }
    std::sort(c.begin(), c.end(), [](const Cand& a, const Cand& b) {
      return a.s > b.s || (a.s == b.s && a.i < b.i);
    });
    for (const Cand& x : c) {
      sc[r].push_back(x.s);
      ix[r].push_back(x.i);
      all.push_back(x);
    }
  }
  std::sort(all.begin(), all.end(), [](const Cand& a, const Cand& b) {
    return a.s > b.s || (a.s == b.s && a.i < b.i);
  });
  std::vector<std::vector<float>> os(g_world);
  std::vector<std::vector<int32_t>> oi(g_world);
  run_ranks([&](int r) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float* ds = dev_copy(sc[r]);
    int32_t* di = dev_copy(ix[r]);
    float* dos = nullptr;
    int32_t* doi = nullptr;
    CK(cudaMalloc(&dos, k * 4));
    CK(cudaMalloc(&doi, k * 4));
    for (int it = 0; it < iters; ++it) {
      CK(cudaMemsetAsync(dos, 0xff, k * 4, st));
      CK(cudaMemsetAsync(doi, 0xff, k * 4, st));
      CK(jt_merge_topk(gid, r, st, ds, di, dos, doi, m, k, blocks, threads));
    }
    CK(cudaStreamSynchronize(st));
    os[r] = host_copy(dos, k);
    oi[r] = host_copy(doi, k);
    CK(cudaFree(ds));
    CK(cudaFree(di));
    CK(cudaFree(dos));
    CK(cudaFree(doi));
    CK(cudaStreamDestroy(st));
  });
  bool same = true, exact = true;
  for (int r = 0; r < g_world; ++r) {
    same &= std::memcmp(os[r].data(), os[0].data(), k * 4) == 0 &&
            oi[r] == oi[0];
    for (int j = 0; j < k; ++j)
      exact &= oi[r][j] == all[j].i &&
               std::memcmp(&os[r][j], &all[j].s, 4) == 0;
  }
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "merge_topk m=%d k=%d grid=%dx%d iters=%d: bit-identical=%d "
                "equals-ref=%d",
                m, k, blocks, threads, iters, (int)same, (int)exact);
  report(same && exact, buf);
}

// ---------------- interleaved ops (parity / epoch reuse) ----------------

void test_interleaved(int gid, int rounds) {
  // alternate all-reduce sizes/algos and merges on the same group without any
  // host synchronisation in between; check the final values of each.
  const int n1 = 7168, n2 = 1000, k = 128;
  std::vector<std::vector<uint16_t>> a(g_world), b(g_world);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int r = 0; r < g_world; ++r) {
    for (int i = 0; i < n1; ++i) a[r].push_back(f2bf(nd(rng)));
    for (int i = 0; i < n2; ++i) b[r].push_back(f2bf(nd(rng)));
  }
  std::vector<uint16_t> ra(n1), rb(n2);
  for (int i = 0; i < n1; ++i) {
    float s = 0;
    for (int r = 0; r < g_world; ++r) s += bf2f(a[r][i]);
    ra[i] = f2bf(s);
  }
  for (int i = 0; i < n2; ++i) {
    float s = 0;
    for (int r = 0; r < g_world; ++r) s += bf2f(b[r][i]);
    rb[i] = f2bf(s);
  }
  std::vector<int> bad(g_world, 0);
  run_ranks([&](int r) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    uint16_t* da = dev_copy(a[r]);
    uint16_t* db = dev_copy(b[r]);
    uint16_t *ya = nullptr, *yb = nullptr;
    CK(cudaMalloc(&ya, n1 * 2 * 2));
    CK(cudaMalloc(&yb, n2 * 2 * 2));
    std::vector<float> s(k);
    std::vector<int32_t> ii(k);
    for (int j = 0; j < k; ++j) {
      s[j] = (float)(k - j);
      ii[j] = r * k + j;
    }
    float* ds = dev_copy(s);
    int32_t* di = dev_copy(ii);
    float* os = nullptr;
    int32_t* oi = nullptr;
    CK(cudaMalloc(&os, k * 4));
    CK(cudaMalloc(&oi, k * 4));
    for (int it = 0; it < rounds; ++it) {
      CK(jt_all_reduce(gid, r, st, da, ya + (it & 1) * n1, n1, JT_BF16,
                       JT_AR_ONESHOT, 4, 256));
      CK(jt_merge_topk(gid, r, st, ds, di, os, oi, k, k, 1, 256));
      CK(jt_all_reduce(gid, r, st, db, yb + (it & 1) * n2, n2, JT_BF16,
                       (it % 3 == 0) ? JT_AR_TWOSHOT : JT_AR_ONESHOT, 2 + it % 3,
                       128));
    }
    CK(cudaStreamSynchronize(st));
    auto ha = host_copy(ya, 2 * n1);
    auto hb = host_copy(yb, 2 * n2);
    for (int h = 0; h < 2; ++h) {
      if (std::memcmp(ha.data() + h * n1, ra.data(), n1 * 2) != 0) bad[r] = 1;
      if (std::memcmp(hb.data() + h * n2, rb.data(), n2 * 2) != 0) bad[r] = 1;
    }
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(ya));
    CK(cudaFree(yb));
    CK(cudaFree(ds));
    CK(cudaFree(di));
    CK(cudaFree(os));
    CK(cudaFree(oi));
    CK(cudaStreamDestroy(st));
  });
  bool ok = true;
  for (int v : bad) ok &= v == 0;
  report(ok, "interleaved all_reduce/merge_topk, " + std::to_string(rounds) +
                 " rounds, no host sync: all values exact");
}

// ---------------- exact top-k (one GPU) ----------------

enum ScoreKind { kNormal, kTies, kZeros, kMasked, kNarrow, kMaskedLate, kMaskedNaN };

std::vector<float> make_scores(int T, int n, ScoreKind kind, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  const float picks[5] = {0.f, -0.f, 1.f, -1.f, INFINITY};
  std::vector<float> x((size_t)T * n);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < n; ++i) {
      float v = nd(rng);
      switch (kind) {
        case kNormal: break;
        case kTies: v = std::round(v * 2.f) / 2.f; break;  // few distinct scores
        case kZeros: v = i < n / 3 ? picks[rng() % 5] : -INFINITY; break;
        case kMasked: v = i < 100 ? v : -INFINITY; break;  // short context
        case kNarrow: v = 1.f + 0.2f * ud(rng); break;     // one level-0 bucket
        // short contexts the short form must not take: a score past the
        // mask at the row's end, a NaN with the sign bit before it
        case kMaskedLate: v = i < 100 || i == n - 1 ? v : -INFINITY; break;
        case kMaskedNaN: v = i == 5 ? -NAN : i < 100 ? v : -INFINITY; break;
      }
      x[(size_t)t * n + i] = v;
    }
  }
  return x;
}

// lax.top_k's order: total order of the bits (-0.0 < +0.0), then lower index.
uint32_t order_key(float f, bool canonical_zero) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (canonical_zero && u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Reference rows: indices and value bits of the top k, in the kernel's order
// (with JT_TOPK_EMPTY_AS_MINUS_ONE, index -1 where the score is not above -inf).
void select_reference(const std::vector<float>& x, int T, int n, int k, int mode,
                      std::vector<int32_t>* idx, std::vector<uint32_t>* val) {
  const bool canon = (mode & JT_TOPK_CANONICAL_ZERO) != 0;
  idx->assign((size_t)T * k, 0);
  val->assign((size_t)T * k, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> o(n);
    for (int i = 0; i < n; ++i) o[i] = i;
    const float* r = &x[(size_t)t * n];
    std::sort(o.begin(), o.end(), [&](int32_t a, int32_t b) {
      const uint32_t ka = order_key(r[a], canon), kb = order_key(r[b], canon);
      return ka > kb || (ka == kb && a < b);
    });
    o.resize(k);
    if (!(mode & JT_TOPK_SORTED)) std::sort(o.begin(), o.end());
    for (int j = 0; j < k; ++j) {
      const uint32_t key = order_key(r[o[j]], canon);
      const bool empty = (mode & JT_TOPK_EMPTY_AS_MINUS_ONE) && !(r[o[j]] > -INFINITY);
      (*idx)[(size_t)t * k + j] = empty ? -1 : o[j];
      (*val)[(size_t)t * k + j] = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    }
  }
}

// "cluster C=16" or "grid ctas/row=132": the kernel jt_topk_select launches
// for this shape and `ctas` (see engine.h).
std::string select_variant(int T, int n, int k, int mode, int ctas) {
  const int c = jt_topk_select_cluster(0, T, n, k, mode, ctas);
  if (c < 0) return "unsupported";
  return c > 0 ? "cluster C=" + std::to_string(c)
               : "grid ctas/row=" + std::to_string(jt_topk_select_ctas(0, T, n, k, mode, ctas));
}

// Device 0; for each `ctas` (see engine.h) in turn: `iters` launches back to
// back, another call in between (other shape, grid kernel with 6 CTAs per row,
// sorted: the scratch and the barrier words must come back clean after every
// call), outputs poisoned first. Kernels that do not support the shape are
// skipped.
void test_select(int T, int n, int k, int mode, ScoreKind kind, int iters,
                 unsigned seed, const std::vector<int>& variants) {
  CK(cudaSetDevice(0));
  const std::vector<float> x = make_scores(T, n, kind, seed);
  std::vector<int32_t> ri, ori;
  std::vector<uint32_t> rv, orv;
  select_reference(x, T, n, k, mode, &ri, &rv);
  const std::vector<float> other = make_scores(2, 4099, kTies, seed + 1);
  select_reference(other, 2, 4099, 333, JT_TOPK_SORTED, &ori, &orv);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  float* dx = dev_copy(x);
  float* dother = dev_copy(other);
  int32_t* di = nullptr;
  float* dv = nullptr;
  CK(cudaMalloc(&di, (size_t)T * k * 4));
  CK(cudaMalloc(&dv, (size_t)T * k * 4));
  int32_t* oi = nullptr;
  float* ov = nullptr;
  CK(cudaMalloc(&oi, 2 * 333 * 4));
  CK(cudaMalloc(&ov, 2 * 333 * 4));
  for (int ctas : variants) {
    if (jt_topk_select_ctas(0, T, n, k, mode, ctas) < 1) {
      std::printf("SKIP topk_select T=%d n=%d k=%d ctas=%d: shape or cluster not supported\n",
                  T, n, k, ctas);
      continue;
    }
    for (int it = 0; it < iters; ++it) {
      CK(cudaMemsetAsync(di, 0xff, (size_t)T * k * 4, st));
      CK(cudaMemsetAsync(dv, 0xff, (size_t)T * k * 4, st));
      CK(jt_topk_select(0, st, dx, di, dv, T, n, k, mode, ctas));
      CK(jt_topk_select(0, st, dother, oi, ov, 2, 4099, 333, JT_TOPK_SORTED, 6));
    }
    CK(cudaMemsetAsync(di, 0xff, (size_t)T * k * 4, st));
    CK(jt_topk_select(0, st, dx, di, dv, T, n, k, mode, ctas));
    CK(cudaStreamSynchronize(st));
    const auto hi = host_copy(di, (size_t)T * k);
    const auto hv = host_copy(reinterpret_cast<uint32_t*>(dv), (size_t)T * k);
    int bad = 0;
    for (size_t j = 0; j < hi.size(); ++j) bad += hi[j] != ri[j] || hv[j] != rv[j];
    if (iters > 0) {  // the call in between, too
      const auto oh = host_copy(oi, 2 * 333);
      const auto ovh = host_copy(reinterpret_cast<uint32_t*>(ov), 2 * 333);
      for (size_t j = 0; j < oh.size(); ++j) bad += oh[j] != ori[j] || ovh[j] != orv[j];
    }
    static const char* kinds[] = {"normal", "ties", "zeros/-inf", "masked", "narrow", "masked+late",
                                  "masked+nan"};
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "topk_select T=%d n=%d k=%d %s%s%s %s %s iters=%d: mismatches=%d",
                  T, n, k, (mode & JT_TOPK_SORTED) ? "sorted" : "by-index",
                  (mode & JT_TOPK_CANONICAL_ZERO) ? "+canonical-zero" : "",
                  (mode & JT_TOPK_EMPTY_AS_MINUS_ONE) ? "+empty-as-minus-one" : "",
                  kinds[kind], select_variant(T, n, k, mode, ctas).c_str(), iters,
                  bad);
    report(bad == 0, buf);
  }
  CK(cudaFree(dx));
  CK(cudaFree(dother));
  CK(cudaFree(di));
  CK(cudaFree(dv));
  CK(cudaFree(oi));
  CK(cudaFree(ov));
  CK(cudaStreamDestroy(st));
}

// The grid kernel's default CTAs per row for T rows (make_plan's).
int grid_ctas(int T) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return std::max(1, sms / T);
}

// Every case on the grid kernel (`ctas` CTAs per row, 0: its default) and on
// clusters of 16, 8 and 1 where the row fits.
void run_select_tests(bool small, int iters) {
  const int S = JT_TOPK_SORTED, E = JT_TOPK_EMPTY_AS_MINUS_ONE;
  auto test = [&](int T, int n, int k, int mode, ScoreKind kind, unsigned seed,
                  int ctas = 0) {
    test_select(T, n, k, mode, kind, iters, seed,
                {ctas > 0 ? ctas : grid_ctas(T), -16, -8, -1});
  };
  // few CTAs: these also run under compute-sanitizer
  test(1, 100, 100, S, kZeros, 31);
  test(3, 3001, 1000, S, kMasked, 32, 4);
  test(1, 5000, 2048, 0, kZeros, 33, 8);
  test(3, 3001, 1000, S | E, kMasked, 36, 4);
  test(1, 5000, 2048, E, kZeros, 37, 8);
  if (small) return;
  test(1, 4096, 2048, E, kMasked, 56);             // the indexer's decode call
  test(2, 4096, 2048, E, kMaskedLate, 57);         // ... not its short form
  test(2, 4096, 2048, 0, kMaskedNaN, 58);
  test(1, 2048, 2048, E, kNormal, 59);             // n == k by position: the short form
  test(3, 3001, 1000, S, kMasked, 34);
  test(1, 5000, 2048, 0, kZeros, 35);
  test(1, 4096, 2048, S, kNormal, 41);
  test(1, 4096, 2048, S, kTies, 42);
  test(1, 2048, 2048, S, kNormal, 43);             // n == k
  test(2, 32768, 2048, S, kTies, 44);
  test(4, 32771, 2048, 0, kNormal, 45);            // n odd
  test(1, 131072, 2048, S, kNormal, 46);
  test(1, 131072, 2048, S, kMasked, 47);
  test(1, 131072, 2048, S | JT_TOPK_CANONICAL_ZERO, kZeros, 48);
  test(2, 163840, 2048, S, kNarrow, 49);
  test(8, 163840, 2048, S, kTies, 50);
  test(8, 9000, 8192, S, kNormal, 51);             // ranks: one part per slot
  test(3, 70001, 7, 0, kTies, 52);
  test(1, 131072, 2048, S, kTies, 53, 8);          // fewer, larger chunks
  test(2, 163840, 2048, 0, kNormal, 54, 11);       // chunks near kMaxChunk
  test(1, 196608, 2048, 0, kTies, 55);             // 16 full cluster chunks
}


// ---------------- benchmarks (CUDA graphs, no XLA) ----------------

// Ping-pong through peer memory: rank 0 writes flag i into rank 1's buffer,
// rank 1 answers with i into rank 0's; half the time per exchange is the
// one-way latency of a flag over NVLink.
__global__ void pingpong_kernel(volatile unsigned* mine, volatile unsigned* peer,
                                int rank, int rounds) {
  for (int i = 1; i <= rounds; ++i) {
    if (rank == 0) {
      *peer = (unsigned)i;
      while (*mine != (unsigned)i) {
      }
    } else {
      while (*mine != (unsigned)i) {
      }
      *peer = (unsigned)i;
    }
  }
}

void bench_pingpong() {
  if (g_world < 2) return;
  unsigned* buf[2] = {nullptr, nullptr};
  for (int r = 0; r < 2; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMalloc(&buf[r], 256));
    CK(cudaMemset(buf[r], 0, 256));
    CK(cudaDeviceSynchronize());
  }
  const int rounds = 10000;
  std::vector<float> ms(2);
  Barrier bar(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r)
    th.emplace_back([&, r] {
      CK(cudaSetDevice(r));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      bar.wait();
      CK(cudaEventRecord(a));
      pingpong_kernel<<<1, 1>>>(buf[r], buf[1 - r], r, rounds);
      CK(cudaGetLastError());
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaEventElapsedTime(&ms[r], a, b));
    });
  for (auto& t : th) t.join();
  std::printf("BENCH nvlink_pingpong round_trip_us=%.3f one_way_us=%.3f\n",
              ms[0] * 1e3 / rounds, ms[0] * 1e3 / rounds / 2);
  for (int r = 0; r < 2; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaFree(buf[r]));
  }
}

// Times `reps` launches of `launch` captured in one CUDA graph per rank,
// replayed concurrently on all ranks; prints the median per-launch time.
float bench_graph(const char* name,
                 const std::function<void(int, cudaStream_t)>& launch,
                 int reps) {
  std::vector<std::vector<float>> per(g_world);
  Barrier bar(g_world);
  run_ranks([&](int r) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < reps; ++i) launch(r, st);
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int trial = 0; trial < 7; ++trial) {
      bar.wait();
      CK(cudaEventRecord(a, st));
      CK(cudaGraphLaunch(exec, st));
      CK(cudaEventRecord(b, st));
      CK(cudaStreamSynchronize(st));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      if (trial > 0) per[r].push_back(ms * 1e3f / reps);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    CK(cudaStreamDestroy(st));
  });
  std::sort(per[0].begin(), per[0].end());
  const float med = per[0][per[0].size() / 2];
  std::printf("BENCH %s graph_us_per_call=%.3f (rank0 median of %zu)\n", name,
              med, per[0].size());
  return med;
}

// One select per rank on its own GPU (the scores stay in L2, as after the
// indexer); bench_graph prints rank 0's median time per launch.
void bench_select(int T, int n, int k, int mode, int ctas = 0, ScoreKind kind = kNormal) {
  const std::vector<float> x = make_scores(T, n, kind, 7);
  std::vector<float*> dx(g_world), dv(g_world);
  std::vector<int32_t*> di(g_world);
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    dx[r] = dev_copy(x);
    CK(cudaMalloc(&di[r], (size_t)T * k * 4));
    CK(cudaMalloc(&dv[r], (size_t)T * k * 4));
  }
  char name[160];
  std::snprintf(name, sizeof(name), "topk_select T=%d n=%d k=%d %s%s %s", T, n, k,
                (mode & JT_TOPK_SORTED) ? "sorted" : "by-index", kind == kMasked ? " masked" : "",
                select_variant(T, n, k, mode, ctas).c_str());
  bench_graph(
      name,
      [&](int r, cudaStream_t st) {
        CK(jt_topk_select(r, st, dx[r], di[r], dv[r], T, n, k, mode, ctas));
      },
      100);
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaFree(dx[r]));
    CK(cudaFree(di[r]));
    CK(cudaFree(dv[r]));
  }
}

void run_select_bench() {
  // the indexer's decode call (by position, -1 where masked) at a long and a
  // short context (the short form)
  for (ScoreKind kind : {kNormal, kMasked})
    bench_select(1, 4096, 2048, JT_TOPK_EMPTY_AS_MINUS_ONE, 0, kind);
  // the grid kernel (its default CTAs per row), clusters of 1, 8 and 16 (the
  // default picks one of them where the row fits)
  for (int n : {4096, 5120, 6144, 8192, 12288, 32768, 49152, 131072, 163840})
    for (int mode : {JT_TOPK_SORTED, 0})
      for (int ctas : {grid_ctas(1), -1, -8, -16})
        if (jt_topk_select_ctas(0, 1, n, 2048, mode, ctas) > 0)
          bench_select(1, n, 2048, mode, ctas);
  for (int T : {2, 4, 8})
    for (int ctas : {grid_ctas(T), -16}) bench_select(T, 131072, 2048, JT_TOPK_SORTED, ctas);
  // CTAs per row: fewer arrivals at each barrier against less work per CTA
  for (int n : {32768, 131072})
    for (int ctas : {8, 16, 32, 64})
      for (int mode : {JT_TOPK_SORTED, 0}) bench_select(1, n, 2048, mode, ctas);
}

int rpw_for(int K, bool fp8) {
  int chunks = K / (fp8 ? 16 : 8);
  int per_lane = std::max(1, (chunks + 31) / 32);
  int rpw = 1;
  while (rpw * std::min(per_lane, 8) < 8 && rpw < 8) rpw *= 2;
  return rpw;
}

// GEMV (+ all-reduce) per call, weights rotating over `sets` buffers so that
// they come from HBM, not L2. Returns the local GEMV's time per call (us).
float bench_gemv(int gid, int N, int K, bool fp8, int nwc, int sets) {
  const int rpw = rpw_for(K, fp8);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  const size_t wbytes = (size_t)N * K * (fp8 ? 1 : 2);
  std::vector<std::vector<void*>> ws(g_world);
  std::vector<void*> xs(g_world), ys(g_world), ts(g_world), ss(g_world);
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    for (int i = 0; i < sets; ++i) {
      void* p = nullptr;
      CK(cudaMalloc(&p, wbytes));
      CK(cudaMemset(p, 0x11 + i, wbytes));  // finite values in bf16 and e4m3
      ws[r].push_back(p);
    }
    CK(cudaMalloc(&xs[r], K * 2));
    CK(cudaMemset(xs[r], 0x3c, K * 2));
    CK(cudaMalloc(&ys[r], N * 2));
    ts[r] = dev_copy(plan.table);
    std::vector<float> sc((size_t)((N + 127) / 128) * ((K + 127) / 128), 1.f);
    ss[r] = dev_copy(sc);
  }
  float local_us = 0.f;
  for (int mode = 0; mode < 2; ++mode) {
    if (mode == 1 && gid < 0) continue;
    const int g = mode == 0 ? -1 : gid;
    char name[200];
    std::snprintf(name, sizeof(name),
                  "gemv%s N=%d K=%d %s nwc=%d rpw=%d ctas=%d tasks<=%d",
                  mode ? "+all_reduce" : " (local)", N, K, fp8 ? "fp8" : "bf16",
                  nwc, rpw, plan.num_ctas, plan.max_tasks);
    std::vector<int> cnt(g_world, 0);  // one entry per rank thread
    const float us = bench_graph(
        name,
        [&](int r, cudaStream_t st) {
          CK(jt_gemv_all_reduce(g, r, st, xs[r], ws[r][cnt[r]++ % sets],
                                fp8 ? (const float*)ss[r] : nullptr,
                                (const int32_t*)ts[r], ys[r], N, K,
                                fp8 ? JT_F8E4M3 : JT_BF16, nwc, rpw,
                                plan.num_ctas, plan.max_tasks));
        },
        64);
    if (mode == 0) local_us = us;
    std::printf("BENCH   weight bytes per call %.1f MB\n", wbytes / 1e6);
  }
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    for (void* p : ws[r]) CK(cudaFree(p));
    CK(cudaFree(xs[r]));
    CK(cudaFree(ys[r]));
    CK(cudaFree(ts[r]));
    CK(cudaFree(ss[r]));
  }
  return local_us;
}

// MoE down + shared expert (+ all-reduce) per call: `nsel` of E stacked
// experts [N, I] plus a shared [N, Is]. The expert ids rotate over `sets`
// device arrays of distinct experts (and the shared weight over `sets`
// copies), so the weights stream from HBM; prints the ratio to `gemv_us`, the
// plain GEMV of the same bytes (K = nsel * I + Is).
void bench_expert_down(int gid, int N, int nsel, int I, int E, int Is, bool fp8,
                       int nwc, int sets, float gemv_us) {
  const int K = nsel * I + Is;
  const int rpw = rpw_for(K, fp8);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Plan plan = make_plan(N, nwc * rpw, sms);
  const size_t es = fp8 ? 1 : 2;
  const size_t dbytes = (size_t)E * N * I * es, sbytes = (size_t)N * Is * es;
  const int NB = (N + 127) / 128;
  std::vector<std::vector<void*>> shw(g_world), idv(g_world);
  std::vector<void*> dw(g_world), ds(g_world), sss(g_world), hs(g_world),
      hss(g_world), wts(g_world), ys(g_world), ts(g_world);
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaMalloc(&dw[r], dbytes));
    CK(cudaMemset(dw[r], 0x11, dbytes));  // finite values in bf16 and e4m3
    ds[r] = dev_copy(std::vector<float>((size_t)E * NB * ((I + 127) / 128), 1.f));
    sss[r] = dev_copy(std::vector<float>((size_t)NB * ((Is + 127) / 128), 1.f));
    for (int i = 0; i < sets; ++i) {
      void* p = nullptr;
      CK(cudaMalloc(&p, sbytes));
      CK(cudaMemset(p, 0x12 + i, sbytes));
      shw[r].push_back(p);
      std::vector<int32_t> ids(nsel);
      for (int j = 0; j < nsel; ++j) ids[j] = (i * nsel + j) % E;
      idv[r].push_back(dev_copy(ids));
    }
    CK(cudaMalloc(&hs[r], (size_t)nsel * I * 2));
    CK(cudaMemset(hs[r], 0x3c, (size_t)nsel * I * 2));
    CK(cudaMalloc(&hss[r], Is * 2));
    CK(cudaMemset(hss[r], 0x3c, Is * 2));
    wts[r] = dev_copy(std::vector<float>(nsel, 0.125f));
    CK(cudaMalloc(&ys[r], N * 2));
    ts[r] = dev_copy(plan.table);
  }
  for (int mode = 0; mode < 2; ++mode) {
    if (mode == 1 && gid < 0) continue;
    const int g = mode == 0 ? -1 : gid;
    char name[200];
    std::snprintf(name, sizeof(name),
                  "expert_down%s N=%d %dx[%d] of E=%d + shared[%d] %s nwc=%d "
                  "rpw=%d ctas=%d tasks<=%d",
                  mode ? "+all_reduce" : " (local)", N, nsel, I, E, Is,
                  fp8 ? "fp8" : "bf16", nwc, rpw, plan.num_ctas,
                  plan.max_tasks);
    std::vector<int> cnt(g_world, 0);  // one entry per rank thread
    const float us = bench_graph(
        name,
        [&](int r, cudaStream_t st) {
          const int i = cnt[r]++ % sets;
          CK(jt_expert_down_all_reduce(
              g, r, st, hs[r], (const float*)wts[r], (const int32_t*)idv[r][i],
              dw[r], fp8 ? (const float*)ds[r] : nullptr, hss[r], shw[r][i],
              fp8 ? (const float*)sss[r] : nullptr, (const int32_t*)ts[r],
              ys[r], N, nsel, I, E, Is, fp8 ? JT_F8E4M3 : JT_BF16, nwc, rpw,
              plan.num_ctas, plan.max_tasks));
        },
        64);
    std::printf("BENCH   weight bytes per call %.1f MB, x%.3f the plain GEMV "
                "of the same bytes (%.3f us)\n",
                (double)N * K * es / 1e6, us / gemv_us, gemv_us);
  }
  for (int r = 0; r < g_world; ++r) {
    CK(cudaSetDevice(r));
    for (void* p : shw[r]) CK(cudaFree(p));
    for (void* p : idv[r]) CK(cudaFree(p));
    for (auto* v : {&dw, &ds, &sss, &hs, &hss, &wts, &ys, &ts})
      CK(cudaFree((*v)[r]));
  }
}

void run_bench(int gid) {
  bench_pingpong();
  struct GS {
    int N, K;
    bool fp8;
  };
  const GS shapes[] = {{7168, 2048, false}, {7168, 2048, true},
                       {7168, 256, false},  {7168, 2304, false},
                       {7168, 2304, true}};
  for (const GS& s : shapes)
    for (int nwc : {8, 16}) bench_gemv(gid, s.N, s.K, s.fp8, nwc, 16);
  // MoE down + shared expert at the dsv32-tp8-shard shapes: 8 of 256 routed
  // experts [7168, 256] + the shared [7168, 256], against the plain GEMV of
  // the same bytes (K = 2304)
  for (bool fp8 : {true, false}) {
    for (int nwc : {8, 16}) {
      const float gemv_us = bench_gemv(-1, 7168, 9 * 256, fp8, nwc, 16);
      bench_expert_down(gid, 7168, 8, 256, 256, 256, fp8, nwc, 16, gemv_us);
    }
  }
  {
    const int m = 2048;
    std::vector<float*> sc(g_world), os(g_world);
    std::vector<int32_t*> ix(g_world), oi(g_world);
    for (int r = 0; r < g_world; ++r) {
      CK(cudaSetDevice(r));
      std::vector<float> hs(m);
      std::vector<int32_t> hi(m);
      for (int j = 0; j < m; ++j) {
        hs[j] = (float)(m - j);
        hi[j] = r * m + j;
      }
      sc[r] = dev_copy(hs);
      ix[r] = dev_copy(hi);
      CK(cudaMalloc(&os[r], m * 4));
      CK(cudaMalloc(&oi[r], m * 4));
    }
    for (int blocks : {2, 4, 8, 16}) {
      char name[100];
      std::snprintf(name, sizeof(name), "merge_topk m=k=%d grid=%dx512", m,
                    blocks);
      bench_graph(
          name,
          [&](int r, cudaStream_t st) {
            CK(jt_merge_topk(gid, r, st, sc[r], ix[r], os[r], oi[r], m, m,
                             blocks, 512));
          },
          100);
    }
    for (int r = 0; r < g_world; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaFree(sc[r]));
      CK(cudaFree(ix[r]));
      CK(cudaFree(os[r]));
      CK(cudaFree(oi[r]));
    }
  }
  // all-reduce, bf16, 14/28/56 KiB and larger, a few launch shapes
  const int64_t sizes[] = {7168, 14336, 28672, 131072, 524288};
  for (int64_t n : sizes) {
    for (int algo : {JT_AR_ONESHOT, JT_AR_TWOSHOT}) {
      for (int blocks : {2, 4, 8, 16, 32}) {
        const int threads = 256;
        std::vector<void*> xs(g_world), ys(g_world);
        for (int r = 0; r < g_world; ++r) {
          CK(cudaSetDevice(r));
          CK(cudaMalloc(&xs[r], n * 2));
          CK(cudaMemset(xs[r], 0x3c, n * 2));
          CK(cudaMalloc(&ys[r], n * 2));
        }
        char name[128];
        std::snprintf(name, sizeof(name),
                      "all_reduce bf16 bytes=%lld %s grid=%dx%d",
                      (long long)n * 2, algo ? "two-shot" : "one-shot", blocks,
                      threads);
        bench_graph(
            name,
            [&](int r, cudaStream_t st) {
              CK(jt_all_reduce(gid, r, st, xs[r], ys[r], n, JT_BF16, algo,
                               blocks, threads));
            },
            200);
        for (int r = 0; r < g_world; ++r) {
          CK(cudaSetDevice(r));
          CK(cudaFree(xs[r]));
          CK(cudaFree(ys[r]));
        }
      }
    }
  }
}

// Only rank 0 calls: its kernel must give up after the group's timeout and
// turn into a CUDA error (not a hang), with the status record filled in.
int timeout_test() {
  const int devs[2] = {0, 1};
  char err[256] = {0};
  if (jt_device_count() < 2) {
    std::printf("SKIP timeout test needs 2 GPUs\n");
    return 0;
  }
  for (int d : devs) jt_prepare_device(d, err, sizeof(err));
  int gid = jt_group_create(devs, 2, 1 << 16, 300, err, sizeof(err));
  if (gid < 0) {
    std::printf("FAIL group_create: %s\n", err);
    return 1;
  }
  CK(cudaSetDevice(0));
  std::vector<uint16_t> h(1024, 0x3f80);
  uint16_t* dx = dev_copy(h);
  uint16_t* dy = nullptr;
  CK(cudaMalloc(&dy, 2048));
  auto t0 = std::chrono::steady_clock::now();
  cudaError_t e = jt_all_reduce(gid, 0, 0, dx, dy, 1024, JT_BF16, JT_AR_ONESHOT,
                                1, 128);
  cudaError_t s = cudaDeviceSynchronize();
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                   .count();
  JtStatus st;
  jt_group_status(gid, 0, &st);
  bool ok = e == cudaSuccess && s != cudaSuccess && st.code == 1 && st.src == 1 &&
            sec < 20.0;
  std::printf("%s timeout: launch=%s sync=%s after %.2f s, status code=%u "
              "rank=%u src=%u epoch=%u op=%llu\n",
              ok ? "PASS" : "FAIL", cudaGetErrorString(e), cudaGetErrorString(s),
              sec, st.code, st.rank, st.src, st.epoch,
              (unsigned long long)st.op);
  return ok ? 0 : 1;
}

}  // namespace

// The token ring on device 0: one launch captured in a CUDA graph, replayed
// for positions p0.. with the values rewritten in device memory between
// replays; each replay's slot holds the position as its key, the count and
// the values, and no other slot changes.
void test_token_ring(bool bench) {
  char err[256] = {0};
  int32_t* ring = jt_token_ring(0, err, sizeof(err));
  if (ring == nullptr) {
    report(false, std::string("token ring: ") + err);
    return;
  }
  CK(cudaSetDevice(0));
  int32_t* d = nullptr;  // pos, count, values[3], the next position
  CK(cudaMalloc(&d, 6 * sizeof(int32_t)));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  CK(jt_token_ring_write(st, 0, d, d + 2, 3, d + 1, d + 5));
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  bool ok = true;
  const int p0 = 2 * JT_RING_SLOTS - 3;  // the slots wrap around
  for (int i = 0; i < 5; ++i) {
    const int32_t p = p0 + i, h[5] = {p, 1 + i % 3, 100 + i, 200 + i, 300 + i};
    CK(cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaStreamSynchronize(st));
    const int32_t* slot = ring + (p % JT_RING_SLOTS) * JT_RING_SLOT_INTS;
    int32_t next = -1;
    CK(cudaMemcpy(&next, d + 5, sizeof(next), cudaMemcpyDeviceToHost));
    ok &= slot[0] == p && slot[1] == h[1] && slot[2] == h[2] && slot[3] == h[3] && slot[4] == h[4] &&
          next == p + h[1];
  }
  // a count of 0: nothing written, the next position is the key itself
  const int32_t p = p0 + 5, h[2] = {p, 0};
  CK(cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice));
  CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  int32_t next = -1;
  CK(cudaMemcpy(&next, d + 5, sizeof(next), cudaMemcpyDeviceToHost));
  ok &= next == p && ring[(p % JT_RING_SLOTS) * JT_RING_SLOT_INTS] == -1;
  int written = 0;
  for (int s = 0; s < JT_RING_SLOTS; ++s) written += ring[s * JT_RING_SLOT_INTS] != -1;
  ok &= written == 5;
  report(ok, "token ring: 5 steps through a CUDA graph, keys and values in their slots, the next positions; "
             "a count of 0 writes nothing");
  if (bench) {  // one write's time on the device, its graph replayed back to back
    const int n = 200;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const int32_t one[2] = {p0, 1};
    CK(cudaMemcpy(d, one, sizeof(one), cudaMemcpyHostToDevice));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < n; ++i) CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("token ring: %.2f us a write (%d graph launches back to back)\n", 1e3 * ms / n, n);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  CK(cudaFree(d));
}

int main(int argc, char** argv) {
  bool small = false, bench = false, select_only = false;
  int iters = 3, world = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--small") small = true;
    else if (a == "--bench") bench = true;
    else if (a == "--select-only") select_only = true;
    else if (a == "--timeout-test") return timeout_test();
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--world" && i + 1 < argc) world = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--small] [--bench] [--select-only] [--timeout-test] "
                   "[--iters N] [--world W]\n",
                   argv[0]);
      return 2;
    }
  }
  int ndev = jt_device_count();
  if (ndev < 1) {
    std::printf("SKIP no CUDA device\n");
    return 0;
  }
  g_world = world > 0 ? std::min(world, ndev) : std::min(ndev, JT_MAX_WORLD);
  std::vector<int> devs(g_world);
  for (int r = 0; r < g_world; ++r) devs[r] = r;
  char err[256] = {0};
  for (int r = 0; r < g_world; ++r) {
    if (jt_prepare_device(r, err, sizeof(err)) != 0) {
      std::printf("FAIL prepare: %s\n", err);
      return 1;
    }
  }
  for (int r = 0; r < g_world; ++r) {
    if (jt_topk_prepare(r, 20000, err, sizeof(err)) != 0) {
      std::printf("FAIL topk prepare: %s\n", err);
      return 1;
    }
  }
  if (select_only) {  // the one-GPU tests alone (top-k, token ring): no group needed
    run_select_tests(small, iters);
    test_token_ring(bench);
    if (bench) run_select_bench();
    std::printf("%s: %d failure(s)\n", g_fail ? "FAILED" : "OK", g_fail);
    return g_fail ? 1 : 0;
  }
  int gid = jt_group_create(devs.data(), g_world, 1 << 20, 20000, err,
                            sizeof(err));
  if (gid < 0) {
    std::printf("FAIL group_create: %s\n", err);
    return 1;
  }
  std::printf("world=%d gid=%d payload_cap=%lld\n", g_world, gid,
              (long long)jt_group_payload_cap(gid));

  std::vector<ArCase> ar;
  if (small) {
    ar = {{7, JT_BF16, JT_AR_ONESHOT, 1, 64},
          {1000, JT_BF16, JT_AR_ONESHOT, 2, 64},
          {1000, JT_BF16, JT_AR_TWOSHOT, 2, 64},
          {333, JT_F32, JT_AR_TWOSHOT, 1, 128}};
  } else {
    ar = {{7, JT_BF16, JT_AR_ONESHOT, 1, 64},
          {7168, JT_BF16, JT_AR_ONESHOT, 4, 256},
          {14336, JT_BF16, JT_AR_ONESHOT, 8, 256},
          {28672, JT_BF16, JT_AR_ONESHOT, 16, 256},
          {28672, JT_BF16, JT_AR_TWOSHOT, 16, 256},
          {300001, JT_BF16, JT_AR_TWOSHOT, 32, 512},
          {300001, JT_BF16, JT_AR_ONESHOT, 32, 512},
          {4097, JT_F32, JT_AR_ONESHOT, 4, 128},
          {4097, JT_F32, JT_AR_TWOSHOT, 4, 128}};
  }
  test_all_reduce(gid, ar, iters, 1234);
  if (small) {
    test_gemv(gid, 200, 256, false, 4, 2, iters, 11);
    test_gemv(gid, 130, 128, true, 4, 2, iters, 12);
    test_gemv(-1, 200, 256, false, 4, 1, iters, 13);
    test_expert_down(gid, 200, 3, 32, 5, 48, false, 4, 2, iters, 17);
    test_expert_down(gid, 130, 2, 32, 3, 48, true, 4, 2, iters, 18, true);
    test_expert_down(-1, 200, 2, 16, 4, 8, false, 4, 1, iters, 19);
    test_gemv_layers(gid, 200, 256, false, 4, 2, 3, 41);
    test_gemv_layers(gid, 130, 128, true, 4, 2, 3, 42);
    test_gemv_layers(-1, 200, 256, false, 4, 1, 2, 43);
    test_expert_down_layers(gid, 200, 3, 32, 5, 48, false, 4, 2, 3, 44);
    test_expert_down_layers(gid, 130, 2, 32, 3, 48, true, 4, 2, 2, 45);
    test_merge(gid, 100, 100, 2, 64, iters, 21);
    test_merge(gid, 60, 60 * g_world - 7, 1, 64, iters, 23);
    test_interleaved(gid, 4);
  } else {
    test_gemv(gid, 7168, 2048, false, 16, 1, iters, 11);
    test_gemv(gid, 7168, 2048, true, 16, 2, iters, 12);
    test_gemv(gid, 7168, 256, false, 8, 8, iters, 13);
    test_gemv(gid, 1001, 2304, false, 8, 1, iters, 14);
    test_gemv(gid, 1001, 512, true, 4, 4, iters, 15);
    test_gemv(-1, 7168, 2048, false, 16, 1, iters, 16);
    test_expert_down(gid, 7168, 8, 256, 16, 256, true, 16, 2, iters, 31);
    test_expert_down(gid, 7168, 8, 256, 16, 256, false, 16, 1, iters, 32);
    test_expert_down(gid, 7168, 8, 128, 12, 128, true, 16, 4, iters, 33, true);
    test_expert_down(gid, 1001, 3, 64, 5, 128, false, 8, 2, iters, 34);
    test_expert_down(-1, 7168, 8, 256, 16, 256, true, 16, 2, iters, 35);
    test_gemv_layers(gid, 7168, 2048, true, 16, 2, 3, 51);
    test_gemv_layers(gid, 1001, 512, false, 4, 4, 4, 52);
    test_gemv_layers(-1, 7168, 2048, false, 16, 1, 2, 53);
    test_expert_down_layers(gid, 7168, 8, 256, 8, 256, true, 16, 2, 2, 54);
    test_expert_down_layers(gid, 1001, 3, 64, 5, 128, false, 8, 2, 3, 55);
    test_merge(gid, 2048, 2048, 4, 512, iters, 21);
    test_merge(gid, 777, 777, 3, 256, iters, 22);
    test_merge(gid, 1500, std::min(2048, 1500 * g_world), 4, 512, iters, 24);
    test_interleaved(gid, 500);
  }
  run_select_tests(small, iters);
  test_token_ring(bench);
  if (bench) {
    run_select_bench();
    run_bench(gid);
  }
  std::printf("%s: %d failure(s)\n", g_fail ? "FAILED" : "OK", g_fail);
  return g_fail ? 1 : 0;
}
