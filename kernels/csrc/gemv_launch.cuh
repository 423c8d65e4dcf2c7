// Host-side launcher of one GEMV instantiation. Defined here, instantiated in
// gemv_{fp16,bf16}_k{1,2,4}.cu (separate translation units build in parallel).
#pragma once

#include <algorithm>
#include <atomic>

#include "gemv.cuh"
#include "launch.cuh"
#include "woq_kernels.h"

namespace woq {

template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
cudaError_t gemv_launch(const GemvArgs& a, cudaStream_t stream) {
  using Shape = TileShape<BITS, KW>;
  const PackedWeight& w = a.weight;
  auto kernel = gemv_kernel<T, BITS, MB, KW, GROUP, ZEROS>;
  // The shared memory follows M (StageLayout), and so may the blocks an SM holds: the
  // occupancy is queried once per M, after one opt-in for the largest M.
  const int smem = gemv_smem_bytes<T, BITS, MB, KW, GROUP, ZEROS>(a.M);
  static std::atomic<int> resident_by_m[kGemvMaxM + 1];  // 0: not queried yet
  int resident = resident_by_m[a.M].load(std::memory_order_relaxed);
  if (resident == 0) {
    resident = resident_blocks(kernel, kGemvWarps * 32, smem, gemv_smem_bytes<T, BITS, MB, KW, GROUP, ZEROS>(8 * MB));
    if (resident < 1) return cudaErrorInvalidConfiguration;
    resident_by_m[a.M].store(resident, std::memory_order_relaxed);
  }
  GemvParams p;
  set_operands(p, a);
  p.nstages = (w.K_pad + Shape::kStageK - 1) / Shape::kStageK;
  p.unit_stages = GROUP > Shape::kStageK ? GROUP / Shape::kStageK : 1;  // groups never straddle blocks
  const int columns = (p.n_tiles + Shape::kTiles - 1) / Shape::kTiles;
  const long long units = static_cast<long long>(columns) * (p.nstages / p.unit_stages);
  if (units > (1LL << 30)) return cudaErrorInvalidValue;  // the kernel's partition is 32-bit
  p.units = static_cast<int>(units);
  // One resident wave, unless asked for fewer blocks; never more than the workspace holds.
  long long blocks = a.max_blocks > 0 ? a.max_blocks : static_cast<long long>(resident) * gemv_sm_count();
  const long long ws_blocks = a.workspace_floats / (2LL * a.M * gemv_column_channels(KW));
  blocks = std::min(std::min(blocks, units), std::max(1LL, ws_blocks));
  return launch_kernel(kernel, static_cast<unsigned>(blocks), kGemvWarps * 32, smem, stream, p);
}

// Every instantiation the dispatcher (woq_kernels.cu) may call, for one activation type:
// each (group size, with / without zero points) of each (bits, row blocks, k-warps).
#define WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, GROUP)                                            \
  template cudaError_t gemv_launch<T, BITS, MB, KW, GROUP, false>(const GemvArgs&, cudaStream_t); \
  template cudaError_t gemv_launch<T, BITS, MB, KW, GROUP, true>(const GemvArgs&, cudaStream_t);

// The GEMV (M <= 8, <= 16): per-channel and group sizes 32..256.
#define WOQ_GEMV_INSTANTIATE_BITS_MB(T, BITS, MB, KW) \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 0)           \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 32)          \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 64)          \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 128)         \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 256)

// One translation unit per (activation type, k-warps): they build in parallel.
#define WOQ_GEMV_INSTANTIATE(T, KW)         \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 4, 1, KW) \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 4, 2, KW) \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 8, 1, KW) \
  WOQ_GEMV_INSTANTIATE_BITS_MB(T, 8, 2, KW)

// M = 17..32 (MB = 3, 4): the formats the mixed GEMM takes (per-channel, g64, g128),
// which are the ones whose choice between the two is measured; 1 or 2 k-warps (at 4, the
// int4 stage's 1024 columns of 32 rows of x would not fit the shared memory).
#define WOQ_GEMV_WIDE_INSTANTIATE_BITS_MB(T, BITS, MB, KW) \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 0)                \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 64)               \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 128)

#define WOQ_GEMV_WIDE_INSTANTIATE_KW(T, KW)      \
  WOQ_GEMV_WIDE_INSTANTIATE_BITS_MB(T, 4, 3, KW) \
  WOQ_GEMV_WIDE_INSTANTIATE_BITS_MB(T, 4, 4, KW) \
  WOQ_GEMV_WIDE_INSTANTIATE_BITS_MB(T, 8, 3, KW) \
  WOQ_GEMV_WIDE_INSTANTIATE_BITS_MB(T, 8, 4, KW)

}  // namespace woq
