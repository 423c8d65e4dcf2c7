// Host-side launcher of one GEMV instantiation. Defined here, instantiated in
// gemv_fp16.cu / gemv_bf16.cu (separate translation units build in parallel).
#pragma once

#include "gemv.cuh"
#include "woq_kernels.h"

namespace woq {

// Stages per split-K slice: a multiple of the stages one group spans, so that every
// slice starts on a group boundary.
template <int BITS, int GROUP>
int gemv_stages_per_split(int nstages, int split_k) {
  constexpr int kSK = TileShape<BITS>::kStageK;
  const int align = (GROUP > kSK) ? GROUP / kSK : 1;
  int per = (nstages + split_k - 1) / split_k;
  return (per + align - 1) / align * align;
}

template <typename T, int BITS, int MB, int GROUP, bool ZEROS>
cudaError_t gemv_launch(const GemvArgs& a, cudaStream_t stream) {
  using Shape = TileShape<BITS>;
  const PackedWeight& w = a.weight;
  GemvParams p;
  p.x = a.x;
  p.w = static_cast<const uint4*>(w.qweight);
  p.scales = w.scales;
  p.zeros = w.zeros;
  p.bias = a.bias;
  p.y = a.y;
  p.workspace = a.workspace;
  p.counters = a.counters;
  p.M = a.M;
  p.N = w.N;
  p.K = w.K;
  p.K_pad = w.K_pad;
  p.n_tiles = (w.N + 15) / 16;
  p.groups_pad = w.groups_pad;
  const int nstages = (w.K_pad + Shape::kStageK - 1) / Shape::kStageK;
  p.stages_per_split = gemv_stages_per_split<BITS, GROUP>(nstages, a.split_k < 1 ? 1 : a.split_k);
  p.split_k = (nstages + p.stages_per_split - 1) / p.stages_per_split;  // no empty slices
  constexpr int smem = gemv_smem_bytes<T, BITS, MB, GROUP, ZEROS>();
  auto kernel = gemv_kernel<T, BITS, MB, GROUP, ZEROS>;
  if constexpr (smem > 48 * 1024) {
    static bool configured = false;  // once per instantiation (per process: one device family)
    if (!configured) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      configured = true;
    }
  }
  if (p.split_k > 1 && (a.workspace == nullptr || a.counters == nullptr)) return cudaErrorInvalidValue;
  dim3 grid(gemv_grid_columns(w.N), p.split_k);
  kernel<<<grid, kGemvWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

// Every instantiation the dispatcher (woq_kernels.cu) may call, for one activation type.
#define WOQ_GEMV_INSTANTIATE_BITS_MB(T, BITS, MB)                                          \
  template cudaError_t gemv_launch<T, BITS, MB, 0, false>(const GemvArgs&, cudaStream_t);   \
  template cudaError_t gemv_launch<T, BITS, MB, 0, true>(const GemvArgs&, cudaStream_t);    \
  template cudaError_t gemv_launch<T, BITS, MB, 32, false>(const GemvArgs&, cudaStream_t);  \
  template cudaError_t gemv_launch<T, BITS, MB, 32, true>(const GemvArgs&, cudaStream_t);   \
  template cudaError_t gemv_launch<T, BITS, MB, 64, false>(const GemvArgs&, cudaStream_t);  \
  template cudaError_t gemv_launch<T, BITS, MB, 64, true>(const GemvArgs&, cudaStream_t);   \
  template cudaError_t gemv_launch<T, BITS, MB, 128, false>(const GemvArgs&, cudaStream_t); \
  template cudaError_t gemv_launch<T, BITS, MB, 128, true>(const GemvArgs&, cudaStream_t);  \
  template cudaError_t gemv_launch<T, BITS, MB, 256, false>(const GemvArgs&, cudaStream_t); \
  template cudaError_t gemv_launch<T, BITS, MB, 256, true>(const GemvArgs&, cudaStream_t);

#define WOQ_GEMV_INSTANTIATE(T)              \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 4, 1)      \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 4, 2)      \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 8, 1)      \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 8, 2)

}  // namespace woq
