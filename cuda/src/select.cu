// Exact top-k of fp32 score rows in one kernel launch (issue 5: the DSA
// indexer's top-2048 over up to ~160K cache positions, T <= 8 tokens).
//
// Result: EXACTLY the (index, value) pairs `lax.top_k` returns. Scores are
// ordered by the total order of their bits (XLA's TopK comparator: -0.0 <
// +0.0, -inf below every finite score, NaN with the sign bit below -inf and
// without it above +inf); equal scores go to the lower position. With
// JT_TOPK_CANONICAL_ZERO, -0.0 counts as (and comes back as) +0.0, the order
// of merge_topk. Output order: by (score desc, position asc) with
// JT_TOPK_SORTED, else by position. With JT_TOPK_EMPTY_AS_MINUS_ONE, an
// entry whose score is not above -inf (a position the caller masked) comes
// back with position -1 (its value unchanged).
//
// Algorithm. Each row is cut into G chunks, one CTA each; a CTA keeps its
// chunk as order-preserving uint32 keys in shared memory (the scores are read
// once). The key of the k-th largest score is found digit by digit, most
// significant first (11 + 11 + 10 bits): every CTA builds a shared-memory
// histogram of the current digit over its keys that match the prefix found
// so far, adds it to the row's histogram in global memory, and after a
// barrier of the row's CTAs every CTA finds the same digit in the global
// histogram. The search stops early once the whole current bucket is taken.
// Then keys above the bucket are selected, plus the first `need` keys of the
// bucket in position order: each CTA publishes its two counts, and after one
// more barrier knows how many selected entries lie before its chunk, so it
// writes its own in position order. Sorted output: the k selected entries are
// staged in global memory; after a last barrier each CTA loads them and
// places its 1/G share at their rank (entries before it in (score desc,
// position asc) order, counted over all k).
//
// Barriers: the CTAs of a row meet at a sense-reversing barrier in global
// memory (arrival counter + generation word). The launch is cooperative, so
// all CTAs are resident; a wait still gives up after the timeout and traps
// with a status record, like the engine's other waits. Between calls only the
// barrier generation changes (each call reads it at its start); the arrival
// counters and the global histograms are back at zero when a call ends (the
// CTAs clear the histograms after their last read): every launch is
// identical, safe in CUDA graphs.
//
// Scratch (histograms, per-CTA counts, staging, barrier words, a host-mapped
// status) is allocated once per device by jt_topk_prepare; calls on one
// device must be stream-ordered (XLA's compute stream).
//
// Cluster variant (topk_cluster_kernel, by default for rows up to
// kClusterDefaultMaxN; it holds rows up to C * kClusterCap):
// one thread-block cluster of C <= 16 CTAs per row, grid = T clusters. The
// row's CTAs exchange what they must through distributed shared memory by
// pushing: each CTA writes its share into every CTA's copy of an exchange
// buffer with st.async, whose bytes complete on that CTA's mbarrier, and
// reads only its own copy (push_to_cluster, wait_pushes). The one cluster
// barrier on the by-position path is a relaxed one at the start (every CTA's
// mbarriers exist before the first push), which compiles to no fence: no
// GPU-wide fence sits on the way; no spin-wait in global memory; no global
// scratch except the sorted output's staging. Per digit level:
//   1. every CTA counts the digits of its keys in the bucket into its shared
//      histogram hist[lvl] and, as it counts, into the sums of its groups of
//      kGroup bins (zeroed with the histograms at the start), and pushes
//      those group sums (the coarse histogram);
//   2. every CTA adds up the C coarse histograms, finds the group that holds
//      the k-th key, pushes its own kGroup bins of that group, adds up the C
//      pushed and finds the digit: the same digit in every CTA, from 1/14 of
//      the bytes that whole histograms would take.
// Short form (by position only): a row none of whose scores from position k
// on is above -inf (a short context: the indexer masks the positions past
// the token's) and none below -inf (a NaN with the sign bit) selects its first
// k positions, since -inf is then the row's lowest key and ties go to the
// lower position. Each CTA checks its chunk as it loads it and sends the
// answer with level 0's coarse histogram (kFlagWords more words); where no
// CTA rules the short form out, every CTA writes its chunk's entries below
// position k at their own slots and ends: no more levels, no counts exchange.
// Then each CTA pushes its (above, in-bucket) counts, sums those of the CTAs
// before it and writes its entries like the grid kernel. Sorted output:
// staged in global memory, a cluster barrier, then every CTA sorts its 1/C
// share of the slots and ranks it against the other sorted shares by binary
// search (cluster_rank_store: one more barrier; k * k / C^2 comparisons per
// CTA instead of the grid kernel's k * k / G).
#include <cooperative_groups.h>
#include <cuda/ptx>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common.cuh"

namespace jt {
namespace {

constexpr int kNT = 512;            // threads per CTA
constexpr int kWarps = kNT / 32;
constexpr int kBins = 2048;         // widest digit: 11 bits
constexpr int kLevels = 3;          // digits: bits 31..21, 20..10, 9..0
constexpr int kMaxChunk = 16384;    // keys per CTA (64 KiB of shared memory)
constexpr int kMaxCtas = 1024;      // CTAs per row
constexpr int kSyncWords = 32;      // per row: [0] arrivals, [16] generation
constexpr unsigned kOpTopkSelect = 4;  // JtStatus.op of a timed-out barrier
constexpr int kMaxCluster = 16;     // CTAs per cluster (non-portable above 8)
constexpr int kClusterCap = 12288;  // keys per CTA of a cluster (48 KiB)
constexpr int kGroup = 16;          // bins per coarse group of the cluster merge
constexpr int kCoarse = kBins / kGroup;  // coarse groups of the widest digit
constexpr int kFlagWords = 4;       // level 0's coarse push: + the short form's word
constexpr uint32_t kNegInfKey = 0x007fffffu;  // order_key(-inf)
constexpr int kLoadBatch = 16;      // score loads in flight per thread
// dynamic shared memory of the cluster kernel: its keys or the sorted staging
constexpr int kClusterSmem = std::max(kClusterCap * 4, JT_TOPK_MAX_K * 8);

struct SelectParams {
  const float* scores;     // [T, n]
  int32_t* out_idx;        // [T, k]
  float* out_val;          // [T, k]
  uint32_t* hist;          // [JT_TOPK_MAX_ROWS][kLevels][kBins], zero between calls
  uint32_t* counts;        // [JT_TOPK_MAX_ROWS][2][kMaxCtas]
  unsigned long long* stage;  // [JT_TOPK_MAX_ROWS][JT_TOPK_MAX_K]
  unsigned* sync;          // [JT_TOPK_MAX_ROWS][kSyncWords]
  JtStatus* status;        // host-mapped
  long long timeout_ns;
  int n, k, chunk, mode;
};

// fp32 bits -> uint32 with the same order (total order of the bits).
__device__ __forceinline__ uint32_t order_key(float f, bool canonical_zero) {
  uint32_t u = __float_as_uint(f);
  if (canonical_zero && u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The position written for the entry of `key` at `pos` (see the file comment).
__device__ __forceinline__ int32_t out_position(int mode, uint32_t key, uint32_t pos) {
  const bool empty = (mode & JT_TOPK_EMPTY_AS_MINUS_ONE) && !(key_value(key) > -INFINITY);
  return empty ? -1 : (int32_t)pos;
}

// The bucket is the set of keys whose bits above `lo` equal `pre`.
__device__ __forceinline__ bool in_bucket(uint32_t key, uint32_t pre, int lo) {
  return lo >= 32 || (key >> lo) == pre;
}
__device__ __forceinline__ bool above_bucket(uint32_t key, uint32_t pre,
                                             int lo) {
  return lo < 32 && (key >> lo) > pre;
}

// Exclusive prefix sum of v over the CTA's threads; *total gets the sum.
// `ws` holds kWarps + 1 words of shared memory.
__device__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* ws,
                                         uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) ws[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = lane < kWarps ? ws[lane] : 0u;
    uint32_t s = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < kWarps) ws[lane] = s - w;
    if (lane == kWarps - 1) ws[kWarps] = s;
  }
  __syncthreads();
  const uint32_t r = ws[warp] + x - v;
  *total = ws[kWarps];
  __syncthreads();  // ws can be reused
  return r;
}

// This thread's bins [lo, hi) of a histogram with `cum` keys in the bins
// above them: writes {d, #(digits > d), hist[d]} to out if bin d is the one
// where the count from the top reaches `need`.
__device__ __forceinline__ void mark_crossing(const uint32_t* hist, int lo,
                                              int hi, uint32_t cum,
                                              uint32_t need, uint32_t* out) {
  for (int b = hi - 1; b >= lo; --b) {
    const uint32_t h = hist[b];
    if (cum < need && cum + h >= need) {  // exactly one bin crosses `need`
      out[0] = (uint32_t)b;
      out[1] = cum;
      out[2] = h;
    }
    cum += h;
  }
}

// In hist[0..nb): the largest digit d with #(digits >= d) >= need. Writes
// {d, #(digits > d), hist[d]} to out (shared memory), visible on return.
__device__ void find_digit(const uint32_t* hist, int nb, uint32_t need,
                           uint32_t* ws, uint32_t* out) {
  const int per = (nb + kNT - 1) / kNT;
  const int lo = threadIdx.x * per, hi = min(nb, lo + per);
  uint32_t s = 0;
  for (int b = lo; b < hi; ++b) s += hist[b];
  uint32_t total;
  const uint32_t before = block_exclusive_scan(s, ws, &total);
  uint32_t cum = total - before - s;  // keys in the bins above this thread's
  mark_crossing(hist, lo, hi, cum, need, out);
  __syncthreads();
}

// find_digit by warp 0 alone, for nb <= 128 bins (the cluster kernel's
// merged coarse and fine histograms): no block-wide scan; `out` is visible
// after the caller's next __syncthreads.
__device__ void warp_find_digit(const uint32_t* hist, int nb, uint32_t need,
                                uint32_t* out) {
  const int lane = threadIdx.x;
  if (lane >= 32) return;
  const int per = (nb + 31) / 32;
  const int lo = min(nb, lane * per), hi = min(nb, lo + per);
  uint32_t s = 0;
  for (int b = lo; b < hi; ++b) s += hist[b];
  uint32_t incl = s;  // keys in this lane's bins and above
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_down_sync(0xffffffffu, incl, o);
    if (lane + o < 32) incl += y;
  }
  uint32_t cum = incl - s;  // keys in the bins above this lane's
  mark_crossing(hist, lo, hi, cum, need, out);
}

// Barrier of the gridDim.x CTAs of this row (see the file comment). `where`
// names the barrier in a timeout record. `gen` (thread 0's) is the row's
// generation word as it stands until this CTA arrives: read once at kernel
// start, then known (each barrier advances it by one), so no load of it is
// on the barrier's path. The arrival counter starts every call at 0 and
// counts on through the call's barriers (round j: j*G .. j*G + G-1, all CTAs
// meet the same barriers); the last arrival at the call's `last` barrier
// sets it back to 0, as the next call may have another G.
__device__ void row_barrier(const SelectParams& p, unsigned* sync, int where,
                            unsigned* gen, bool last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g0 = *gen;
    __threadfence();
    if ((atomicAdd(sync, 1u) + 1u) % gridDim.x == 0u) {
      if (last) atomicExch(sync, 0u);
      __threadfence();
      atomicAdd(sync + 16, 1u);
    } else {
      const unsigned long long t0 = globaltimer();
      unsigned spins = 0;
      while (*(volatile unsigned*)(sync + 16) == g0) {
        if (++spins == 256u) {
          spins = 0;
          if ((long long)(globaltimer() - t0) > p.timeout_ns)
            fail_timeout(p.status, (int)blockIdx.y, kOpTopkSelect,
                         (int)blockIdx.x, where, g0);
        }
      }
    }
    *gen = g0 + 1u;
    __threadfence();
  }
  __syncthreads();
}

// Converts the row's scores [base, base + cnt) (src: the first) into keys in
// shared memory; kLoadBatch loads in flight per thread (one L2 round trip per
// batch). Returns, in every thread (the CTA's closing barrier), whether the
// chunk rules out the cluster kernel's short form for top k (see the file
// comment): a key above -inf's at a position >= k, or a key below it.
__device__ bool load_keys(const float* src, int cnt, bool canonical_zero,
                          uint32_t* keys, int base, int k) {
  bool rules_out = false;
  for (int i0 = 0; i0 < cnt; i0 += kNT * kLoadBatch) {
    float v[kLoadBatch];
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = i0 + j * kNT + (int)threadIdx.x;
      v[j] = i < cnt ? __ldg(src + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kLoadBatch; ++j) {
      const int i = i0 + j * kNT + (int)threadIdx.x;
      if (i < cnt) {
        const uint32_t key = order_key(v[j], canonical_zero);
        keys[i] = key;
        rules_out |= key < kNegInfKey || (key > kNegInfKey && base + i >= k);
      }
    }
  }
  return __syncthreads_or(rules_out) != 0;
}

// hist[0..nb) (zeroed by the caller) += the digits (key >> shift) & (nb - 1)
// of the keys in the bucket (pre, lo); with `groups` (zeroed too), also
// groups[d / kGroup] += the same counts.
__device__ void count_digits(const uint32_t* keys, int cnt, uint32_t pre,
                             int lo, int shift, int nb, uint32_t* hist,
                             uint32_t* groups = nullptr) {
  const int tid = threadIdx.x;
  const int vpt = (cnt + kNT - 1) / kNT;  // same trip count for every thread
  for (int j = 0; j < vpt; ++j) {
    const int i = j * kNT + tid;
    uint32_t d = 0xffffffffu;  // not counted
    if (i < cnt && in_bucket(keys[i], pre, lo)) d = (keys[i] >> shift) & (nb - 1);
    // past level 0 most warps hold no key of the bucket
    if (!__any_sync(0xffffffffu, d != 0xffffffffu)) continue;
    // one shared atomic per distinct digit in the warp: top digits of
    // similar scores collide a lot
    const unsigned peers = __match_any_sync(0xffffffffu, d);
    if (d != 0xffffffffu && (tid & 31) == __ffs(peers) - 1) {
      atomicAdd(&hist[d], (uint32_t)__popc(peers));
      if (groups != nullptr) atomicAdd(&groups[d / kGroup], (uint32_t)__popc(peers));
    }
  }
  __syncthreads();
}

// Warp w of the CTA owns segment w of the chunk: seg (a multiple of 32)
// positions from w * seg on, walked 32 consecutive keys at a time (no bank
// conflicts; ballots give the order inside each step).
__device__ __forceinline__ int warp_segment(int cnt) {
  return ((cnt + kWarps - 1) / kWarps + 31) & ~31;
}

// The chunk's keys above the bucket (*gt) and in it (*eq); wc[w] and
// wc[kWarps + w] get those in the segments before warp w's (2 * kWarps + 2
// words of shared memory, read by write_selected).
__device__ void chunk_counts(const uint32_t* keys, int cnt, uint32_t pre,
                             int lo, uint32_t* wc, uint32_t* gt,
                             uint32_t* eq) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = warp_segment(cnt), end = min(cnt, (warp + 1) * seg);
  uint32_t n_gt = 0, n_eq = 0;
  for (int i = warp * seg + lane; i < end; i += 32) {
    n_gt += above_bucket(keys[i], pre, lo);
    n_eq += in_bucket(keys[i], pre, lo);
  }
  n_gt = __reduce_add_sync(0xffffffffu, n_gt);
  n_eq = __reduce_add_sync(0xffffffffu, n_eq);
  if (lane == 0) {
    wc[warp] = n_gt;
    wc[kWarps + warp] = n_eq;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scans over the warps, both counts at once
    const uint32_t vg = lane < kWarps ? wc[lane] : 0u;
    const uint32_t ve = lane < kWarps ? wc[kWarps + lane] : 0u;
    uint32_t sg = vg, se = ve;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t yg = __shfl_up_sync(0xffffffffu, sg, o);
      const uint32_t ye = __shfl_up_sync(0xffffffffu, se, o);
      if (lane >= o) {
        sg += yg;
        se += ye;
      }
    }
    if (lane < kWarps) {
      wc[lane] = sg - vg;
      wc[kWarps + lane] = se - ve;
    }
    if (lane == 31) {
      wc[2 * kWarps] = sg;
      wc[2 * kWarps + 1] = se;
    }
  }
  __syncthreads();
  *gt = wc[2 * kWarps];
  *eq = wc[2 * kWarps + 1];
}

// Writes this chunk's selected entries in position order from slot `offset`
// on: the keys above the bucket and the first `take` of the chunk's bucket
// keys; to the outputs (by index) or to the row's staging (sorted). The entry
// at chunk position i goes to offset + (keys above the bucket before i) +
// min(bucket keys before i, take); wc from chunk_counts.
__device__ void write_selected(const SelectParams& p, const uint32_t* keys,
                               int cnt, int base, uint32_t pre, int lo,
                               uint32_t offset, uint32_t take, bool sorted,
                               const uint32_t* wc) {
  const int row = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = warp_segment(cnt), end = min(cnt, (warp + 1) * seg);
  const unsigned lanes_below = (1u << lane) - 1u;
  int32_t* oi = p.out_idx + (size_t)row * p.k;
  float* ov = p.out_val + (size_t)row * p.k;
  unsigned long long* stage = p.stage + (size_t)row * JT_TOPK_MAX_K;
  uint32_t gt_run = wc[warp], eq_run = wc[kWarps + warp];
  for (int i0 = warp * seg; i0 < end; i0 += 32) {  // same trips for the warp
    const int i = i0 + lane;
    const uint32_t key = i < end ? keys[i] : 0u;
    const bool gt = i < end && above_bucket(key, pre, lo);
    const bool eq = i < end && in_bucket(key, pre, lo);
    const unsigned b_gt = __ballot_sync(0xffffffffu, gt);
    const unsigned b_eq = __ballot_sync(0xffffffffu, eq);
    const uint32_t gt_before = gt_run + __popc(b_gt & lanes_below);
    const uint32_t eq_before = eq_run + __popc(b_eq & lanes_below);
    if (gt || (eq && eq_before < take)) {
      const uint32_t slot = offset + gt_before + min(eq_before, take);
      if (sorted) {
        stage[slot] = ((unsigned long long)key << 32) | (uint32_t)(base + i);
      } else {
        oi[slot] = out_position(p.mode, key, base + i);
        ov[slot] = key_value(key);
      }
    }
    gt_run += __popc(b_gt);
    eq_run += __popc(b_eq);
  }
}

// Sorted output, after a barrier behind every write_selected of the row:
// this CTA's share [s0, s0 + ne) of the k staged entries goes to its rank,
// the number of entries before it in (score desc, position asc) order.
// `st` (k entries) and `rank` (ne words) are shared memory.
__device__ void rank_store(const SelectParams& p, unsigned long long* st,
                           uint32_t* rank, int s0, int ne) {
  const int row = blockIdx.y, tid = threadIdx.x, k = p.k;
  const unsigned long long* stage = p.stage + (size_t)row * JT_TOPK_MAX_K;
  const uint32_t* st_key = reinterpret_cast<const uint32_t*>(st) + 1;  // high words
  for (int i = tid; i < k; i += kNT) st[i] = __ldcg(&stage[i]);
  for (int i = tid; i < ne; i += kNT) rank[i] = 0;
  __syncthreads();
  if (ne == 0) return;
  // threads split the k entries to compare against into `parts` ranges
  const int parts = max(1, kNT / ne);
  for (int w = tid; w < ne * parts; w += kNT) {
    const int el = w % ne, part = w / ne;
    const int slot_x = s0 + el;
    const uint32_t kx = st_key[2 * slot_x];
    const int y0 = (int)((long long)k * part / parts);
    const int y1 = (int)((long long)k * (part + 1) / parts);
    // staged entries are in position order: those before slot_x win ties
    const int a = min(max(slot_x, y0), y1);
    const int b = max(a, min(slot_x + 1, y1));
    uint32_t c = 0;
    for (int y = y0; y < a; ++y) c += st_key[2 * y] >= kx;
    for (int y = b; y < y1; ++y) c += st_key[2 * y] > kx;
    atomicAdd(&rank[el], c);
  }
  __syncthreads();
  int32_t* oi = p.out_idx + (size_t)row * k;
  float* ov = p.out_val + (size_t)row * k;
  for (int i = tid; i < ne; i += kNT) {
    const unsigned long long v = st[s0 + i];
    const uint32_t r = rank[i];
    oi[r] = out_position(p.mode, (uint32_t)(v >> 32), (uint32_t)v);
    ov[r] = key_value((uint32_t)(v >> 32));
  }
}

// Bits of digit level `lvl`: 31..21, 20..10, 9..0.
__device__ __forceinline__ int level_shift(int lvl) {
  return lvl == 0 ? 21 : (lvl == 1 ? 10 : 0);
}
// Bins of level `lvl`'s digit: 2048, 2048, 1024.
__device__ __forceinline__ int level_bins(int lvl) {
  return 1 << ((lvl == 0 ? 32 : level_shift(lvl - 1)) - level_shift(lvl));
}

__global__ void __launch_bounds__(kNT) topk_select_kernel(SelectParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t ws[kWarps + 1];
  __shared__ uint32_t wc[2 * kWarps + 2];
  __shared__ uint32_t found[3];
  const int row = blockIdx.y, g = blockIdx.x, G = gridDim.x;
  const int tid = threadIdx.x;
  const bool sorted = (p.mode & JT_TOPK_SORTED) != 0;
  const int k = p.k;
  const int base = g * p.chunk;
  const int cnt = min(p.chunk, p.n - base);
  const int region = (max(p.chunk * 4, sorted ? k * 8 : 0) + 15) & ~15;
  uint32_t* keys = reinterpret_cast<uint32_t*>(smem);
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + region);
  uint32_t* ghist = p.hist + (size_t)row * kLevels * kBins;
  uint32_t* counts = p.counts + (size_t)row * 2 * kMaxCtas;
  unsigned* sync = p.sync + row * kSyncWords;

  // stable until this CTA arrives at its first barrier (see row_barrier)
  unsigned gen = threadIdx.x == 0 ? *(volatile unsigned*)(sync + 16) : 0u;
  load_keys(p.scores + (size_t)row * p.n + base, cnt,
            (p.mode & JT_TOPK_CANONICAL_ZERO) != 0, keys, base, p.k);

  // ---- the k-th largest key, digit by digit
  uint32_t pre = 0, need = (uint32_t)k;
  int lo = 32;
  for (int lvl = 0; lvl < kLevels; ++lvl) {
    const int shift = level_shift(lvl);
    const int nb = 1 << (lo - shift);
    for (int b = tid; b < nb; b += kNT) hist[b] = 0;
    __syncthreads();
    count_digits(keys, cnt, pre, lo, shift, nb, hist);
    for (int b = tid; b < nb; b += kNT)
      if (hist[b] != 0) atomicAdd(&ghist[lvl * kBins + b], hist[b]);
    row_barrier(p, sync, lvl, &gen, false);
    for (int b = tid; b < nb; b += kNT) hist[b] = __ldcg(&ghist[lvl * kBins + b]);
    __syncthreads();
    find_digit(hist, nb, need, ws, found);
    const uint32_t above = found[1], in_d = found[2];
    pre = (pre << (lo - shift)) | found[0];
    lo = shift;
    need -= above;
    if (in_d == need) break;  // the whole bucket is taken
  }

  // ---- how many selected entries lie before this chunk
  uint32_t tot_gt, tot_eq;
  chunk_counts(keys, cnt, pre, lo, wc, &tot_gt, &tot_eq);
  if (tid == 0) {
    counts[g] = tot_gt;
    counts[kMaxCtas + g] = tot_eq;
  }
  row_barrier(p, sync, kLevels, &gen, !sorted);
  // every CTA has read the histograms: clear this CTA's share for the next call
  for (int b = g * kNT + tid; b < kLevels * kBins; b += G * kNT) ghist[b] = 0;
  uint32_t gt_before = 0, eq_before = 0;
  for (int c = tid; c < g; c += kNT) {
    gt_before += __ldcg(&counts[c]);
    eq_before += __ldcg(&counts[kMaxCtas + c]);
  }
  block_exclusive_scan(gt_before, ws, &gt_before);
  block_exclusive_scan(eq_before, ws, &eq_before);
  // bucket entries are taken in position order: the first `need` of the row
  const uint32_t offset = gt_before + min(eq_before, need);
  const uint32_t take = need > eq_before ? min(need - eq_before, tot_eq) : 0u;
  write_selected(p, keys, cnt, base, pre, lo, offset, take, sorted, wc);
  if (!sorted) return;

  // ---- sorted output: rank this CTA's share of the k staged entries
  row_barrier(p, sync, kLevels + 1, &gen, true);
  const int per = (k + G - 1) / G;
  const int s0 = min(k, g * per);
  rank_store(p, reinterpret_cast<unsigned long long*>(smem), hist + kBins, s0,
             min(k, s0 + per) - s0);
}

// Cluster barrier halves: every thread of every CTA of the cluster arrives;
// arrive releases this thread's writes (shared and global), wait acquires
// those of all. A CTA may work between its arrive and its wait.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The cluster kernel's exchanges. A CTA pushes its share of an exchange into
// slot g (its rank) of every cluster CTA's copy of the exchange buffer with
// st.async, which completes its bytes on that CTA's copy of the exchange's
// mbarrier; a CTA reads only its own copy, once its mbarrier's phase 0 has
// completed (every CTA's bytes landed). This keeps cluster barriers off the
// path: barrier.cluster.arrive.release (and fence.acq_rel.cluster), which
// publishing plain shared-memory writes to the cluster needs, compile to a
// GPU-wide MEMBAR.ALL.GPU on sm_90.
//
// Pushes words[0..n) (shared memory, n a multiple of 4) into slot g of every
// CTA's dst[C][n], completing on its `bar`; thread t sends 16 bytes.
__device__ void push_to_cluster(const uint32_t* words, int n, uint32_t* dst,
                                uint64_t* bar) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cl = cg::this_cluster();
  const int nq = n / 4, C = (int)cl.num_blocks(), g = (int)cl.block_rank();
  for (int t = threadIdx.x; t < C * nq; t += kNT) {
    const int r = t / nq, q = t % nq;
    const uint4 v = reinterpret_cast<const uint4*>(words)[q];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    cuda::ptx::st_async(cl.map_shared_rank(dst + g * n + 4 * q, r), w,
                        cl.map_shared_rank(bar, r));
  }
}

// Waits until every CTA's push into this CTA's exchange `bar` has landed; like
// the grid kernel's barrier, gives up after the timeout with a status record.
__device__ void wait_pushes(const SelectParams& p, uint64_t* bar, int where) {
  if (cuda::ptx::mbarrier_try_wait_parity(bar, 0u)) return;
  const unsigned long long t0 = globaltimer();
  unsigned spins = 0;
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, 0u)) {
    if (++spins == 256u) {
      spins = 0;
      if ((long long)(globaltimer() - t0) > p.timeout_ns)
        fail_timeout(p.status, (int)blockIdx.y, kOpTopkSelect, (int)blockIdx.x,
                     where, 0u);
    }
  }
}

// The short form's output, by position: this chunk's entries below position
// k, each at the slot of its position.
__device__ void write_leading(const SelectParams& p, const uint32_t* keys,
                              int cnt, int base) {
  int32_t* oi = p.out_idx + (size_t)blockIdx.y * p.k;
  float* ov = p.out_val + (size_t)blockIdx.y * p.k;
  for (int i = threadIdx.x; i < min(cnt, p.k - base); i += kNT) {
    oi[base + i] = out_position(p.mode, keys[i], (uint32_t)(base + i));
    ov[base + i] = key_value(keys[i]);
  }
}

// Sorted output of the cluster kernel, after the barrier behind the staging
// (k entries in position order). CTA g owns the share of slots [g * per,
// g * per + ne): it sorts the share by (score desc, position asc) with
// ne * ne comparisons, publishes the sorted keys in `sorted_keys`, and after
// a cluster barrier copies every share's sorted keys. An entry's rank is its
// rank in its share plus, for every other share, the count of keys that go
// before it by a binary search: shares before its own win ties (lower
// positions), shares after it lose them. `rank`, `sorted_keys`, `share_keys`
// hold per words, `dyn` (the dynamic shared memory) k + per words. All CTAs
// meet the same barriers; the last one lets a CTA exit once no other reads
// its sorted keys.
__device__ void cluster_rank_store(const SelectParams& p, uint32_t* rank,
                                   uint32_t* sorted_keys, uint32_t* share_keys,
                                   uint32_t* dyn) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cl = cg::this_cluster();
  const int row = blockIdx.y, g = blockIdx.x, C = gridDim.x, tid = threadIdx.x;
  const int k = p.k, per = (k + C - 1) / C;
  const int s0 = min(k, g * per), ne = min(k, s0 + per) - s0;
  const unsigned long long* stage = p.stage + (size_t)row * JT_TOPK_MAX_K;
  uint32_t* all_keys = dyn;           // [k]: every share, sorted
  uint32_t* share_pos = dyn + k;      // [ne]
  for (int j = tid; j < ne; j += kNT) {
    const unsigned long long v = __ldcg(&stage[s0 + j]);
    share_keys[j] = (uint32_t)(v >> 32);
    share_pos[j] = (uint32_t)v;
    rank[j] = 0;
  }
  __syncthreads();
  // rank in the share: threads split the share into `parts` ranges
  const int parts = max(1, kNT / max(ne, 1));
  for (int w = tid; w < ne * parts; w += kNT) {
    const int el = w % ne, part = w / ne;
    const uint32_t kx = share_keys[el];
    const int y0 = ne * part / parts, y1 = ne * (part + 1) / parts;
    const int a = min(max(el, y0), y1);  // those before el win ties
    const int b = max(a, min(el + 1, y1));
    uint32_t c = 0;
    for (int y = y0; y < a; ++y) c += share_keys[y] >= kx;
    for (int y = b; y < y1; ++y) c += share_keys[y] > kx;
    atomicAdd(&rank[el], c);
  }
  __syncthreads();
  for (int j = tid; j < ne; j += kNT) sorted_keys[rank[j]] = share_keys[j];
  cluster_arrive();
  cluster_wait();
  for (int i = tid; i < k; i += kNT)
    all_keys[i] = cl.map_shared_rank(sorted_keys, i / per)[i % per];
  cluster_arrive();  // no more remote reads: the other CTAs may exit
  __syncthreads();
  for (int w = tid; w < ne * C; w += kNT) {
    const int el = w % ne, sh = w / ne;
    if (sh == g) continue;
    const uint32_t kx = share_keys[el];
    const uint32_t* y = all_keys + sh * per;
    // keys that go before kx come first in the sorted share
    int lo = 0, hi = max(0, min(k - sh * per, per));
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (sh < g ? y[mid] >= kx : y[mid] > kx) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0) atomicAdd(&rank[el], (uint32_t)lo);
  }
  __syncthreads();
  int32_t* oi = p.out_idx + (size_t)row * k;
  float* ov = p.out_val + (size_t)row * k;
  for (int j = tid; j < ne; j += kNT) {
    oi[rank[j]] = out_position(p.mode, share_keys[j], share_pos[j]);
    ov[rank[j]] = key_value(share_keys[j]);
  }
  cluster_wait();
}

// One cluster per row (see the file comment); blockIdx.x is the CTA's rank in
// the cluster, gridDim.x = C, chunks of p.chunk <= kClusterCap keys.
__global__ void __launch_bounds__(kNT) topk_cluster_kernel(SelectParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  // this CTA's digit histograms, one per level (the sorted output's scratch after)
  __shared__ __align__(16) uint32_t hist[kLevels][kBins];
  // hist's group sums; level 0's then the short form's word (kFlagWords)
  __shared__ __align__(16) uint32_t coarse[kLevels][kCoarse + kFlagWords];
  // exchanges: every CTA's coarse histogram, the fine bins of the chosen group,
  // the (above, in-bucket) counts, each by source rank (push_to_cluster)
  __shared__ __align__(16) uint32_t x_coarse[kMaxCluster * (kCoarse + kFlagWords)];  // [C][nx]
  __shared__ __align__(16) uint32_t x_fine[kMaxCluster * kGroup];      // [C][kGroup]
  __shared__ __align__(16) uint32_t x_counts[kMaxCluster * 4];         // [C][4]
  // one mbarrier per exchange and level: coarse, fine, then the counts
  __shared__ __align__(8) uint64_t bars[2 * kLevels + 1];
  __shared__ __align__(16) uint32_t sum_coarse[kCoarse];
  __shared__ __align__(16) uint32_t sum_fine[kGroup];
  __shared__ uint32_t wc[2 * kWarps + 2];
  __shared__ uint32_t found[3];       // the coarse search's result, then the counts'
  __shared__ uint32_t found_fine[3];  // apart: warp 0 writes it while others read found
  __shared__ uint32_t ruled_out;      // some CTA rules out the short form
  namespace cg = cooperative_groups;
  namespace ptx = cuda::ptx;
  const int g = blockIdx.x, C = gridDim.x, tid = threadIdx.x;
  const bool sorted = (p.mode & JT_TOPK_SORTED) != 0;
  const int k = p.k;
  const int base = g * p.chunk;
  const int cnt = max(0, min(p.chunk, p.n - base));
  uint32_t* keys = reinterpret_cast<uint32_t*>(smem);
  // Each exchange's mbarrier expects all C pushes at once (phase 0); the
  // buffers are reused from level to level, which is safe as a CTA pushes
  // into an exchange only after it has received every CTA's share of the
  // exchange before it, sent after that CTA's last read of this one.
  if (tid == 0) {
    for (int e = 0; e < 2 * kLevels + 1; ++e) {
      const int lvl = e % kLevels;
      const int words = e < kLevels ? level_bins(lvl) / kGroup + (lvl == 0 ? kFlagWords : 0)
                                    : (e < 2 * kLevels ? kGroup : 4);
      ptx::mbarrier_init(&bars[e], 1);
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared,
                                     &bars[e], (uint32_t)(C * words * 4));
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  // every CTA's mbarriers exist before any CTA pushes (the wait below)
  ptx::barrier_cluster_arrive(ptx::sem_relaxed);
  for (int b = tid; b < kLevels * kBins; b += kNT) (&hist[0][0])[b] = 0;
  for (int b = tid; b < kLevels * (kCoarse + kFlagWords); b += kNT) (&coarse[0][0])[b] = 0;
  const bool rules_out = load_keys(p.scores + (size_t)blockIdx.y * p.n + base, cnt,
                                   (p.mode & JT_TOPK_CANONICAL_ZERO) != 0, keys, base, k) ||
                         sorted;
  if (tid == 0) coarse[0][kCoarse] = rules_out;  // pushed with level 0's histogram
  ptx::barrier_cluster_wait();

  uint32_t pre = 0, need = (uint32_t)k;
  int lo = 32;
  for (int lvl = 0; lvl < kLevels; ++lvl) {
    const int shift = level_shift(lvl);
    const int nb = level_bins(lvl), ng = nb / kGroup;
    const int nx = lvl == 0 ? ng + kFlagWords : ng;  // words a CTA pushes
    uint32_t* h = hist[lvl];
    count_digits(keys, cnt, pre, lo, shift, nb, h, coarse[lvl]);
    push_to_cluster(coarse[lvl], nx, x_coarse, &bars[lvl]);
    if (tid < ng) {  // the row's coarse histogram
      wait_pushes(p, &bars[lvl], lvl);
      uint32_t s = 0;
      for (int r = 0; r < C; ++r) s += x_coarse[r * nx + tid];
      sum_coarse[tid] = s;
    } else if (lvl == 0 && tid == ng) {  // and whether a CTA rules out the short form
      wait_pushes(p, &bars[lvl], lvl);
      uint32_t any = 0;
      for (int r = 0; r < C; ++r) any |= x_coarse[r * nx + ng];
      ruled_out = any;
    }
    __syncthreads();
    if (lvl == 0 && !ruled_out) {  // every CTA has received every push: it may end
      write_leading(p, keys, cnt, base);
      return;
    }
    warp_find_digit(sum_coarse, ng, need, found);
    __syncthreads();
    const uint32_t grp = found[0], above_grp = found[1];
    push_to_cluster(h + grp * kGroup, kGroup, x_fine, &bars[kLevels + lvl]);
    if (tid < 32) {  // the row's bins of that group, and the digit, by warp 0
      wait_pushes(p, &bars[kLevels + lvl], kLevels + lvl);
      if (tid < kGroup) {
        uint32_t s = 0;
        for (int r = 0; r < C; ++r) s += x_fine[r * kGroup + tid];
        sum_fine[tid] = s;
      }
      __syncwarp();
      warp_find_digit(sum_fine, kGroup, need - above_grp, found_fine);
    }
    __syncthreads();
    const uint32_t above = above_grp + found_fine[1], in_d = found_fine[2];
    pre = (pre << (lo - shift)) | (grp * kGroup + found_fine[0]);
    lo = shift;
    need -= above;
    if (in_d == need) break;  // the whole bucket is taken (in every CTA)
  }

  uint32_t tot_gt, tot_eq;
  chunk_counts(keys, cnt, pre, lo, wc, &tot_gt, &tot_eq);
  if (tid < C) {  // this CTA's counts to every CTA
    const uint32_t w[4] = {tot_gt, tot_eq, 0u, 0u};
    ptx::st_async(cg::this_cluster().map_shared_rank(&x_counts[4 * g], tid), w,
                  cg::this_cluster().map_shared_rank(&bars[2 * kLevels], tid));
  }
  if (tid < 32) {  // the counts of the CTAs before this one (C <= 32)
    wait_pushes(p, &bars[2 * kLevels], 2 * kLevels);
    uint32_t gt = tid < g ? x_counts[4 * tid] : 0u;
    uint32_t eq = tid < g ? x_counts[4 * tid + 1] : 0u;
    gt = __reduce_add_sync(0xffffffffu, gt);
    eq = __reduce_add_sync(0xffffffffu, eq);
    if (tid == 0) {
      found[0] = gt;
      found[1] = eq;
    }
  }
  __syncthreads();
  const uint32_t gt_before = found[0], eq_before = found[1];
  const uint32_t offset = gt_before + min(eq_before, need);
  const uint32_t take = need > eq_before ? min(need - eq_before, tot_eq) : 0u;
  write_selected(p, keys, cnt, base, pre, lo, offset, take, sorted, wc);
  if (!sorted) return;  // nothing of this CTA is read by another after its exchanges
  // the staging is in global memory: the release orders it for the ranking
  cluster_arrive();
  cluster_wait();
  cluster_rank_store(p, hist[0], hist[1], hist[2], keys);
}

struct Scratch {
  bool ready;
  uint32_t* hist;
  uint32_t* counts;
  unsigned long long* stage;
  unsigned* sync;
  JtStatus* status;
  long long timeout_ns;
  int sms;
  int max_smem;
  int max_cluster;   // largest cluster the cluster kernel runs with (0: none)
  bool cooperative;  // JTILERT_TOPK_COOPERATIVE=0: plain launches
};

constexpr int kMaxDevices = 64;
Scratch g_scratch[kMaxDevices];
std::mutex g_mu;

struct Plan {
  int ctas;      // G, CTAs per row
  int chunk;     // positions per CTA
  size_t smem;
  bool cluster;  // topk_cluster_kernel, one cluster of `ctas` CTAs per row
};

// Largest cluster size (16, else 8) with which the cluster kernel can run, 0
// if none; needs the kernel's attributes set (jt_topk_prepare).
int max_cluster_size() {
  for (int c : {kMaxCluster, 8}) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)c;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)c, 1, 1);
    cfg.blockDim = dim3(kNT, 1, 1);
    cfg.dynamicSmemBytes = kClusterSmem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, topk_cluster_kernel, &cfg) == cudaSuccess &&
        n >= 1)
      return c;
    cudaGetLastError();
  }
  return 0;
}

// Rows up to this many scores run on clusters of at most 8 CTAs by default:
// with 16, each CTA holds only a few hundred keys, and the 8 more CTAs only
// add pushes to every exchange (0.5 us faster at 4096 keys, level at 8192;
// bench/RESULTS.md, session 51).
constexpr int kHalfClusterMaxN = 6144;

// Cluster plan: C = -ctas CTAs (1 too: a cluster of one, for the self-test and
// tuning), or (ctas == 0) the largest cluster the GPU runs (16: the most CTAs
// loading and counting keys at once; one CTA is slower even where the row fits
// in it), at most 8 for rows up to kHalfClusterMaxN, each CTA with a chunk of
// ceil(n / C) <= kClusterCap keys.
bool make_cluster_plan(const Scratch& s, int n, int k, int mode, int ctas,
                       Plan* p) {
  const int C = ctas < 0 ? -ctas
                : n <= kHalfClusterMaxN ? std::min(8, s.max_cluster) : s.max_cluster;
  // a CTA's share of the sorted output (ranks, keys) lives in its histograms
  if (C < 1 || C > std::max(1, s.max_cluster) || (k + C - 1) / C > kBins ||
      (long long)C * kClusterCap < n)
    return false;
  const bool sorted = (mode & JT_TOPK_SORTED) != 0;
  p->ctas = C;
  p->chunk = (n + C - 1) / C;
  p->smem = ((size_t)std::max(p->chunk * 4, sorted ? k * 8 : 0) + 15) & ~(size_t)15;
  p->cluster = true;
  return true;
}

// Rows up to this many scores go to the cluster kernel by default; longer rows
// to the grid kernel: about where the two cross for sorted output; by
// position the cluster kernel stays the faster to longer rows
// (bench/RESULTS.md, sessions 51 and 53).
constexpr int kClusterDefaultMaxN = 49152;

// Launch for T rows of n scores. ctas > 0: the grid kernel with `ctas` CTAs
// per row; ctas < 0: the cluster kernel with clusters of -ctas CTAs; 0: the
// cluster kernel for n <= kClusterDefaultMaxN, else the grid kernel with
// about one CTA per SM in all. Grid kernel: chunks a multiple of 32 positions,
// at most kMaxChunk; false if the grid cannot be co-resident.
bool make_plan(const Scratch& s, int T, int n, int k, int mode, int ctas,
               Plan* p) {
  if (T < 1 || T > JT_TOPK_MAX_ROWS || n < 1 || k < 1 || k > n ||
      k > JT_TOPK_MAX_K)
    return false;
  if ((ctas < 0 || (ctas == 0 && n <= kClusterDefaultMaxN)) &&
      make_cluster_plan(s, n, k, mode, ctas, p))
    return true;
  if (ctas < 0) return false;
  int G = ctas > 0 ? ctas : std::max(1, s.sms / T);
  G = std::min(G, (n + 31) / 32);
  int chunk = (n + G - 1) / G;
  chunk = std::min(kMaxChunk, (chunk + 31) / 32 * 32);
  G = (n + chunk - 1) / chunk;
  if (G > kMaxCtas) return false;
  const bool sorted = (mode & JT_TOPK_SORTED) != 0;
  const size_t region = ((size_t)std::max(chunk * 4, sorted ? k * 8 : 0) + 15) & ~(size_t)15;
  const size_t smem = region + kBins * 4 + (sorted ? (size_t)((k + G - 1) / G) * 4 : 0);
  if (smem > (size_t)s.max_smem) return false;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_select_kernel,
                                                    kNT, smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if ((long long)T * G > (long long)per_sm * s.sms) return false;
  p->ctas = G;
  p->chunk = chunk;
  p->smem = smem;
  p->cluster = false;
  return true;
}

}  // namespace
}  // namespace jt

using jt::g_scratch;

extern "C" int jt_topk_prepare(int dev, int64_t timeout_ms, char* err,
                               int errlen) {
  std::lock_guard<std::mutex> lock(jt::g_mu);
  if (dev < 0 || dev >= jt::kMaxDevices) {
    if (err && errlen > 0) std::snprintf(err, (size_t)errlen, "bad device %d", dev);
    return -1;
  }
  jt::Scratch& s = g_scratch[dev];
  if (s.ready) return 0;
  int prev = 0;
  cudaGetDevice(&prev);
  const size_t hist_b = (size_t)JT_TOPK_MAX_ROWS * jt::kLevels * jt::kBins * 4;
  const size_t counts_b = (size_t)JT_TOPK_MAX_ROWS * 2 * jt::kMaxCtas * 4;
  const size_t stage_b = (size_t)JT_TOPK_MAX_ROWS * JT_TOPK_MAX_K * 8;
  const size_t sync_b = (size_t)JT_TOPK_MAX_ROWS * jt::kSyncWords * 4;
  void* buf = nullptr;
  cudaError_t e = cudaSetDevice(dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&s.max_smem,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  // the kernel also has a few bytes of static shared memory
  if (e == cudaSuccess) s.max_smem -= 1024;
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(reinterpret_cast<const void*>(&jt::topk_select_kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             s.max_smem);
  const void* ck = reinterpret_cast<const void*>(&jt::topk_cluster_kernel);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(ck, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             jt::kClusterSmem);
  // clusters of 16 CTAs (8 is the portable limit)
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(ck, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e == cudaSuccess) s.max_cluster = jt::max_cluster_size();
  if (e == cudaSuccess) e = cudaMalloc(&buf, hist_b + counts_b + stage_b + sync_b);
  if (e == cudaSuccess) e = cudaMemset(buf, 0, hist_b + counts_b + stage_b + sync_b);
  if (e == cudaSuccess)
    e = cudaHostAlloc((void**)&s.status, sizeof(JtStatus),
                      cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (buf != nullptr) cudaFree(buf);
    if (err && errlen > 0)
      std::snprintf(err, (size_t)errlen, "topk prepare device %d: %s", dev,
                    cudaGetErrorString(e));
    return -1;
  }
  std::memset((void*)s.status, 0, sizeof(JtStatus));
  char* b = static_cast<char*>(buf);
  s.hist = reinterpret_cast<uint32_t*>(b);
  s.stage = reinterpret_cast<unsigned long long*>(b + hist_b);
  s.counts = reinterpret_cast<uint32_t*>(b + hist_b + stage_b);
  s.sync = reinterpret_cast<unsigned*>(b + hist_b + stage_b + counts_b);
  s.timeout_ns = (long long)timeout_ms * 1000000LL;
  // a way out should a driver refuse cooperative kernels in CUDA graphs; the
  // grid still fits on the GPU (make_plan), so it runs co-resident when the
  // GPU has nothing else running, and a barrier wait times out otherwise
  const char* coop = std::getenv("JTILERT_TOPK_COOPERATIVE");
  s.cooperative = coop == nullptr || std::strcmp(coop, "0") != 0;
  s.ready = true;
  return 0;
}

extern "C" int jt_topk_status(int dev, JtStatus* out) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready || out == nullptr)
    return -1;
  std::memcpy(out, (const void*)g_scratch[dev].status, sizeof(JtStatus));
  return 0;
}

extern "C" int jt_topk_select_ctas(int dev, int T, int n, int k, int mode,
                                   int ctas) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready) return -1;
  jt::Plan p;
  return jt::make_plan(g_scratch[dev], T, n, k, mode, ctas, &p) ? p.ctas : -1;
}

extern "C" int jt_topk_select_cluster(int dev, int T, int n, int k, int mode,
                                      int ctas) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready) return -1;
  jt::Plan p;
  if (!jt::make_plan(g_scratch[dev], T, n, k, mode, ctas, &p)) return -1;
  return p.cluster ? p.ctas : 0;
}

extern "C" cudaError_t jt_topk_select(int dev, cudaStream_t stream,
                                      const float* scores, int32_t* out_idx,
                                      float* out_val, int T, int n, int k,
                                      int mode, int ctas) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready)
    return cudaErrorInvalidResourceHandle;
  const jt::Scratch& s = g_scratch[dev];
  jt::Plan plan;
  if (!jt::make_plan(s, T, n, k, mode, ctas, &plan))
    return cudaErrorInvalidValue;
  jt::SelectParams p;
  p.scores = scores;
  p.out_idx = out_idx;
  p.out_val = out_val;
  p.hist = s.hist;
  p.counts = s.counts;
  p.stage = s.stage;
  p.sync = s.sync;
  p.status = s.status;
  p.timeout_ns = s.timeout_ns;
  p.n = n;
  p.k = k;
  p.chunk = plan.chunk;
  p.mode = mode;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)plan.ctas, (unsigned)T, 1);
  cfg.blockDim = dim3(jt::kNT, 1, 1);
  cfg.dynamicSmemBytes = plan.smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  if (plan.cluster) {  // one cluster per row
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)plan.ctas;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, jt::topk_cluster_kernel, p);
  }
  // cooperative: the row barriers need every CTA resident
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.numAttrs = s.cooperative ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, jt::topk_select_kernel, p);
}
