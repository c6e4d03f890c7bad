// XLA FFI handlers: thin wrappers that find the caller's group and rank from
// the device ordinal and launch on XLA's stream. Every call site launches the
// same work every time (all state lives in device memory), so the handlers
// are marked command-buffer compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "jtilert/engine.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// exported handler symbols (the library is built with hidden visibility)
#define JT_EXPORT extern "C" __attribute__((visibility("default")))
JT_EXPORT XLA_FFI_Error* JtAllReduce(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtGemvAllReduce(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtMergeTopk(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtTopkSelect(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtRouteSelect(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtNormRoute(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtPrefetchL2(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtTokenRing(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtMoeDecode(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtExpertDownAllReduce(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtGemvAllReduceStacked(XLA_FFI_CallFrame* call_frame);
JT_EXPORT XLA_FFI_Error* JtExpertDownAllReduceStacked(
    XLA_FFI_CallFrame* call_frame);

namespace {

ffi::Error cuda_error(cudaError_t e, const char* what) {
  return ffi::Error::Internal(std::string("jtilert ") + what + ": " +
                              cudaGetErrorString(e));
}

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return JT_F32;
    case ffi::DataType::BF16: return JT_BF16;
    case ffi::DataType::F16: return JT_F16;
    case ffi::DataType::F8E4M3FN: return JT_F8E4M3;
    default: return -1;
  }
}

// Makes `dev` current for the runtime API if it is not already.
cudaError_t ensure_device(int dev) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return e;
  if (cur != dev) return cudaSetDevice(dev);
  return cudaSuccess;
}

ffi::Error find_rank(ffi::Span<const int32_t> groups, int32_t world,
                     int32_t dev, int* gid, int* rank) {
  if (world < 1 || groups.size() % (size_t)world != 0)
    return ffi::Error::InvalidArgument("jtilert: malformed groups attribute");
  const int ngroups = (int)(groups.size() / (size_t)world);
  *gid = jt_group_lookup(groups.begin(), ngroups, world, dev, rank);
  if (*gid < 0)
    return ffi::Error::Internal(
        "jtilert: no engine group for device " + std::to_string(dev) +
        " (was jtilert.ffi set up in this process?)");
  JtStatus st;
  if (jt_group_status(*gid, *rank, &st) == 0 && st.code != 0)
    return ffi::Error::Internal(
        "jtilert: an earlier engine kernel timed out waiting for rank " +
        std::to_string(st.src) + " (epoch " + std::to_string(st.epoch) + ")");
  return ffi::Error::Success();
}

// Group and rank of the caller (gid -1: world 1, no group), device made
// current: what every GEMV-kernel launch needs first.
ffi::Error gemv_rank(ffi::Span<const int32_t> groups, int32_t world,
                     int32_t dev, int* gid, int* rank) {
  *gid = -1;
  *rank = 0;
  if (world > 1) {
    ffi::Error err = find_rank(groups, world, dev, gid, rank);
    if (!err.success()) return err;
  }
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  return ffi::Error::Success();
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t dev, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y,
                         ffi::Span<const int32_t> groups, int32_t world,
                         int32_t algo, int32_t blocks, int32_t threads) {
  const int dt = dtype_code(x.element_type());
  if (dt != JT_F32 && dt != JT_BF16 && dt != JT_F16)
    return ffi::Error::InvalidArgument("jtilert all_reduce: unsupported dtype");
  if (y->element_type() != x.element_type() ||
      y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("jtilert all_reduce: shape mismatch");
  int gid = -1, rank = -1;
  ffi::Error err = find_rank(groups, world, dev, &gid, &rank);
  if (!err.success()) return err;
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  e = jt_all_reduce(gid, rank, stream, x.untyped_data(), y->untyped_data(),
                    (int64_t)x.element_count(), dt, algo, blocks, threads);
  if (e != cudaSuccess) return cuda_error(e, "all_reduce launch");
  return ffi::Error::Success();
}

// The stacked form's layer operands: base and offset, one int32 each in device
// memory, the layer their sum (a layer loop's counter and the call site's
// place in the loop's trip). The kernel reads and adds them; the handler only
// passes their addresses on.
struct LayerPtrs {
  const int32_t* base = nullptr;
  const int32_t* offset = nullptr;
};

ffi::Error layer_operands(const ffi::AnyBuffer& base,
                          const ffi::AnyBuffer& offset, const char* op,
                          LayerPtrs* ptrs) {
  for (const ffi::AnyBuffer* b : {&base, &offset})
    if (b->element_type() != ffi::DataType::S32 || b->element_count() != 1)
      return ffi::Error::InvalidArgument(
          std::string("jtilert ") + op +
          ": the layer and its offset must be one int32 each");
  ptrs->base = static_cast<const int32_t*>(base.untyped_data());
  ptrs->offset = static_cast<const int32_t*>(offset.untyped_data());
  return ffi::Error::Success();
}

int64_t blocks128(int64_t n) { return (n + 127) / 128; }

// GEMV + all-reduce; `layer.base` null: w [N, K], else w [L, N, K] (scales
// likewise) and `layer` the device addresses of the layer's two parts.
ffi::Error GemvCommon(cudaStream_t stream, int32_t dev, ffi::AnyBuffer x,
                      ffi::AnyBuffer w, ffi::AnyBuffer scale,
                      ffi::AnyBuffer table, LayerPtrs layer,
                      ffi::Result<ffi::AnyBuffer> y,
                      ffi::Span<const int32_t> groups, int32_t world,
                      int32_t nwc, int32_t rpw, int32_t num_ctas,
                      int32_t max_tasks, int32_t has_scale) {
  if (x.element_type() != ffi::DataType::BF16 ||
      y->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("jtilert gemv: x and y must be bf16");
  const int wdt = dtype_code(w.element_type());
  if (wdt != JT_BF16 && wdt != JT_F8E4M3)
    return ffi::Error::InvalidArgument("jtilert gemv: w must be bf16 or fp8");
  auto wd = w.dimensions();
  const size_t lead = layer.base != nullptr ? 1 : 0;  // the layer axis
  if (wd.size() != 2 + lead)
    return ffi::Error::InvalidArgument(
        lead ? "jtilert gemv: stacked w must be 3-D [L, N, K]"
                         : "jtilert gemv: w must be 2-D");
  const int L = lead ? (int)wd[0] : 1;
  const int N = (int)wd[lead];
  const int K = (int)wd[lead + 1];
  if ((int64_t)x.element_count() != K || (int64_t)y->element_count() != N)
    return ffi::Error::InvalidArgument("jtilert gemv: shape mismatch");
  if (table.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jtilert gemv: table must be int32");
  if (has_scale && scale.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jtilert gemv: scale must be f32");
  if (has_scale && lead &&
      (int64_t)scale.element_count() != L * blocks128(N) * blocks128(K))
    return ffi::Error::InvalidArgument(
        "jtilert gemv: stacked scale must be [L, ceil(N/128), ceil(K/128)]");
  if (wdt == JT_F8E4M3 && !has_scale)
    return ffi::Error::InvalidArgument("jtilert gemv: fp8 needs scales");
  int gid, rank;
  ffi::Error err = gemv_rank(groups, world, dev, &gid, &rank);
  if (!err.success()) return err;
  const float* s =
      has_scale ? static_cast<const float*>(scale.untyped_data()) : nullptr;
  const int32_t* t = static_cast<const int32_t*>(table.untyped_data());
  cudaError_t e =
      lead ? jt_gemv_all_reduce_layer(gid, rank, stream, x.untyped_data(),
                                      w.untyped_data(), s, layer.base,
                                      layer.offset, L, t, y->untyped_data(), N,
                                      K, wdt, nwc, rpw, num_ctas, max_tasks)
          : jt_gemv_all_reduce(gid, rank, stream, x.untyped_data(),
                               w.untyped_data(), s, t, y->untyped_data(), N,
                               K, wdt, nwc, rpw, num_ctas, max_tasks);
  if (e != cudaSuccess) return cuda_error(e, "gemv launch");
  return ffi::Error::Success();
}

ffi::Error GemvAllReduceImpl(cudaStream_t stream, int32_t dev,
                             ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::AnyBuffer scale, ffi::AnyBuffer table,
                             ffi::Result<ffi::AnyBuffer> y,
                             ffi::Span<const int32_t> groups, int32_t world,
                             int32_t nwc, int32_t rpw, int32_t num_ctas,
                             int32_t max_tasks, int32_t has_scale) {
  return GemvCommon(stream, dev, x, w, scale, table, LayerPtrs{}, y, groups,
                    world, nwc, rpw, num_ctas, max_tasks, has_scale);
}

// Stacked weights: w [L, N, K] and the layer (base, offset) as the last two
// operands.
ffi::Error GemvAllReduceStackedImpl(
    cudaStream_t stream, int32_t dev, ffi::AnyBuffer x, ffi::AnyBuffer w,
    ffi::AnyBuffer scale, ffi::AnyBuffer table, ffi::AnyBuffer layer,
    ffi::AnyBuffer layer_offset, ffi::Result<ffi::AnyBuffer> y,
    ffi::Span<const int32_t> groups, int32_t world, int32_t nwc, int32_t rpw,
    int32_t num_ctas, int32_t max_tasks, int32_t has_scale) {
  LayerPtrs l;
  ffi::Error err = layer_operands(layer, layer_offset, "gemv", &l);
  if (!err.success()) return err;
  return GemvCommon(stream, dev, x, w, scale, table, l, y, groups, world, nwc,
                    rpw, num_ctas, max_tasks, has_scale);
}

// MoE down projection + shared expert + all-reduce (expert-down mode of the
// GEMV kernel): h [nsel, I], weights [nsel] f32, ids [nsel] s32, down
// [E, N, I], shared_h [Is], shared_down [N, Is] (+ scales when fp8); with
// `layer` (device addresses of the layer's two parts), down [L, E, N, I] and
// shared_down [L, N, Is], their scales likewise.
ffi::Error ExpertDownCommon(
    cudaStream_t stream, int32_t dev, ffi::AnyBuffer h, ffi::AnyBuffer weights,
    ffi::AnyBuffer ids, ffi::AnyBuffer down, ffi::AnyBuffer down_scale,
    ffi::AnyBuffer shared_h, ffi::AnyBuffer shared_down,
    ffi::AnyBuffer shared_scale, ffi::AnyBuffer table, LayerPtrs layer,
    ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int32_t> groups,
    int32_t world, int32_t nwc, int32_t rpw, int32_t num_ctas,
    int32_t max_tasks, int32_t has_scale) {
  const auto bf16 = ffi::DataType::BF16;
  if (h.element_type() != bf16 || shared_h.element_type() != bf16 ||
      y->element_type() != bf16)
    return ffi::Error::InvalidArgument(
        "jtilert expert_down: h, shared_h and y must be bf16");
  if (weights.element_type() != ffi::DataType::F32 ||
      ids.element_type() != ffi::DataType::S32 ||
      table.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument(
        "jtilert expert_down: weights f32, ids and table int32");
  const int wdt = dtype_code(down.element_type());
  if ((wdt != JT_BF16 && wdt != JT_F8E4M3) ||
      shared_down.element_type() != down.element_type())
    return ffi::Error::InvalidArgument(
        "jtilert expert_down: down and shared_down both bf16 or both fp8");
  if (wdt == JT_F8E4M3 && !has_scale)
    return ffi::Error::InvalidArgument("jtilert expert_down: fp8 needs scales");
  if (has_scale && (down_scale.element_type() != ffi::DataType::F32 ||
                    shared_scale.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("jtilert expert_down: scales must be f32");
  auto dd = down.dimensions();
  auto sd = shared_down.dimensions();
  const size_t lead = layer.base != nullptr ? 1 : 0;  // the layer axis
  if (dd.size() != 3 + lead || sd.size() != 2 + lead ||
      sd[lead] != dd[lead + 1] || (lead && sd[0] != dd[0]))
    return ffi::Error::InvalidArgument(
        lead ? "jtilert expert_down: down [L, E, N, I], "
                           "shared_down [L, N, Is]"
                         : "jtilert expert_down: down [E, N, I], "
                           "shared_down [N, Is]");
  const int L = lead ? (int)dd[0] : 1;
  const int E = (int)dd[lead], N = (int)dd[lead + 1], I = (int)dd[lead + 2],
            Is = (int)sd[lead + 1];
  const int64_t nsel = (int64_t)ids.element_count();
  if ((int64_t)weights.element_count() != nsel ||
      (int64_t)h.element_count() != nsel * I ||
      (int64_t)shared_h.element_count() != Is ||
      (int64_t)y->element_count() != N)
    return ffi::Error::InvalidArgument("jtilert expert_down: shape mismatch");
  if (has_scale && lead &&
      ((int64_t)down_scale.element_count() !=
           (int64_t)L * E * blocks128(N) * blocks128(I) ||
       (int64_t)shared_scale.element_count() !=
           L * blocks128(N) * blocks128(Is)))
    return ffi::Error::InvalidArgument(
        "jtilert expert_down: stacked scales must be [L, E, ceil(N/128), "
        "ceil(I/128)] and [L, ceil(N/128), ceil(Is/128)]");
  int gid, rank;
  ffi::Error err = gemv_rank(groups, world, dev, &gid, &rank);
  if (!err.success()) return err;
  const float* ds =
      has_scale ? static_cast<const float*>(down_scale.untyped_data()) : nullptr;
  const float* ss = has_scale
                        ? static_cast<const float*>(shared_scale.untyped_data())
                        : nullptr;
  const float* wts = static_cast<const float*>(weights.untyped_data());
  const int32_t* id = static_cast<const int32_t*>(ids.untyped_data());
  const int32_t* t = static_cast<const int32_t*>(table.untyped_data());
  cudaError_t e =
      lead ? jt_expert_down_all_reduce_layer(
                 gid, rank, stream, h.untyped_data(), wts, id,
                 down.untyped_data(), ds, shared_h.untyped_data(),
                 shared_down.untyped_data(), ss, layer.base, layer.offset, L,
                 t, y->untyped_data(), N, (int)nsel, I, E, Is, wdt, nwc, rpw,
                 num_ctas, max_tasks)
          : jt_expert_down_all_reduce(
                gid, rank, stream, h.untyped_data(), wts, id,
                down.untyped_data(), ds, shared_h.untyped_data(),
                shared_down.untyped_data(), ss, t, y->untyped_data(), N,
                (int)nsel, I, E, Is, wdt, nwc, rpw, num_ctas, max_tasks);
  if (e != cudaSuccess) return cuda_error(e, "expert_down launch");
  return ffi::Error::Success();
}

ffi::Error ExpertDownAllReduceImpl(
    cudaStream_t stream, int32_t dev, ffi::AnyBuffer h, ffi::AnyBuffer weights,
    ffi::AnyBuffer ids, ffi::AnyBuffer down, ffi::AnyBuffer down_scale,
    ffi::AnyBuffer shared_h, ffi::AnyBuffer shared_down,
    ffi::AnyBuffer shared_scale, ffi::AnyBuffer table,
    ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int32_t> groups,
    int32_t world, int32_t nwc, int32_t rpw, int32_t num_ctas,
    int32_t max_tasks, int32_t has_scale) {
  return ExpertDownCommon(stream, dev, h, weights, ids, down, down_scale,
                          shared_h, shared_down, shared_scale, table,
                          LayerPtrs{}, y, groups, world, nwc, rpw, num_ctas,
                          max_tasks, has_scale);
}

// Stacked weights (down [L, E, N, I], shared_down [L, N, Is], scales
// likewise) and the layer (base, offset) as the last two operands.
ffi::Error ExpertDownAllReduceStackedImpl(
    cudaStream_t stream, int32_t dev, ffi::AnyBuffer h, ffi::AnyBuffer weights,
    ffi::AnyBuffer ids, ffi::AnyBuffer down, ffi::AnyBuffer down_scale,
    ffi::AnyBuffer shared_h, ffi::AnyBuffer shared_down,
    ffi::AnyBuffer shared_scale, ffi::AnyBuffer table, ffi::AnyBuffer layer,
    ffi::AnyBuffer layer_offset, ffi::Result<ffi::AnyBuffer> y, ffi::Span<const int32_t> groups,
    int32_t world, int32_t nwc, int32_t rpw, int32_t num_ctas,
    int32_t max_tasks, int32_t has_scale) {
  LayerPtrs l;
  ffi::Error err = layer_operands(layer, layer_offset, "expert_down", &l);
  if (!err.success()) return err;
  return ExpertDownCommon(stream, dev, h, weights, ids, down, down_scale,
                          shared_h, shared_down, shared_scale, table, l, y,
                          groups, world, nwc, rpw, num_ctas, max_tasks,
                          has_scale);
}

ffi::Error MergeTopkImpl(cudaStream_t stream, int32_t dev,
                         ffi::Buffer<ffi::F32> scores,
                         ffi::Buffer<ffi::S32> indices,
                         ffi::Result<ffi::Buffer<ffi::F32>> out_scores,
                         ffi::Result<ffi::Buffer<ffi::S32>> out_indices,
                         ffi::Span<const int32_t> groups, int32_t world,
                         int32_t blocks, int32_t threads) {
  const int64_t m = (int64_t)scores.element_count();
  const int64_t k = (int64_t)out_scores->element_count();
  if ((int64_t)indices.element_count() != m ||
      (int64_t)out_indices->element_count() != k || k > m * world)
    return ffi::Error::InvalidArgument("jtilert merge_topk: shape mismatch");
  int gid = -1, rank = -1;
  ffi::Error err = find_rank(groups, world, dev, &gid, &rank);
  if (!err.success()) return err;
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  e = jt_merge_topk(gid, rank, stream, scores.typed_data(),
                    indices.typed_data(), out_scores->typed_data(),
                    out_indices->typed_data(), (int)m, (int)k, blocks,
                    threads);
  if (e != cudaSuccess) return cuda_error(e, "merge_topk launch");
  return ffi::Error::Success();
}

// Exact top-k of scores [T, n]: indices [T, k] int32 and values [T, k] f32.
// The device's scratch is allocated when the call is lowered (Python side).
ffi::Error TopkSelectImpl(cudaStream_t stream, int32_t dev,
                          ffi::Buffer<ffi::F32> scores,
                          ffi::Result<ffi::Buffer<ffi::S32>> out_idx,
                          ffi::Result<ffi::Buffer<ffi::F32>> out_val,
                          int32_t mode, int32_t ctas) {
  auto sd = scores.dimensions();
  auto od = out_idx->dimensions();
  if (sd.size() != 2 || od.size() != 2 || od[0] != sd[0] ||
      out_val->element_count() != out_idx->element_count())
    return ffi::Error::InvalidArgument("jtilert topk_select: shape mismatch");
  JtStatus st;
  if (jt_topk_status(dev, &st) != 0)
    return ffi::Error::Internal("jtilert topk_select: device " +
                                std::to_string(dev) + " not prepared");
  if (st.code != 0)
    return ffi::Error::Internal(
        "jtilert topk_select: an earlier call timed out at a barrier (row " +
        std::to_string(st.rank) + ")");
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  e = jt_topk_select(dev, stream, scores.typed_data(), out_idx->typed_data(),
                     out_val->typed_data(), (int)sd[0], (int)sd[1], (int)od[1],
                     mode, ctas);
  if (e != cudaSuccess) return cuda_error(e, "topk_select launch");
  return ffi::Error::Success();
}

// The MoE router's selection: the router GEMV's split-K partial logits
// [S, T, E] f32 (summed in order), the bias stack [L, E] f32 and the layer
// (base and offset, int32 [1] each, on the device) -> weights [T, k] f32,
// ids [T, k].
ffi::Error RouteSelectImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> partials,
                           ffi::Buffer<ffi::F32> bias,
                           ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> layer_offset,
                           ffi::Result<ffi::Buffer<ffi::F32>> out_w,
                           ffi::Result<ffi::Buffer<ffi::S32>> out_ids,
                           int32_t n_group, int32_t topk_group, int32_t norm,
                           float scaling) {
  auto pd = partials.dimensions();
  auto bd = bias.dimensions();
  auto od = out_ids->dimensions();
  if (pd.size() != 3 || bd.size() != 2 || bd[1] != pd[2] || od.size() != 2 ||
      od[0] != pd[1] || out_w->element_count() != out_ids->element_count() ||
      layer.element_count() != 1 || layer_offset.element_count() != 1)
    return ffi::Error::InvalidArgument("jtilert route_select: shape mismatch");
  cudaError_t e = jt_route_select(
      stream, partials.typed_data(), (int)pd[0], bias.typed_data(),
      layer.typed_data(), layer_offset.typed_data(), (int)pd[1], (int)pd[2], n_group, topk_group,
      (int)od[1], scaling, norm, out_w->typed_data(), out_ids->typed_data());
  if (e != cudaSuccess) return cuda_error(e, "route_select launch");
  return ffi::Error::Success();
}

// A MoE layer's router (src/route.cu): x [T, H] bf16, the norm weight stack
// [L, H] bf16, the gate stack [L, E, H] bf16, the bias stack [L, E] f32 and
// the layer (base and offset, s32 [1] each) -> f [T, H] bf16 (x normed),
// weights [T, k] f32, ids [T, k] s32.
ffi::Error NormRouteImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> norm_w,
                         ffi::Buffer<ffi::BF16> gate, ffi::Buffer<ffi::F32> bias,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> layer_offset,
                         ffi::Result<ffi::Buffer<ffi::BF16>> out_f,
                         ffi::Result<ffi::Buffer<ffi::F32>> out_w,
                         ffi::Result<ffi::Buffer<ffi::S32>> out_ids, float eps, int32_t n_group,
                         int32_t topk_group, int32_t norm, float scaling) {
  auto xd = x.dimensions();
  auto nd = norm_w.dimensions();
  auto gd = gate.dimensions();
  auto bd = bias.dimensions();
  auto od = out_ids->dimensions();
  if (xd.size() != 2 || nd.size() != 2 || gd.size() != 3 || bd.size() != 2 || od.size() != 2 ||
      nd[1] != xd[1] || gd[2] != xd[1] || gd[0] != nd[0] || bd[0] != gd[0] || bd[1] != gd[1] ||
      od[0] != xd[0] || out_w->element_count() != out_ids->element_count() ||
      out_f->element_count() != x.element_count() || layer.element_count() != 1 ||
      layer_offset.element_count() != 1)
    return ffi::Error::InvalidArgument("jtilert norm_route: shape mismatch");
  cudaError_t e = jt_norm_route(stream, x.untyped_data(), norm_w.untyped_data(), gate.untyped_data(),
                                bias.typed_data(), layer.typed_data(), layer_offset.typed_data(), (int)xd[0],
                                (int)gd[1], (int)xd[1], eps, n_group, topk_group, (int)od[1], scaling, norm,
                                out_f->untyped_data(), out_w->typed_data(), out_ids->typed_data());
  if (e != cudaSuccess) return cuda_error(e, "norm_route launch");
  return ffi::Error::Success();
}

// A MoE layer's experts for one decode token (src/moe.cu): f [1, H] bf16,
// weights [1, k] f32, ids [1, k] s32, the routed gate/up [L, E, I, H] and down
// [L, E, H, I] fp8 with their f32 block scales, the shared expert's [L, I, H] /
// [L, H, I] likewise, residual [1, H] bf16, the layer (base and offset, s32
// [1] each) -> out [1, H] bf16.
ffi::Error MoeDecodeImpl(cudaStream_t stream, ffi::AnyBuffer f, ffi::Buffer<ffi::F32> weights,
                         ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer gate, ffi::Buffer<ffi::F32> gate_scale,
                         ffi::AnyBuffer up, ffi::Buffer<ffi::F32> up_scale, ffi::AnyBuffer down,
                         ffi::Buffer<ffi::F32> down_scale, ffi::AnyBuffer shared_gate,
                         ffi::Buffer<ffi::F32> shared_gate_scale, ffi::AnyBuffer shared_up,
                         ffi::Buffer<ffi::F32> shared_up_scale, ffi::AnyBuffer shared_down,
                         ffi::Buffer<ffi::F32> shared_down_scale, ffi::AnyBuffer residual,
                         ffi::AnyBuffer layer, ffi::AnyBuffer layer_offset, ffi::Result<ffi::AnyBuffer> out,
                         int64_t timeout_ms) {
  LayerPtrs l;
  ffi::Error err = layer_operands(layer, layer_offset, "moe_decode", &l);
  if (!err.success()) return err;
  auto gd = gate.dimensions(), dd = down.dimensions(), sd = shared_gate.dimensions();
  if (gd.size() != 4 || dd.size() != 4 || sd.size() != 3)
    return ffi::Error::InvalidArgument("jtilert moe_decode: gate/up/down [L, E, ., .], shared [L, ., .]");
  const int64_t L = gd[0], E = gd[1], I = gd[2], H = gd[3], k = (int64_t)ids.element_count();
  auto count = [](const auto& b) { return (int64_t)b.element_count(); };
  const int64_t ib = blocks128(I), hb = blocks128(H);
  bool ok = f.element_type() == ffi::DataType::BF16 && residual.element_type() == ffi::DataType::BF16 &&
            out->element_type() == ffi::DataType::BF16 && count(f) == H &&
            count(residual) == H && count(*out) == H && count(weights) == k;
  for (const ffi::AnyBuffer* w : {&gate, &up, &down, &shared_gate, &shared_up, &shared_down})
    ok = ok && w->element_type() == ffi::DataType::F8E4M3FN;
  ok = ok && count(up) == count(gate) && dd[0] == L && dd[1] == E && dd[2] == H && dd[3] == I &&
       sd[0] == L && sd[1] == I && sd[2] == H && count(shared_up) == count(shared_gate) &&
       count(shared_down) == count(shared_gate) &&
       count(gate_scale) == L * E * ib * hb && count(up_scale) == L * E * ib * hb &&
       count(down_scale) == L * E * hb * ib && count(shared_gate_scale) == L * ib * hb &&
       count(shared_up_scale) == L * ib * hb && count(shared_down_scale) == L * hb * ib;
  if (!ok) return ffi::Error::InvalidArgument("jtilert moe_decode: shape or dtype mismatch");
  if (const char* why = jt_moe_unsupported((int)H, (int)I, (int)k))
    return ffi::Error::InvalidArgument(std::string("jtilert moe_decode: ") + why);
  auto u8 = [](const ffi::AnyBuffer& b) { return static_cast<const uint8_t*>(b.untyped_data()); };
  const JtMoeArgs a{f.untyped_data(), weights.typed_data(), ids.typed_data(), u8(gate), u8(up), u8(down),
                    u8(shared_gate), u8(shared_up), u8(shared_down), gate_scale.typed_data(),
                    up_scale.typed_data(), down_scale.typed_data(), shared_gate_scale.typed_data(),
                    shared_up_scale.typed_data(), shared_down_scale.typed_data(), residual.untyped_data(), l.base,
                    l.offset, out->untyped_data()};
  cudaError_t e = jt_moe_decode(stream, &a, (int)L, (int)E, (int)H, (int)I, (int)k, timeout_ms);
  if (e != cudaSuccess) return cuda_error(e, "moe_decode launch");
  return ffi::Error::Success();
}

// True for the element types XLA packs several to a byte (their buffers are
// smaller than element_count() bytes, so a layer's byte range is not known).
bool packed_subbyte(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return true;
    default:
      return false;
  }
}

// L2 prefetch of layer `layer` + `layer_offset` (int32 [1] each, on the
// device) of every remaining
// operand, each a stack [L, ...] (L its leading dimension, one layer = its
// bytes / L). `after` is not read: it only makes XLA run the call after the
// op that produces it. The token (int32 [1]) is written 0 by the kernel.
// Everything the launch needs comes from the buffers' addresses and shapes:
// the same work on every call.
ffi::Error PrefetchL2Impl(cudaStream_t stream, int32_t dev,
                          ffi::AnyBuffer layer, ffi::AnyBuffer layer_offset,
                          ffi::AnyBuffer after, ffi::RemainingArgs arrays,
                          ffi::Result<ffi::AnyBuffer> token) {
  (void)after;
  LayerPtrs l;
  ffi::Error err = layer_operands(layer, layer_offset, "prefetch_l2", &l);
  if (!err.success()) return err;
  if (token->element_type() != ffi::DataType::S32 ||
      token->element_count() != 1)
    return ffi::Error::InvalidArgument(
        "jtilert prefetch_l2: the token must be one int32");
  const size_t n = arrays.size();
  if (n < 1 || n > JT_PREFETCH_MAX_ARRAYS)
    return ffi::Error::InvalidArgument(
        "jtilert prefetch_l2: 1 to " + std::to_string(JT_PREFETCH_MAX_ARRAYS) +
        " arrays, got " + std::to_string(n));
  const void* bases[JT_PREFETCH_MAX_ARRAYS];
  int64_t layer_bytes[JT_PREFETCH_MAX_ARRAYS];
  int32_t layers[JT_PREFETCH_MAX_ARRAYS];
  for (size_t a = 0; a < n; ++a) {
    ffi::ErrorOr<ffi::AnyBuffer> b = arrays.get<ffi::AnyBuffer>(a);
    if (!b.has_value()) return b.error();
    auto dims = b->dimensions();
    if (dims.size() < 2 || dims[0] < 1 || packed_subbyte(b->element_type())) {
      std::string shape = "[";
      for (size_t d = 0; d < dims.size(); ++d)
        shape += (d ? ", " : "") + std::to_string(dims[d]);
      return ffi::Error::InvalidArgument(
          "jtilert prefetch_l2: array " + std::to_string(a) + " of shape " +
          shape + "] is not a layer stack [L, ...] (at least 2-D, L >= 1, a "
          "whole-byte type)");
    }
    bases[a] = b->untyped_data();
    layers[a] = (int32_t)dims[0];
    layer_bytes[a] = (int64_t)(b->size_bytes() / (size_t)dims[0]);
  }
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  e = jt_prefetch_l2(stream, l.base, l.offset, (int)n, bases, layer_bytes, layers,
                     static_cast<int32_t*>(token->untyped_data()));
  if (e != cudaSuccess) return cuda_error(e, "prefetch_l2 launch");
  return ffi::Error::Success();
}

// A step's new tokens into the device's token ring (src/ring.cu): `values`
// (int32, 1 to JT_RING_MAX_VALUES of them) and `count` (one int32: how many
// of them are the step's) under the key `pos` (one int32). The result (int32
// [1]) is the next step's position, pos + count, written over pos (the
// lowering aliases them, jtilert/ffi/ring.py). The same launch on every
// call.
ffi::Error TokenRingImpl(cudaStream_t stream, int32_t dev, ffi::AnyBuffer pos,
                         ffi::AnyBuffer values, ffi::AnyBuffer count,
                         ffi::Result<ffi::AnyBuffer> next) {
  auto one_int = [](const ffi::AnyBuffer& b) {
    return b.element_type() == ffi::DataType::S32 && b.element_count() == 1;
  };
  if (!one_int(pos) || !one_int(count) || !one_int(*next))
    return ffi::Error::InvalidArgument(
        "jtilert token_ring: pos, count and the next position must be one int32 each");
  const size_t n = values.element_count();
  if (values.element_type() != ffi::DataType::S32 || n < 1 ||
      n > JT_RING_MAX_VALUES)
    return ffi::Error::InvalidArgument(
        "jtilert token_ring: 1 to " + std::to_string(JT_RING_MAX_VALUES) +
        " int32 values, got " + std::to_string(n));
  cudaError_t e = ensure_device(dev);
  if (e != cudaSuccess) return cuda_error(e, "set device");
  e = jt_token_ring_write(stream, dev, static_cast<const int32_t*>(pos.untyped_data()),
                          static_cast<const int32_t*>(values.untyped_data()), (int)n,
                          static_cast<const int32_t*>(count.untyped_data()),
                          static_cast<int32_t*>(next->untyped_data()));
  if (e == cudaErrorNotReady)
    return ffi::Error::Internal(
        "jtilert token_ring: no token ring on device " + std::to_string(dev) +
        " (jtilert.ffi.ring.TokenRing(device) makes it)");
  if (e != cudaSuccess) return cuda_error(e, "token_ring launch");
  return ffi::Error::Success();
}

}  // namespace

// The context of the handlers that use per-device state: XLA's compute stream
// and the device ordinal (the route selection and the one-launch MoE take the
// stream alone). b by reference: a binding has no public move constructor.
template <typename Binding>
auto stream_and_device(Binding&& b) {
  return std::move(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtAllReduce, AllReduceImpl,
                              stream_and_device(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int32_t>>("groups")
                                  .Attr<int32_t>("world")
                                  .Attr<int32_t>("algo")
                                  .Attr<int32_t>("blocks")
                                  .Attr<int32_t>("threads"),
                              {ffi::Traits::kCmdBufferCompatible});

// The attributes of every handler that launches the GEMV kernel on a task
// table (jtilert/ffi/ops.py, _task_table_lowering).
template <typename Binding>
auto task_table_attrs(Binding b) {
  return std::move(b)
      .template Attr<ffi::Span<const int32_t>>("groups")
      .template Attr<int32_t>("world")
      .template Attr<int32_t>("nwc")
      .template Attr<int32_t>("rpw")
      .template Attr<int32_t>("num_ctas")
      .template Attr<int32_t>("max_tasks")
      .template Attr<int32_t>("has_scale");
}

// The task-table GEMV handlers' context and operands: x, the weights ([N, K];
// stacked [L, N, K]), their scales and the task table.
template <typename Binding>
auto gemv_operands(Binding b) {
  return stream_and_device(std::move(b))
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()   // w
      .template Arg<ffi::AnyBuffer>()   // scale
      .template Arg<ffi::AnyBuffer>();  // table
}

// The expert-down handlers' context and operands: the routed experts' hidden
// vectors, routing weights and ids, the down stack and its scales, the shared
// expert's hidden vector, down weight and scales, and the task table.
template <typename Binding>
auto expert_down_operands(Binding b) {
  return stream_and_device(std::move(b))
      .template Arg<ffi::AnyBuffer>()   // h
      .template Arg<ffi::AnyBuffer>()   // weights
      .template Arg<ffi::AnyBuffer>()   // ids
      .template Arg<ffi::AnyBuffer>()   // down
      .template Arg<ffi::AnyBuffer>()   // down_scale
      .template Arg<ffi::AnyBuffer>()   // shared_h
      .template Arg<ffi::AnyBuffer>()   // shared_down
      .template Arg<ffi::AnyBuffer>()   // shared_scale
      .template Arg<ffi::AnyBuffer>();  // table
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtGemvAllReduce, GemvAllReduceImpl,
                              task_table_attrs(gemv_operands(ffi::Ffi::Bind()).Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtMergeTopk, MergeTopkImpl,
                              stream_and_device(ffi::Ffi::Bind())
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<ffi::Span<const int32_t>>("groups")
                                  .Attr<int32_t>("world")
                                  .Attr<int32_t>("blocks")
                                  .Attr<int32_t>("threads"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtExpertDownAllReduce, ExpertDownAllReduceImpl,
                              task_table_attrs(expert_down_operands(ffi::Ffi::Bind()).Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

// Stacked-layer forms: the same operands plus the layer (base and offset,
// int32 [1] each) after the task table.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtGemvAllReduceStacked, GemvAllReduceStackedImpl,
                              task_table_attrs(gemv_operands(ffi::Ffi::Bind())
                                                   .Arg<ffi::AnyBuffer>()  // layer
                                                   .Arg<ffi::AnyBuffer>()  // layer offset
                                                   .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtExpertDownAllReduceStacked,
                              ExpertDownAllReduceStackedImpl,
                              task_table_attrs(expert_down_operands(ffi::Ffi::Bind())
                                                   .Arg<ffi::AnyBuffer>()  // layer
                                                   .Arg<ffi::AnyBuffer>()  // layer offset
                                                   .Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtTopkSelect, TopkSelectImpl,
                              stream_and_device(ffi::Ffi::Bind())
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("ctas"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtRouteSelect, RouteSelectImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias stack
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer offset
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("n_group")
                                  .Attr<int32_t>("topk_group")
                                  .Attr<int32_t>("norm")
                                  .Attr<float>("scaling"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtNormRoute, NormRouteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // norm weight stack
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // gate stack
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias stack
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer offset
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // f
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("n_group")
                                  .Attr<int32_t>("topk_group")
                                  .Attr<int32_t>("norm")
                                  .Attr<float>("scaling"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtMoeDecode, MoeDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()               // f
                                  .Arg<ffi::Buffer<ffi::F32>>()        // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()        // ids
                                  .Arg<ffi::AnyBuffer>()               // gate
                                  .Arg<ffi::Buffer<ffi::F32>>()        // gate scale
                                  .Arg<ffi::AnyBuffer>()               // up
                                  .Arg<ffi::Buffer<ffi::F32>>()        // up scale
                                  .Arg<ffi::AnyBuffer>()               // down
                                  .Arg<ffi::Buffer<ffi::F32>>()        // down scale
                                  .Arg<ffi::AnyBuffer>()               // shared gate
                                  .Arg<ffi::Buffer<ffi::F32>>()        // its scale
                                  .Arg<ffi::AnyBuffer>()               // shared up
                                  .Arg<ffi::Buffer<ffi::F32>>()        // its scale
                                  .Arg<ffi::AnyBuffer>()               // shared down
                                  .Arg<ffi::Buffer<ffi::F32>>()        // its scale
                                  .Arg<ffi::AnyBuffer>()               // residual
                                  .Arg<ffi::AnyBuffer>()               // layer
                                  .Arg<ffi::AnyBuffer>()               // layer offset
                                  .Ret<ffi::AnyBuffer>()               // out
                                  .Attr<int64_t>("timeout_ms"),
                              {ffi::Traits::kCmdBufferCompatible});

// L2 prefetch: the layer (base, offset), the ordering operand, then 1 to
// JT_PREFETCH_MAX_ARRAYS layer stacks; no attributes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtPrefetchL2, PrefetchL2Impl,
                              stream_and_device(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Arg<ffi::AnyBuffer>()  // layer offset
                                  .Arg<ffi::AnyBuffer>()  // after
                                  .RemainingArgs()        // the stacks
                                  .Ret<ffi::AnyBuffer>(),  // token
                              {ffi::Traits::kCmdBufferCompatible});

// Token ring: the key (pos), the values, their count; the next position.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtTokenRing, TokenRingImpl,
                              stream_and_device(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()   // pos
                                  .Arg<ffi::AnyBuffer>()   // values
                                  .Arg<ffi::AnyBuffer>()   // count
                                  .Ret<ffi::AnyBuffer>(),  // next position
                              {ffi::Traits::kCmdBufferCompatible});
