// Host-side launcher of one mixed-GEMM instantiation. Defined here, instantiated in
// gemm_{fp16,bf16}_c{0..9}.cu (one translation unit per activation type and tile
// configuration: they build in parallel).
#pragma once

#include <algorithm>

#include "gemm.cuh"
#include "launch.cuh"
#include "tensor_map.cuh"
#include "woq_kernels.h"

namespace woq {

// The tensor maps of a wgmma configuration's stages (GemmParams: tm_w, tm_x, tm_s, tm_z);
// false where the driver refuses one (the kernel then copies with cp.async).
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
bool set_tensor_maps(GemmParams& p) {
  using Shape = GemmShape<CFG>;
  using Stage = GemmStage<T, BITS, CFG, GROUP, ZEROS>;
  const cuuint64_t ktiles = static_cast<cuuint64_t>(p.K_pad / TileShape<BITS>::kK);
  const cuuint64_t n_tiles = static_cast<cuuint64_t>(p.n_tiles);
  const cuuint64_t w_dims[3] = {128, ktiles, n_tiles}, w_strides[2] = {512, ktiles * 512};
  const cuuint32_t w_box[3] = {128, Stage::kSegs, Shape::kTiles};
  const cuuint64_t x_dims[2] = {static_cast<cuuint64_t>(p.K), static_cast<cuuint64_t>(p.M)};
  const cuuint64_t x_strides[1] = {static_cast<cuuint64_t>(p.K) * sizeof(T)};
  const cuuint32_t x_box[2] = {64, Shape::kBM};
  bool ok = encode_tensor_map(&p.tm_w, p.w, true, 3, w_dims, w_strides, w_box, false) &&
            encode_tensor_map(&p.tm_x, p.x, false, 2, x_dims, x_strides, x_box, true);
  if (Stage::kGroups > 0) {
    const cuuint64_t s_dims[2] = {static_cast<cuuint64_t>(p.groups_pad) * 16, n_tiles};
    const cuuint64_t s_strides[1] = {static_cast<cuuint64_t>(p.groups_pad) * 32};
    const cuuint32_t s_box[2] = {static_cast<cuuint32_t>(Stage::kGroups * 16), Shape::kTiles};
    ok = ok && encode_tensor_map(&p.tm_s, p.scales, false, 2, s_dims, s_strides, s_box, false) &&
         (!ZEROS || encode_tensor_map(&p.tm_z, p.zeros, false, 2, s_dims, s_strides, s_box, false));
  }
  return ok;
}

template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
cudaError_t gemm_launch(const GemmArgs& a, cudaStream_t stream) {
  using Shape = GemmShape<CFG>;
  const PackedWeight& w = a.weight;
  using Stage = GemmStage<T, BITS, CFG, GROUP, ZEROS>;
  auto kernel = gemm_kernel<T, BITS, CFG, GROUP, ZEROS>;
  if (Shape::kWgmma && !wgmma_available()) return cudaErrorNotSupported;
  // (wgmma: the kernel aligns the ring to 1024 bytes; the slack counts as fixed usage)
  constexpr int kSlack = Stage::kAlign > 16 ? Stage::kAlign : 0;
  // The deepest ring (<= 4 stages) with which the blocks per SM the configuration is built
  // for fit (an H100: 4 stages, or 3 for two blocks of config 3's int8 tile; an A100: 3 for
  // config 2's one block); else the deepest one block takes (an RTX 30/40's 99 KB: config
  // 3's tiles 2 or 3 deep, alone on the SM).
  static PlanCache plan_cache;
  const LaunchPlan plan = plan_cache.get([&] {
    const SharedMemoryBudget budget = shared_memory_budget();
    const int static_bytes = static_smem_bytes(kernel) + kSlack;
    int stages = ring_stages(budget, Stage::kBytes, static_bytes, kGemmMaxStages, Shape::kMinBlocks);
    if (stages == 0) stages = ring_stages(budget, Stage::kBytes, static_bytes, kGemmMaxStages, 1);
    // (wgmma keeps one stage fewer in flight than the ring holds: gemm.cuh, so 3 at least)
    if (stages == 0 || (Shape::kWgmma && stages < 3)) return LaunchPlan{0, 0};
    return LaunchPlan{stages, resident_blocks(kernel, kGemmWarps * 32, stages * Stage::kBytes + kSlack)};
  });
  if (plan.resident < 1) return cudaErrorInvalidConfiguration;
  const int smem = plan.stages * Stage::kBytes + kSlack;
  const int resident = plan.resident;  // blocks per SM
  GemmParams p;
  set_operands(p, a);
  p.stamps = a.stamps;
  p.stamps_len = a.stamps_len;
  p.nstages = (w.K_pad + Stage::kK - 1) / Stage::kK;
  p.m_tiles = (a.M + Shape::kBM - 1) / Shape::kBM;
  const long long columns = (p.n_tiles + Shape::kTiles - 1) / Shape::kTiles;
  const long long tiles = columns * p.m_tiles;
  const long long units = tiles * p.nstages;
  // Blocks: one resident wave (`splits` 0, stream-K) or `splits` per tile, each block at
  // least 2 stages; as many as the workspace (two partial tiles per block) holds. One
  // block per tile needs no workspace, and is what remains when the counters (one per
  // tile) are too few.
  const long long slots = static_cast<long long>(resident) * gemv_sm_count();
  const long long tile_floats = static_cast<long long>(Shape::kBM) * Shape::kBN;
  long long blocks = a.splits > 0 ? tiles * a.splits : slots;
  blocks = std::min(blocks, std::max(tiles, units / 2));
  blocks = std::min(blocks, a.workspace_floats / (2 * tile_floats));
  if (blocks < 1 || tiles > a.counters_len) blocks = tiles;
  if (units > (1LL << 30)) return cudaErrorInvalidValue;
  p.units = static_cast<int>(units);
  p.stages = plan.stages;
  p.tma = Shape::kTensorCopies && set_tensor_maps<T, BITS, CFG, GROUP, ZEROS>(p);
  return launch_kernel(kernel, static_cast<unsigned>(blocks), kGemmWarps * 32, smem, stream, p);
}

// Per-channel and group sizes 64 / 128 (kGemmGroupSizes), with and without zero points,
// int4 and int8.
static_assert(kGemmGroupCount == 2 && kGemmGroupSizes[0] == 64 && kGemmGroupSizes[1] == 128,
              "WOQ_GEMM_INSTANTIATE_BITS and woq_kernels.cu's gemm_by_group list kGemmGroupSizes");
#define WOQ_GEMM_INSTANTIATE_GROUP(T, BITS, CFG, GROUP)                                         \
  template cudaError_t gemm_launch<T, BITS, CFG, GROUP, false>(const GemmArgs&, cudaStream_t); \
  template cudaError_t gemm_launch<T, BITS, CFG, GROUP, true>(const GemmArgs&, cudaStream_t);

#define WOQ_GEMM_INSTANTIATE_BITS(T, BITS, CFG)  \
  WOQ_GEMM_INSTANTIATE_GROUP(T, BITS, CFG, 0)    \
  WOQ_GEMM_INSTANTIATE_GROUP(T, BITS, CFG, 64)   \
  WOQ_GEMM_INSTANTIATE_GROUP(T, BITS, CFG, 128)

#define WOQ_GEMM_INSTANTIATE(T, CFG)     \
  WOQ_GEMM_INSTANTIATE_BITS(T, 4, CFG)   \
  WOQ_GEMM_INSTANTIATE_BITS(T, 8, CFG)

}  // namespace woq
