// jtilert CUDA engine: C API.
//
// Host-side set-up (called from Python through ctypes, or from the self-test
// driver) and the launch functions that the XLA FFI handlers call.
//
// A "group" is an ordered list of local CUDA devices (the devices along one
// mesh axis, in axis order). Creating it allocates, on every device of the
// group, one inbox (plain cudaMalloc), an epoch counter and a done counter, and
// enables peer access between all pairs. Every later call reuses them: flags in
// the inboxes carry the call's epoch, so nothing is reset between calls and
// every launch of a given call site is identical (safe inside CUDA graphs).
//
// No NVLink multicast is used anywhere: peers are reached through plain peer
// pointers (cudaDeviceEnablePeerAccess) with 16-byte loads and stores.
#ifndef JTILERT_ENGINE_H_
#define JTILERT_ENGINE_H_

#include <stdint.h>

#ifdef __cplusplus
#include <cuda_runtime.h>
extern "C" {
#else
typedef struct CUstream_st* cudaStream_t;
#endif

// The library is built with hidden visibility; this API is what it exports.
#pragma GCC visibility push(default)

#define JT_MAX_WORLD 8
#define JT_MAX_GROUPS 32

// dtype codes shared with Python (jtilert/ffi/_lib.py).
enum JtDtype {
  JT_F32 = 0,
  JT_BF16 = 1,
  JT_F16 = 2,
  JT_F8E4M3 = 3,
};

// all-reduce algorithms
enum JtAllReduceAlgo {
  JT_AR_ONESHOT = 0,
  JT_AR_TWOSHOT = 1,
};

// Error record written by a kernel (host-mapped memory) before it traps.
typedef struct JtStatus {
  uint32_t code;   // 0 = ok, 1 = spin-wait timeout
  uint32_t rank;   // rank that timed out
  uint32_t src;    // peer it was waiting for
  uint32_t epoch;  // epoch of the call
  uint64_t line;   // inbox line it was waiting on
  uint64_t op;     // kernel id (1 all-reduce, 2 gemv, 3 merge_topk,
                   // 4 topk_select: rank = row, src = CTA, line = barrier)
} JtStatus;

// ---- set-up (host, not thread-safe with respect to launches of the same group
// ---- before creation returns; creation itself is serialised by a mutex) ----

// Number of visible CUDA devices, or -1 on error.
int jt_device_count(void);
// Multiprocessor count of `dev`, or -1.
int jt_sm_count(int dev);
// 1 if every ordered pair of `devices` can access each other (peer access),
// 0 if not (reason in `err`), -1 on a CUDA error.
int jt_can_access_peers(const int* devices, int n, char* err, int errlen);
// Raises the dynamic shared-memory limits of the engine's kernels on `dev`.
// Idempotent; returns 0 on success.
int jt_prepare_device(int dev, char* err, int errlen);
// Creates (or finds) the group of `devices` (in rank order). `payload_cap` is
// the largest message, in bytes per rank, that one call may carry.
// `timeout_ms` bounds every spin-wait. Returns the group id (>= 0) or -1.
int jt_group_create(const int* devices, int world, int64_t payload_cap,
                    int64_t timeout_ms, char* err, int errlen);
// Group id of exactly this device list, or -1.
int jt_group_find(const int* devices, int world);
// Group id and rank of `device` inside the groups listed in `groups`
// ([ngroups * world], flattened); -1 if absent.
int jt_group_lookup(const int* groups, int ngroups, int world, int device,
                    int* rank);
// Largest payload (bytes per rank) of group `gid`.
int64_t jt_group_payload_cap(int gid);
// Copies rank `rank`'s status record into `out`; returns 0 or -1.
int jt_group_status(int gid, int rank, JtStatus* out);
// Library version string.
const char* jt_version(void);

// ---- launches (any host thread; the current device must be the rank's) ----

// y = sum over ranks of x (n elements of `dtype`), bit-identical on all ranks.
cudaError_t jt_all_reduce(int gid, int rank, cudaStream_t stream,
                          const void* x, void* y, int64_t n, int dtype,
                          int algo, int blocks, int threads);

// y[N] = sum over ranks of (W_r[N,K] @ x_r[K]), W bf16 or fp8 e4m3 with
// block scales scale[ceil(N/128), ceil(K/128)] (W = q * scale), x and y bf16.
// `table` is the device copy of the task table (see jtilert/ffi/plan.py).
// gid < 0: no all-reduce (local GEMV only).
cudaError_t jt_gemv_all_reduce(int gid, int rank, cudaStream_t stream,
                               const void* x, const void* w,
                               const float* scale, const int32_t* table,
                               void* y, int N, int K, int wdtype, int nwc,
                               int rpw, int num_ctas, int max_tasks);

// Expert-down mode of the same kernel (MoE down projection + shared expert,
// one all-reduce): y[N] = sum over ranks of
//   sum_e Down[ids[e]] @ (weights[e] * h[e]) + SharedDown @ shared_h
// h [nsel, I] and shared_h [Is] bf16, weights [nsel] fp32 and ids [nsel]
// int32 (device memory, ids clamped into [0, E)), Down [E, N, I] and
// SharedDown [N, Is] both bf16 or both fp8 e4m3 with scales
// [E, ceil(N/128), ceil(I/128)] and [ceil(N/128), ceil(Is/128)]. The task
// table is the GEMV's for N rows and K = nsel * I + Is.
cudaError_t jt_expert_down_all_reduce(
    int gid, int rank, cudaStream_t stream, const void* h,
    const float* weights, const int32_t* ids, const void* w,
    const float* scale, const void* shared_h, const void* shared_w,
    const float* shared_scale, const int32_t* table, void* y, int N, int nsel,
    int I, int E, int Is, int wdtype, int nwc, int rpw, int num_ctas,
    int max_tasks);

// Stacked-layer forms of the two calls above: w (and scale, shared_w,
// shared_scale) hold L layers, [L, N, K] / [L, E, N, I] / [L, N, Is] and
// scales [L, ...] likewise; `layer` and `layer_offset` each point to one
// int32 in device memory, the layer index being their sum (a layer loop's
// counter and the call site's place in the loop's trip). The kernel reads
// them and offsets its weight and scale pointers by layer * (one layer's
// size): the result is the call on that layer (negative counts from the end,
// then clamped into [0, L), like jnp's w[layer]). Nothing is read on the
// host: the launch is the same for every layer, so a traced layer loop needs
// no copy of the layer's weights, no index arithmetic and no
// synchronisation, and the launch can be captured in a CUDA graph.
cudaError_t jt_gemv_all_reduce_layer(int gid, int rank, cudaStream_t stream,
                                     const void* x, const void* w,
                                     const float* scale, const int32_t* layer,
                                     const int32_t* layer_offset, int L,
                                     const int32_t* table, void* y, int N,
                                     int K, int wdtype, int nwc, int rpw,
                                     int num_ctas, int max_tasks);
cudaError_t jt_expert_down_all_reduce_layer(
    int gid, int rank, cudaStream_t stream, const void* h,
    const float* weights, const int32_t* ids, const void* w,
    const float* scale, const void* shared_h, const void* shared_w,
    const float* shared_scale, const int32_t* layer,
    const int32_t* layer_offset, int L, const int32_t* table, void* y, int N,
    int nsel, int I, int E, int Is, int wdtype, int nwc, int rpw, int num_ctas,
    int max_tasks);

// Global top-k (k <= W*m) of the union of every rank's list of m (score,
// index) pairs, each list sorted by score desc then index asc; output in that
// order, bit-identical on all ranks.
cudaError_t jt_merge_topk(int gid, int rank, cudaStream_t stream,
                          const float* scores, const int32_t* indices,
                          float* out_scores, int32_t* out_indices, int m,
                          int k, int blocks, int threads);

// ---- single-GPU exact top-k (src/select.cu) ----

#define JT_TOPK_MAX_ROWS 8
#define JT_TOPK_MAX_K 8192
// mode bits of jt_topk_select
#define JT_TOPK_SORTED 1          // output by (score desc, index asc), else by index
#define JT_TOPK_CANONICAL_ZERO 2  // -0.0 counts as (and is returned as) +0.0
#define JT_TOPK_EMPTY_AS_MINUS_ONE 4  // position -1 where the score is not above -inf

// Allocates device `dev`'s top-k scratch (once; idempotent) and raises the
// kernel's shared-memory limit. `timeout_ms` bounds its barrier waits.
int jt_topk_prepare(int dev, int64_t timeout_ms, char* err, int errlen);
// CTAs per row that jt_topk_select would launch, or -1 if the shape is not
// supported (T > JT_TOPK_MAX_ROWS, k > n or k > JT_TOPK_MAX_K, not
// co-resident, no such cluster) or the device is not prepared. `ctas` > 0:
// the grid kernel with that many CTAs per row; < 0: one thread-block cluster
// of -ctas CTAs per row; 0: a cluster of 16 (8 where the GPU runs no 16) if
// the row fits (n <= 12288 per CTA: 196608), else the grid kernel with about
// one CTA per SM in all.
int jt_topk_select_ctas(int dev, int T, int n, int k, int mode, int ctas);
// Cluster size jt_topk_select would launch with (0: the grid kernel), or -1
// as above.
int jt_topk_select_cluster(int dev, int T, int n, int k, int mode, int ctas);
// Copies device `dev`'s top-k status record into `out`; returns 0 or -1.
int jt_topk_status(int dev, JtStatus* out);
// Exact top-k of every row of scores [T, n] (fp32): the k (index, value)
// pairs lax.top_k returns (ties toward the lower index; total order of the
// bits), written to out_idx / out_val [T, k]. One launch: cooperative (grid
// kernel) or of T clusters.
cudaError_t jt_topk_select(int dev, cudaStream_t stream, const float* scores,
                           int32_t* out_idx, float* out_val, int T, int n,
                           int k, int mode, int ctas);

// Dynamic shared memory (bytes) that jt_gemv_all_reduce needs.
int64_t jt_gemv_smem_bytes(int K, int tile_rows, int max_tasks);
// ---- the MoE router's selection (src/route.cu) ----
#define JT_ROUTE_MAX_EXPERTS 1024
// jtilert.ops.reference.select_experts of the logits sum_s partials[s]
// (partials [S, T, E] fp32: the router GEMV's split-K parts, summed in order
// s = 0, 1, ..) with the bias row `*layer + *layer_offset` of bias [L, E]
// fp32 (two device int32s): weights [T, k] fp32 and expert ids [T, k] int32, in
// descending order of the biased scores. One launch, one CTA per row;
// cudaErrorInvalidValue for shapes it does not take (E > JT_ROUTE_MAX_EXPERTS,
// E % n_group != 0, k > E).
cudaError_t jt_route_select(cudaStream_t stream, const float* partials, int S,
                            const float* bias, const int32_t* layer,
                            const int32_t* layer_offset, int T, int E, int n_group, int topk_group, int k,
                            float scaling, int norm, float* out_w,
                            int32_t* out_ids);

// A MoE layer's router in one launch (src/route.cu): f = rms_norm(x [T, H]
// bf16, norm_w[l] bf16, eps) written to out_f [T, H] bf16, the logits
// f . gate[l]^T (gate [L, E, H] bf16, fp32 sums) and jt_route_select's
// selection with bias[l] (l = *layer + *layer_offset) into out_w / out_ids
// [T, k]. cudaErrorInvalidValue for shapes it does not take (T >
// JT_ROUTE_MAX_TOKENS, E > JT_ROUTE_MAX_ROUTER_EXPERTS or more than 4 experts
// an SM, H > JT_ROUTE_MAX_HIDDEN or not a multiple of 8). Calls on one device
// must not overlap (a device-global scratch and arrival counter).
#define JT_ROUTE_MAX_TOKENS 8
#define JT_ROUTE_MAX_HIDDEN 8192
#define JT_ROUTE_MAX_ROUTER_EXPERTS 256
cudaError_t jt_norm_route(cudaStream_t stream, const void* x, const void* norm_w, const void* gate,
                          const float* bias, const int32_t* layer, const int32_t* layer_offset, int T, int E,
                          int H, float eps, int n_group, int topk_group, int k, float scaling, int norm,
                          void* out_f, float* out_w, int32_t* out_ids);

// ---- a MoE layer's experts for one decode token (src/moe.cu) ----
#define JT_MOE_CTAS 128          // one persistent launch of this many CTAs (all resident)
#define JT_MOE_MAX_VEC 8192      // H and (k + 1) * I at most
#define JT_MOE_MAX_SEGMENTS 12   // k routed experts + the shared one
// The operands, all in device memory. fp8 (e4m3) weights with fp32 128 x 128
// block scales, stacked over L layers: gate/up [L, E, I, H] (scales
// [L, E, I/128, H/128]), down [L, E, H, I] (scales [L, E, H/128, I/128]); the
// shared expert's the same without E. f, residual, out: [H] bf16 (one token);
// weights [k] fp32 and ids [k] int32 (the router's); the layer: *layer +
// *layer_offset, two int32s.
typedef struct JtMoeArgs {
  const void* f;
  const float* weights;
  const int32_t* ids;
  const uint8_t *gate, *up, *down, *shared_gate, *shared_up, *shared_down;
  const float *gate_scale, *up_scale, *down_scale, *shared_gate_scale, *shared_up_scale, *shared_down_scale;
  const void* residual;
  const int32_t* layer;
  const int32_t* layer_offset;
  void* out;
} JtMoeArgs;
// Why the kernel does not take these shapes (a static string), or NULL.
const char* jt_moe_unsupported(int H, int I, int k);
// out = residual + sum_j weights[j] Down[ids[j]] h_j + SharedDown h_s with
// h_e = bf16(silu(bf16(f Gate_e^T)) * bf16(f Up_e^T)), at layer *layer +
// *layer_offset (negative from the end, then clamped; ids clamped into [0, E)). One launch of
// JT_MOE_CTAS CTAs, which wait for each other (at most timeout_ms, then the
// kernel traps): the GPU needs that many SMs free of other long work, and
// calls on one device must not overlap (they share the library's scratch
// vector). Needs jt_prepare_device on the device first.
// cudaErrorInvalidValue for shapes jt_moe_unsupported refuses.
cudaError_t jt_moe_decode(cudaStream_t stream, const JtMoeArgs* args, int L, int E, int H, int I, int k,
                          int64_t timeout_ms);

// ---- L2 prefetch of one layer of stacked weights (src/prefetch.cu) ----
#define JT_PREFETCH_MAX_ARRAYS 8
// For each array a < n (1 <= n <= JT_PREFETCH_MAX_ARRAYS), a stack of
// layers[a] layers of layer_bytes[a] bytes at bases[a]: prefetches that
// array's bytes [l * layer_bytes[a], (l + 1) * layer_bytes[a]) into L2, l the
// sum of the int32s at `layer` and `layer_offset` (device memory, read by the
// kernel; negative from the end, then clamped into [0, layers[a])). One launch that only issues the requests
// (cp.async.bulk.prefetch.L2) and writes token[0] = 0 (device int32): nothing
// waits for the lines to land and no result changes. The launch depends on
// the shapes only, not on the layer: safe in CUDA graphs.
cudaError_t jt_prefetch_l2(cudaStream_t stream, const int32_t* layer,
                           const int32_t* layer_offset, int n,
                           const void* const* bases, const int64_t* layer_bytes,
                           const int32_t* layers, int32_t* token);

// ---- the token ring: a step's new tokens for the host (src/ring.cu) ----
#define JT_RING_SLOTS 64
#define JT_RING_SLOT_INTS 8
#define JT_RING_MAX_VALUES (JT_RING_SLOT_INTS - 2)
// Device `dev`'s ring, allocated once (host-mapped pinned memory, every key
// -1): JT_RING_SLOTS slots of JT_RING_SLOT_INTS int32s, slot[0] the key (a
// step's position), slot[1] the count, slot[2..] the values. Returns the host
// pointer, or null with the reason in `err`.
int32_t* jt_token_ring(int dev, char* err, int errlen);
// One launch: into slot *pos mod JT_RING_SLOTS of device `dev`'s ring, values
// [n_values] (1 <= n_values <= JT_RING_MAX_VALUES), the count (*count, or
// n_values where count is null), then the key *pos, the key last and visible
// to the host after the rest; next[0] = *pos + the count (device int32). pos,
// values, count and next are device memory. cudaErrorNotReady where
// jt_token_ring(dev) was never called. The same launch for every step: safe
// in CUDA graphs.
cudaError_t jt_token_ring_write(cudaStream_t stream, int dev, const int32_t* pos,
                                const int32_t* values, int n_values,
                                const int32_t* count, int32_t* next);

// Largest list length m that jt_merge_topk supports for `world` ranks on `dev`.
int jt_merge_topk_max_k(int dev, int world);

#pragma GCC visibility pop

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // JTILERT_ENGINE_H_
