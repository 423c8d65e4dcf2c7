// Launcher of the persistent batch-1 decode step (decode_step.cuh).
#include <algorithm>
#include <atomic>

#include "decode_step.cuh"
#include "launch.cuh"
#include "woq_kernels.h"

namespace woq {

int decode_step_counters(int n_layers) { return n_layers * step::kStages + 1; }

namespace {

// One block per SM; its shared memory: the region (the attention role's tiles, or the
// largest x a stage takes; h's copy; then the layers' pointers), then as many ring slots
// as fit, up to kMaxSlots (or max_slots).
template <typename T, int BITS, int GROUP, bool ZEROS, bool TP>
cudaError_t launch_step(const DecodeStepArgs& a, cudaStream_t stream) {
  using SlotT = step::Slot<BITS, GROUP>;
  auto kernel = decode_step_kernel<T, BITS, GROUP, ZEROS, TP>;
  DecodeStepParams p;
  p.layers = a.layers;
  p.n_layers = a.n_layers;
  p.h = a.h;
  p.x_qkv = a.qkv;
  p.attn = a.attn;
  p.act = a.act;
  p.slots = a.slots;
  p.lengths = a.lengths;
  p.positions = a.positions;
  p.counters = a.counters;
  p.stamps = a.stamps;
  p.hidden = a.hidden;
  p.inter = a.inter;
  p.roles = a.roles;
  p.kv_heads = a.kv_heads;
  p.cache_hints = a.cache_hints;
  p.eps = a.eps;
  if (a.world < 1 || a.world > kPeerMaxRanks || a.rank < 0 || a.rank >= a.world ||
      (a.world > 1 && a.n_layers > kStepPeerMaxLayers))
    return cudaErrorInvalidValue;
  p.rank = a.rank;
  p.world = a.world;
  for (int r = 0; r < kPeerMaxRanks; ++r) {
    p.peer_area[r] = static_cast<unsigned char*>(r < a.world ? a.peer_area[r] : nullptr);
    if (a.world > 1 && r < a.world && (a.peer_area[r] == nullptr || reinterpret_cast<uintptr_t>(a.peer_area[r]) % 16))
      return cudaErrorInvalidValue;
  }
  const int grid = gemv_sm_count();
  // (the attention's smem at the largest group the roles take)
  const int attention = attention_smem_bytes<T>(kStepMaxHeadDim, kAttentionMaxGroup);
  const int x_bytes = std::max(a.hidden, a.inter) * static_cast<int>(sizeof(T));
  const int table_bytes = a.n_layers * static_cast<int>(sizeof(step::LayerPointers));
  p.residual_offset = (std::max(attention, x_bytes) + 15) / 16 * 16;
  const int residual_bytes = a.hidden * static_cast<int>(sizeof(T));
  p.region_bytes = (p.residual_offset + residual_bytes + table_bytes + 127) / 128 * 128;
  const int limit = shared_memory_budget().per_block - static_smem_bytes(kernel);
  p.slots_in_ring = std::min(a.max_slots > 0 ? a.max_slots : step::kMaxSlots,
                             std::min(step::kMaxSlots, (limit - p.region_bytes) / SlotT::kBytes));
  if (p.slots_in_ring < 2) return cudaErrorInvalidConfiguration;
  const int smem = p.region_bytes + p.slots_in_ring * SlotT::kBytes;
  int rotation = 0;
  for (int i = 0; i < step::kLinears; ++i) {
    // (a block's outputs of a stage are staged in shared memory for their bulk stores)
    if ((a.n_tiles[i] + grid - 1) / grid > step::kMaxStagedUnits) return cudaErrorInvalidConfiguration;
    p.rotation[i] = rotation % grid;
    rotation += a.n_tiles[i];
    p.n_tiles[i] = a.n_tiles[i];
    p.ktiles[i] = a.ktiles[i];
    p.groups_pad[i] = a.groups_pad[i];
  }
  if (a.roles < 1 || a.roles > grid) return cudaErrorCooperativeLaunchTooLarge;
  if (a.stamps != nullptr && a.stamps_per_row != grid) return cudaErrorInvalidValue;
  // Every block may wait for every other: one resident block per SM, checked once per
  // shared-memory size (the query, which also opts the kernel into that much, is host time).
  static std::atomic<long long> checked{-1};  // smem << 8 | resident blocks per SM
  long long c = checked.load(std::memory_order_relaxed);
  if (c < 0 || (c >> 8) != smem) {
    c = (static_cast<long long>(smem) << 8) | std::min(resident_blocks(kernel, step::kThreads, smem, limit), 255);
    checked.store(c, std::memory_order_relaxed);
  }
  if ((c & 255) < 1) return cudaErrorCooperativeLaunchTooLarge;
  return launch_kernel(kernel, static_cast<unsigned>(grid), step::kThreads, smem, stream, p);
}

template <bool TP>
cudaError_t launch_format(const DecodeStepArgs& a, cudaStream_t stream) {
  if (a.dtype == DType::kFloat16)
    return a.zeros ? launch_step<__half, 4, 128, true, TP>(a, stream) : launch_step<__half, 4, 128, false, TP>(a, stream);
  return a.zeros ? launch_step<__nv_bfloat16, 4, 128, true, TP>(a, stream)
                 : launch_step<__nv_bfloat16, 4, 128, false, TP>(a, stream);
}

}  // namespace

cudaError_t launch_decode_step(const DecodeStepArgs& a, cudaStream_t stream) {
  if (device_cc_major() < 9) return cudaErrorNotSupported;
  if (a.bits != 4 || a.group_size != 128) return cudaErrorNotSupported;
  if (a.hidden % 16 != 0 || a.hidden > kStepMaxHidden || a.inter % 16 != 0 || a.n_layers < 1) return cudaErrorInvalidValue;
  if (a.world > 1) return launch_format<true>(a, stream);
  return launch_format<false>(a, stream);
}

}  // namespace woq
