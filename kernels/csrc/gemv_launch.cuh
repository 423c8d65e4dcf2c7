// Host-side launcher of one GEMV instantiation. Defined here, instantiated in
// gemv_{fp16,bf16}_k{1,2,4}.cu (separate translation units build in parallel).
#pragma once

#include <algorithm>

#include "gemv.cuh"
#include "launch.cuh"
#include "woq_kernels.h"

namespace woq {

template <typename T, int BITS, int MB, int KW, int GROUP, bool ZEROS>
cudaError_t gemv_launch(const GemvArgs& a, cudaStream_t stream) {
  using Shape = TileShape<BITS, KW>;
  using Stage = StageLayout<T, BITS, MB, KW, GROUP, ZEROS>;
  const PackedWeight& w = a.weight;
  auto kernel = gemv_kernel<T, BITS, MB, KW, GROUP, ZEROS>;
  // The stage follows M (StageLayout), and so may the ring depth and the blocks an SM
  // holds: planned once per M (and shared-memory budget). The opt-in is the most any M of
  // this instantiation may take, so that one M's plan never shrinks another's.
  static PlanCache plans[kGemvMaxM + 1];
  const LaunchPlan plan = plans[a.M].get([&] {
    const SharedMemoryBudget budget = shared_memory_budget();
    const int static_bytes = static_smem_bytes(kernel);
    const int stages = ring_stages(budget, Stage::bytes(a.M), Stage::kReduce + static_bytes, kGemvMaxStages, 1);
    if (stages == 0) return LaunchPlan{0, 0};
    const int opt_in = gemv_smem_bytes<T, BITS, MB, KW, GROUP, ZEROS>(8 * MB, kGemvMaxStages);  // (capped there)
    const int smem = gemv_smem_bytes<T, BITS, MB, KW, GROUP, ZEROS>(a.M, stages);
    return LaunchPlan{stages, resident_blocks(kernel, kGemvWarps * 32, smem, opt_in)};
  });
  if (plan.resident < 1) return cudaErrorInvalidConfiguration;
  const int smem = gemv_smem_bytes<T, BITS, MB, KW, GROUP, ZEROS>(a.M, plan.stages);
  GemvParams p;
  set_operands(p, a);
  p.swiglu = a.epilogue == GemvEpilogue::kSwiGLU;
  p.stamps = a.stamps;
  p.stamps_len = a.stamps_len;
  p.nstages = (w.K_pad + Shape::kStageK - 1) / Shape::kStageK;
  p.unit_stages = GROUP > Shape::kStageK ? GROUP / Shape::kStageK : 1;  // groups never straddle blocks
  const int columns = (p.n_tiles + Stage::kTiles - 1) / Stage::kTiles;
  const long long units = static_cast<long long>(columns) * (p.nstages / p.unit_stages);
  if (units > (1LL << 30)) return cudaErrorInvalidValue;  // the kernel's partition is 32-bit
  p.units = static_cast<int>(units);
  p.stages = plan.stages;
  // One resident wave, unless asked for fewer blocks; never more than the workspace holds.
  long long blocks = a.max_blocks > 0 ? a.max_blocks : static_cast<long long>(plan.resident) * gemv_sm_count();
  const long long ws_blocks = a.workspace_floats / (2LL * a.M * 16 * Stage::kTiles);
  blocks = std::min(std::min(blocks, units), std::max(1LL, ws_blocks));
  return launch_kernel(kernel, static_cast<unsigned>(blocks), kGemvWarps * 32, smem, stream, p);
}

// Every instantiation the dispatcher (woq_kernels.cu) may call, for one activation type:
// each (group size, with / without zero points) of each (bits, row blocks, k-warps).
#define WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, GROUP)                                            \
  template cudaError_t gemv_launch<T, BITS, MB, KW, GROUP, false>(const GemvArgs&, cudaStream_t); \
  template cudaError_t gemv_launch<T, BITS, MB, KW, GROUP, true>(const GemvArgs&, cudaStream_t);

// The group sizes instantiated: up to 16 rows every one the packer makes (per-channel,
// 32..256); at 17..32 rows (MB = 3, 4) those the mixed GEMM takes too (per-channel, g64,
// g128), which are the ones whose choice between the two is measured.
#define WOQ_GEMV_GEMM_GROUPS(T, BITS, MB, KW) \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 0)   \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 64)  \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 128)
#define WOQ_GEMV_ALL_GROUPS(T, BITS, MB, KW) \
  WOQ_GEMV_GEMM_GROUPS(T, BITS, MB, KW)      \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 32) \
  WOQ_INSTANTIATE_GROUP(T, BITS, MB, KW, 256)

// Both bit widths at two row-block counts, with the group list GROUPS.
#define WOQ_GEMV_INSTANTIATE_ROWS(GROUPS, T, MB_A, MB_B, KW) \
  GROUPS(T, 4, MB_A, KW) GROUPS(T, 4, MB_B, KW) GROUPS(T, 8, MB_A, KW) GROUPS(T, 8, MB_B, KW)

// One translation unit per (activation type, k-warps, row range): they build in parallel.
// M <= 16: gemv_{fp16,bf16}_k{1,2,4}.cu. M = 17..32: gemv_{fp16,bf16}_m32_k{1,2}.cu
// (kGemvWideMaxKWarps: at 4 k-warps a 32-row int4 stage is ~82 KB, 2 stages on an H100).
#define WOQ_GEMV_INSTANTIATE(T, KW) WOQ_GEMV_INSTANTIATE_ROWS(WOQ_GEMV_ALL_GROUPS, T, 1, 2, KW)
#define WOQ_GEMV_WIDE_INSTANTIATE_KW(T, KW) WOQ_GEMV_INSTANTIATE_ROWS(WOQ_GEMV_GEMM_GROUPS, T, 3, 4, KW)

}  // namespace woq
