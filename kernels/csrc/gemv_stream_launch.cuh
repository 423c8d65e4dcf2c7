// Host-side launcher of one register-streaming GEMV instantiation (gemv_stream.cuh).
// Defined here, instantiated in gemv_stream_{fp16,bf16}_int{4,8}.cu.
#pragma once

#include <algorithm>
#include <atomic>

#include "gemv_stream.cuh"
#include "launch.cuh"
#include "woq_kernels.h"

namespace woq {

// The grid: columns of TPB n-tiles x `splits` runs of K. a.max_blocks asks for a grid
// (splits = max_blocks / columns; 0: about two blocks per SM). The splits are then cut
// to whole chunks per warp, to what the workspace holds, and raised until the block's x
// range fits the shared memory (8 rows of x over 14336 k are 229 KB).
template <typename T, int BITS, int TPB, int GROUP, bool ZEROS>
cudaError_t gemv_stream_launch(const GemvArgs& a, cudaStream_t stream) {
  using Smem = StreamSmem<T, BITS, TPB, GROUP>;
  constexpr int KW = Smem::kKW, CH = stream_chunk<BITS, GROUP>();
  auto kernel = gemv_stream_kernel<T, BITS, TPB, GROUP, ZEROS>;
  GemvStreamParams p;
  set_operands(p, a);
  p.swiglu = a.epilogue == GemvEpilogue::kSwiGLU;
  p.stamps = a.stamps;
  p.stamps_len = a.stamps_len;
  p.ktiles = a.weight.K_pad / TileShape<BITS>::kK;
  p.chunks = (p.ktiles + CH - 1) / CH;
  const int columns = (p.n_tiles + TPB - 1) / TPB;
  auto plan = [&](int splits) {  // whole chunks per warp; no block without any
    p.warp_chunks = (p.chunks + KW * splits - 1) / (KW * splits);
    p.splits = (p.chunks + KW * p.warp_chunks - 1) / (KW * p.warp_chunks);
  };
  const long long ws_splits = a.workspace_floats / (static_cast<long long>(columns) * a.M * 16 * TPB);
  int splits = a.max_blocks > 0 ? a.max_blocks / columns : 2 * gemv_sm_count() / columns;
  plan(static_cast<int>(std::max(1LL, std::min<long long>(splits, ws_splits))));
  // The per-block shared-memory limit, queried once per budget (set_shared_memory_limit):
  // three attribute queries per call would be host time on every eager decode step.
  static BudgetCached limit_cache;
  const int limit = static_cast<int>(limit_cache.get(
      [&] { return static_cast<uint32_t>(shared_memory_budget().per_block - static_smem_bytes(kernel)); }));
  while (Smem::bytes(a.M, p.warp_chunks) > limit && p.warp_chunks > 1) plan(2 * p.splits);
  const int smem = Smem::bytes(a.M, p.warp_chunks);
  if (smem > limit) return cudaErrorInvalidConfiguration;
  if (p.splits > 1 && p.splits > ws_splits) return cudaErrorInvalidValue;  // (the x range forced more)
  // The dynamic shared-memory opt-in, once per instantiation (raised if a larger x needs it).
  static std::atomic<int> opted_in{48 * 1024};
  if (smem > opted_in.load(std::memory_order_relaxed)) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit) != cudaSuccess) {
      cudaGetLastError();
      return cudaErrorInvalidConfiguration;
    }
    opted_in.store(limit, std::memory_order_relaxed);
  }
  return launch_kernel(kernel, static_cast<unsigned>(columns * p.splits), kGemvWarps * 32, smem, stream, p);
}

#define WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, GROUP)                                             \
  template cudaError_t gemv_stream_launch<T, BITS, TPB, GROUP, false>(const GemvArgs&, cudaStream_t); \
  template cudaError_t gemv_stream_launch<T, BITS, TPB, GROUP, true>(const GemvArgs&, cudaStream_t);
#define WOQ_STREAM_INSTANTIATE_TPB(T, BITS, TPB)  \
  WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, 0)   \
  WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, 32)  \
  WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, 64)  \
  WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, 128) \
  WOQ_STREAM_INSTANTIATE_GROUP(T, BITS, TPB, 256)
// One translation unit per (activation type, bits): every tile count and group size.
#define WOQ_STREAM_INSTANTIATE(T, BITS)  \
  WOQ_STREAM_INSTANTIATE_TPB(T, BITS, 1) \
  WOQ_STREAM_INSTANTIATE_TPB(T, BITS, 2) \
  WOQ_STREAM_INSTANTIATE_TPB(T, BITS, 4) \
  WOQ_STREAM_INSTANTIATE_TPB(T, BITS, 8)

}  // namespace woq
