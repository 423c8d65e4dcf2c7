// Mixed-input tensor-core GEMM for mid M (17 .. a few hundred rows):
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W int8/int4 in the GEMV's packed layout,
// x fp16/bf16, fp32 accumulation.
//
// Why a second kernel: the GEMV gives each warp one 16-channel n-tile and *all* rows, so
// every warp re-reads the whole activation tile from shared memory. Past 16 rows that
// traffic outgrows the weight stream (at 64 rows, 16 bytes of x per byte of int4 weight:
// the GEMV measured 2.4x its 16-row time on 28672 x 8192). Here a block owns a BM x BN
// output tile and its 8 warps a 2-D grid of warp tiles (WM along M, WN along N), so a
// converted weight fragment feeds MBW row blocks and a loaded x fragment feeds NTW
// n-tiles -- the classic GEMM reuse, in registers.
//
// Operand roles as in the GEMV ("y^T = W x^T"): weights are mma.m16n8k16's A operand
// (16 channels), x the B operand (8 rows). The weight layout (kernels/layout.py) already
// gives each lane its A fragments from one 16-byte load per 512-byte segment, so weights
// need no ldmatrix: cp.async puts a tile's segments in shared memory as they lie in
// global memory, and each lane reads back its own 16 bytes (conflict-free: a warp reads
// 512 contiguous bytes). x goes through ldmatrix.x4 from rows padded by 16 bytes.
//
// Tile configurations (chosen per shape and M by kernels/tuning.py):
//
//   config   WM x WN   warp tile (rows x channels)   block tile BM x BN   blocks/SM
//     0      1 x 8     32 x 32   (MBW 4, NTW 2)       32 x 256           1
//     1      2 x 4     32 x 64   (MBW 4, NTW 4)       64 x 256           1
//     2      2 x 4     64 x 32   (MBW 8, NTW 2)      128 x 128           1
//     3      2 x 4     32 x 32   (MBW 4, NTW 2)       64 x 128           2
//     4      1 x 8     32 x 16   (MBW 4, NTW 1)       32 x 128           2
//
// Every warp keeps MBW * NTW * 4 fp32 accumulators (64 for configs 1 and 2). Measured on
// the H100 (benchmarks/gemm_configs.py): 4 wins at M <= 32 on most shapes (more, smaller
// blocks: fewer SMs idle in the last wave), 0 on some int8 ones, 1 or 3 at M <= 64, 2
// beyond. A 128 x 64 tile with two blocks per SM never won by more than 4 % and was
// dropped (build time).
//
// Where the time goes (ncu, 28672 x 8192, M = 128, config 2): the tensor pipe is active
// 43 % of the cycles, ~240 TFLOP/s; the top stall is "wait" (fixed-latency dependencies
// between the converts and the mma), with 2 warps per scheduler. mma.sync on an H100
// reaches about half of its wgmma peak at best, so this kernel wins against dequantize +
// cuBLAS, and against fp16 cuBLAS only while the weight bytes dominate (M <= ~64-128).
//
// Group scales are applied to the converted weights, not to the accumulators:
// (code - z) is an exact small integer and the scale a T, so their product is exact in
// fp32 and one rounding to T gives exactly the weight dequant + cuBLAS would use
// (dequant.cuh rounds the fp32 product once too). One packed multiply per fragment
// register costs less than the GEMV's per-group fp32 rescaling of NTW * MBW * 4
// accumulators, and needs no second set of them. Per-channel scales stay on the fp32
// accumulators (applied once, at the end).
//
// Work decomposition: a stage is 128 k (two int4 / four int8 segments per n-tile); each
// block runs a contiguous, balanced range of one tile's stages ("split-K": `splits`
// blocks per tile when tiles alone do not fill the GPU). Blocks are numbered tile-major
// with the M tiles of one column adjacent, so the blocks that read the same weights run
// together and all but the first find them in L2. Split partials go to a workspace in
// fragment order (coalesced); the tile's last block adds them in split order
// (deterministic) and re-arms the tile's counter (CUDA-graph safe).
#pragma once

#include <cstdint>

#include "gemv.cuh"  // converters, fragment helpers, the acq_rel counter

namespace woq {

constexpr int kGemmWarps = 8;
constexpr int kGemmStageK = 128;  // k per pipeline stage
constexpr int kGemmMaxStages = 4;  // shared-memory ring depth, at most (gemm_launch.cuh)
constexpr int kGemmXStride = kGemmStageK + 8;  // +16 B per x row: conflict-free ldmatrix
constexpr int kGemmConfigs = 5;

// kMinBlocks: resident blocks per SM the configuration is built for (2: registers capped
// at 128 per thread, so 16 warps per SM hide latency; 1: 64 accumulators per thread).
template <int CFG>
struct GemmTile;
template <>
struct GemmTile<0> { static constexpr int kWM = 1, kMBW = 4, kNTW = 2, kMinBlocks = 1; };
template <>
struct GemmTile<1> { static constexpr int kWM = 2, kMBW = 4, kNTW = 4, kMinBlocks = 1; };
template <>
struct GemmTile<2> { static constexpr int kWM = 2, kMBW = 8, kNTW = 2, kMinBlocks = 1; };
template <>
struct GemmTile<3> { static constexpr int kWM = 2, kMBW = 4, kNTW = 2, kMinBlocks = 2; };
template <>
struct GemmTile<4> { static constexpr int kWM = 1, kMBW = 4, kNTW = 1, kMinBlocks = 2; };

template <int CFG>
struct GemmShape {
  static constexpr int kWM = GemmTile<CFG>::kWM, kWN = kGemmWarps / kWM;
  static constexpr int kMBW = GemmTile<CFG>::kMBW, kNTW = GemmTile<CFG>::kNTW;
  static constexpr int kBM = kWM * kMBW * 8;
  static constexpr int kBN = kWN * kNTW * 16;
  static constexpr int kTiles = kBN / 16;  // n-tiles per block
  static constexpr int kMinBlocks = GemmTile<CFG>::kMinBlocks;
};


struct GemmParams : KernelOperands {  // workspace: [tiles, splits, BM * BN] (splits > 1); counters: [tiles]
  int nstages;  // ceil(K_pad / kGemmStageK)
  int m_tiles;  // ceil(M / BM)
  int splits;   // blocks per output tile
  int stages;   // depth of the shared-memory ring, 2..kGemmMaxStages
};

// Shared memory of one stage, in bytes (every part a multiple of 16).
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
struct GemmStage {
  using Shape = GemmShape<CFG>;
  static constexpr int kSegs = kGemmStageK / TileShape<BITS>::kK;  // 512-byte segments per n-tile
  static constexpr int kGroups = GROUP == 0 ? 0 : kGemmStageK / GROUP;
  static constexpr int kW = Shape::kTiles * kSegs * 512;
  static constexpr int kX = Shape::kBM * kGemmXStride * static_cast<int>(sizeof(T));
  static constexpr int kS = Shape::kTiles * kGroups * 16 * static_cast<int>(sizeof(T));
  static constexpr int kZ = ZEROS ? kS : 0;
  static constexpr int kBytes = kW + kX + kS + kZ;
};

// Both halves of a packed pair set to its low (or high) half: one row's scale for the
// two k of a fragment register.
__device__ __forceinline__ uint32_t dup_lo(uint32_t u) { return prmt(u, u, 0x1010); }
__device__ __forceinline__ uint32_t dup_hi(uint32_t u) { return prmt(u, u, 0x3232); }

template <typename T>
__device__ __forceinline__ uint32_t mul_pair(uint32_t a, uint32_t s);
template <>
__device__ __forceinline__ uint32_t mul_pair<__half>(uint32_t a, uint32_t s) {
  return as_u32(__hmul2(as_h2(a), as_h2(s)));
}
template <>
__device__ __forceinline__ uint32_t mul_pair<__nv_bfloat16>(uint32_t a, uint32_t s) {
  return fma_bf16x2(a, s, 0x80008000u);  // a * s + (-0): one rounding (mul.bf16x2 is sm_90 only)
}

// GROUP: group size in k (64 or 128; a divisor of the stage), or 0 for per-channel.
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
__global__ void __launch_bounds__(kGemmWarps * 32, GemmTile<CFG>::kMinBlocks) gemm_kernel(const GemmParams p) {
#if WOQ_SM80  // sm_80+ only: a T4's 64 KB hold 2 stages of few tiles; it runs dequant + cuBLAS
  using Shape = GemmShape<CFG>;
  using Stage = GemmStage<T, BITS, CFG, GROUP, ZEROS>;
  constexpr int kThreads = kGemmWarps * 32;
  constexpr int BM = Shape::kBM, MBW = Shape::kMBW, NTW = Shape::kNTW, kTiles = Shape::kTiles;
  constexpr int KT = TileShape<BITS>::kK, KT16 = KT / 16, kSegs = Stage::kSegs;
  constexpr int XS = kGemmXStride;
  constexpr int kGroups = Stage::kGroups;
  constexpr int kGroupK = GROUP == 0 ? kGemmStageK : GROUP;  // (per-channel: as if one group a stage)
  static_assert(kGemmStageK % kGroupK == 0 && kGroupK % KT == 0, "a group is whole segments of a stage");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / Shape::kWN, warp_n = warp % Shape::kWN;
  const int gid = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.x % p.splits, tile_id = blockIdx.x / p.splits;
  const int m_tile = tile_id % p.m_tiles, column = tile_id / p.m_tiles;
  const int m0 = m_tile * BM, tile0 = column * kTiles;
  const int st_begin = split * p.nstages / p.splits, st_end = (split + 1) * p.nstages / p.splits;
  const int ktiles = p.K_pad / KT;

  extern __shared__ uint4 smem[];
  __shared__ int is_last_split;
  const T* x = static_cast<const T*>(p.x);
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  // The cp.async copies of stage `st` into ring slot `slot`, in two parts: what is
  // constant while serving (weights, scales, zero points) and the activations, which the
  // previous kernel may still be writing (launch.cuh). Every part is a run of 16-byte
  // chunks, chunk c to thread c % kThreads; out-of-range chunks are zero-filled (zero
  // codes convert to finite values, and they meet zero-filled x).
  auto fetch_weights = [&](int st, int slot) {
    const uint32_t base = smem_addr + slot * Stage::kBytes;
    // weights: each n-tile's kSegs segments of this stage lie contiguous in global memory
    constexpr int kWChunks = kTiles * kSegs * 32;
    static_assert(kWChunks % kThreads == 0, "whole weight copies per thread");
#pragma unroll
    for (int j = 0; j < kWChunks / kThreads; ++j) {
      const int c = tid + j * kThreads;
      const int t = c / (kSegs * 32), r = c % (kSegs * 32);
      const bool valid = tile0 + t < p.n_tiles && st * kSegs + r / 32 < ktiles;
      const uint4* src = p.w + (static_cast<size_t>(tile0 + t) * ktiles + st * kSegs) * 32 + r;
      copy16_async(base + c * 16, valid ? src : p.w, valid);
    }
    // group scales (and zeros): 16 values = 2 chunks per (n-tile, group)
    if constexpr (kGroups > 0) {
      constexpr int kPerTile = kGroups > 0 ? kGroups * 2 : 1;  // (never 0: only to keep "%" quiet)
      constexpr int kSChunks = kTiles * kPerTile;
      for (int c = tid; c < kSChunks * (ZEROS ? 2 : 1); c += kThreads) {
        const bool is_zero = c >= kSChunks;
        const int cs = is_zero ? c - kSChunks : c;
        const int t = cs / kPerTile, r = cs % kPerTile;
        const int g = st * kGroups + r / 2;
        const bool valid = tile0 + t < p.n_tiles && g < p.groups_pad;
        const T* src = (is_zero ? zeros : scales) + (static_cast<size_t>(tile0 + t) * p.groups_pad + g) * 16 + (r % 2) * 8;
        copy16_async(base + Stage::kW + Stage::kX + (is_zero ? Stage::kS : 0) + cs * 16, valid ? src : scales, valid);
      }
    }
  };
  auto fetch_x = [&](int st, int slot) {
    const uint32_t base = smem_addr + slot * Stage::kBytes;
    // activations: BM rows x 16 chunks of 8 elements; rows past M and k past K zero-filled
    constexpr int kXChunks = BM * (kGemmStageK / 8);
    static_assert(kXChunks % kThreads == 0, "whole x copies per thread");
#pragma unroll
    for (int j = 0; j < kXChunks / kThreads; ++j) {
      const int c = tid + j * kThreads;
      const int row = c / (kGemmStageK / 8), k = st * kGemmStageK + (c % (kGemmStageK / 8)) * 8;
      const bool valid = m0 + row < p.M && k < p.K;
      const T* src = x + static_cast<size_t>(m0 + row) * p.K + k;
      copy16_async(base + Stage::kW + (row * XS + (c % (kGemmStageK / 8)) * 8) * static_cast<uint32_t>(sizeof(T)),
                   valid ? src : x, valid);
    }
  };

  // A warp whose rows all lie past M skips the math (warp-uniform). Within a warp every
  // row block is computed: a branch per mma split the unrolled loop into basic blocks
  // and halved the tensor throughput.
  const int warp_row0 = m0 + warp_m * MBW * 8;
  const bool warp_live = warp_row0 < p.M;

  const float bz = zero_point_bias(BITS);
  ZeroConsts<T, BITS> zc[NTW];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) {
    zc[nt] = ZeroConsts<T, BITS>(bz, bz);
    if constexpr (ZEROS && GROUP == 0) {  // per-channel zero points: fixed for the block
      const int n_tile = tile0 + warp_n * NTW + nt;
      if (n_tile < p.n_tiles) {
        const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(n_tile) * 16)[gid]);
        zc[nt] = ZeroConsts<T, BITS>(z.x, z.y);
      }
    }
  }
  float acc[NTW][MBW][4];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
    for (int h = 0; h < MBW; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][h][i] = 0.f;

  auto compute = [&](int slot) {
    const char* base = reinterpret_cast<const char*>(smem) + slot * Stage::kBytes;
    const uint4* wsm = reinterpret_cast<const uint4*>(base) + warp_n * NTW * kSegs * 32 + lane;
    const T* xsm = reinterpret_cast<const T*>(base + Stage::kW) + (warp_m * MBW * 8 + (lane & 7)) * XS + 8 * (lane >> 3);
    [[maybe_unused]] const uint32_t* ssm =
        reinterpret_cast<const uint32_t*>(base + Stage::kW + Stage::kX) + warp_n * NTW * kGroups * 8 + gid;
    [[maybe_unused]] uint32_t s_lo[NTW], s_hi[NTW];
#pragma unroll
    for (int s = 0; s < kSegs; ++s) {
      uint4 wv[NTW];
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) wv[nt] = wsm[(nt * kSegs + s) * 32];
      uint32_t bx[MBW][4];
#pragma unroll
      for (int j = 0; j < KT16; ++j) {
        const int i = s * KT16 + j;  // k16 block within the stage (compile-time)
        if (i % 2 == 0) {  // one ldmatrix.x4 per 8 rows covers two k16 blocks
#pragma unroll
          for (int h = 0; h < MBW; ++h) ldmatrix_x4(bx[h], xsm + h * 8 * XS + i * 16);
        }
        if constexpr (GROUP != 0) {
          if (i % (GROUP / 16) == 0) {  // a group starts: its scales (and zeros) per n-tile
            const int g = i * 16 / GROUP;
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
              const uint32_t sc = ssm[(nt * kGroups + g) * 8];
              s_lo[nt] = dup_lo(sc);
              s_hi[nt] = dup_hi(sc);
              if constexpr (ZEROS) {
                zc[nt] = zero_consts<T, BITS>(ssm[Stage::kS / 4 + (nt * kGroups + g) * 8]);
              }
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          uint32_t a[4];
          convert_segment_k16<T, BITS>(wv[nt], j, zc[nt], a);
          if constexpr (GROUP != 0) {  // rows gid (a[0], a[2]) and gid + 8 (a[1], a[3])
            a[0] = mul_pair<T>(a[0], s_lo[nt]);
            a[1] = mul_pair<T>(a[1], s_hi[nt]);
            a[2] = mul_pair<T>(a[2], s_lo[nt]);
            a[3] = mul_pair<T>(a[3], s_hi[nt]);
          }
#pragma unroll
          for (int h = 0; h < MBW; ++h) {
            const uint32_t b[2] = {bx[h][(i % 2) * 2], bx[h][(i % 2) * 2 + 1]};
            mma_16816<T>(acc[nt][h], a, b);
          }
        }
      }
    }
  };

  // Pipeline: p.stages - 1 stages in flight ahead of the one computed. The prologue
  // fetches their weights before waiting for the previous kernel (a programmatic launch,
  // launch.cuh), x after; one commit group per stage (the first also holds the other
  // stages' weights), so the main loop's wait counts are unchanged.
  allow_dependent_launch();
#pragma unroll
  for (int q = 0; q < kGemmMaxStages - 1; ++q)
    if (q < p.stages - 1 && st_begin + q < st_end) fetch_weights(st_begin + q, q);
  wait_for_prior_grid();
#pragma unroll
  for (int q = 0; q < kGemmMaxStages - 1; ++q) {
    if (q < p.stages - 1) {
      if (st_begin + q < st_end) fetch_x(st_begin + q, q);
      cp_async_commit();
    }
  }
  int slot = 0;
  for (int st = st_begin; st < st_end; ++st) {
    cp_async_wait_dynamic<kGemmMaxStages - 2>(p.stages - 2);
    __syncthreads();  // stage st visible to all; the slot of stage st - 1 free to overwrite
    if (st + p.stages - 1 < st_end) {
      const int ahead_slot = slot == 0 ? p.stages - 1 : slot - 1;
      fetch_weights(st + p.stages - 1, ahead_slot);
      fetch_x(st + p.stages - 1, ahead_slot);
    }
    cp_async_commit();
    if (warp_live) compute(slot);
    slot = slot == p.stages - 1 ? 0 : slot + 1;
  }
  cp_async_wait<0>();

  // Per-channel scales, on the fp32 sums.
  if constexpr (GROUP == 0) {
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int n_tile = tile0 + warp_n * NTW + nt;
      if (n_tile < p.n_tiles) {
        const float2 sc = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(scales + static_cast<size_t>(n_tile) * 16)[gid]);
#pragma unroll
        for (int h = 0; h < MBW; ++h) {
          acc[nt][h][0] *= sc.x;
          acc[nt][h][1] *= sc.x;
          acc[nt][h][2] *= sc.y;
          acc[nt][h][3] *= sc.y;
        }
      }
    }
  }

  if (p.splits > 1) {
    // Partials in fragment order: thread-contiguous, so writes and reads coalesce.
    constexpr int kTileFloats = BM * Shape::kBN;
    float* ws = p.workspace + static_cast<size_t>(tile_id) * p.splits * kTileFloats;
    auto idx = [&](int nt, int h, int i) { return (((warp * NTW + nt) * MBW + h) * 4 + i) * 32 + lane; };
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int h = 0; h < MBW; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) ws[split * kTileFloats + idx(nt, h, i)] = acc[nt][h][i];
    __syncthreads();  // every partial written before thread 0 releases them
    if (tid == 0) is_last_split = atomic_add_acq_rel(&p.counters[tile_id], 1) == p.splits - 1;
    __syncthreads();
    if (!is_last_split) return;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int h = 0; h < MBW; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float sum = 0.f;
          for (int s = 0; s < p.splits; ++s) sum += __ldcg(ws + s * kTileFloats + idx(nt, h, i));  // split order
          acc[nt][h][i] = sum;
        }
    if (tid == 0) p.counters[tile_id] = 0;  // re-arm for the next launch / graph replay
  }

  // Accumulator (nt, h, i) holds y[m][n]: m = warp_row0 + 8h + 2*t4 + (i & 1),
  // n = 16 * (n-tile) + gid + 8 * (i >> 1).
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) {
    const int n_lo = 16 * (tile0 + warp_n * NTW + nt) + gid;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = n_lo + 8 * (i >> 1);
      if (n >= p.N) continue;
      const float b = bias ? to_float(bias[n]) : 0.f;
#pragma unroll
      for (int h = 0; h < MBW; ++h) {
        const int m = warp_row0 + 8 * h + 2 * t4 + (i & 1);
        if (m < p.M) y[static_cast<size_t>(m) * p.N + n] = from_float<T>(acc[nt][h][i] + b);
      }
    }
  }
#endif
}

}  // namespace woq
