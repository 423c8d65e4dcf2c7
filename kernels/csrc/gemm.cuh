// Mixed-input tensor-core GEMM for mid M (17 .. a few hundred rows):
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W int8/int4 in the GEMV's packed layout,
// x fp16/bf16, fp32 accumulation.
//
// Why a second kernel: every GEMV warp re-reads the whole activation tile from shared
// memory, which past 16 rows outgrows the weight stream. Here a block owns a BM x BN output
// tile and its 8 warps a 2-D grid of warp tiles, so a converted weight fragment feeds MBW
// row blocks and a loaded x fragment feeds NTW n-tiles -- the classic GEMM reuse.
//
// Operands as in the GEMV ("y^T = W x^T"): weights are mma.m16n8k16's A operand (16
// channels), x the B operand (8 rows). The packed layout gives each lane its A fragments
// from one 16-byte load per 512-byte segment, so weights need no ldmatrix: cp.async (or,
// for wgmma tiles of 64 rows and more, one tensor copy a stage) puts a tile's segments in
// shared memory as they lie in global memory and each lane reads back its own 16 bytes
// (conflict-free). mma configs read x through ldmatrix.x4 from rows
// padded by 16 bytes; wgmma configs (5..9, sm_90a, wgmma.cuh) let each warpgroup issue one
// wgmma.m64nBMk16 per 64-channel slice with B, the stage's x tile, read by the tensor
// cores from shared memory in the 128-byte swizzle (the weight layout already matches
// wgmma's register A fragments: warp w of a warpgroup holds rows 16w..16w+15).
// Tile configurations: kGemmTileConfigs (woq_kernels.h); the tuner picks one per shape and M.
//
// Group scales multiply the converted weights, not the accumulators: (code - z) is an
// exact small integer and the scale an fp16 value, so the product is exact (at most 8 + 11
// significant bits) and one rounding to T gives exactly the weight dequant + cuBLAS would
// use (RowScale below says how, per T). Per-channel scales stay on the fp32 accumulators
// (applied once, at the end).
//
// Work decomposition, "stream-K" as in the GEMV: the (output tile, stage) units of the
// whole product are cut into gridDim.x balanced contiguous runs, one per block. Tiles are
// numbered m-tile-major (the columns of one m-tile adjacent): with m_tiles m-tiles the
// grid falls into m_tiles groups of blocks, and the blocks at the same place in their
// groups walk the same columns at the same time, one m-tile each, so a column's weights
// come from DRAM once and from L2 for the other m-tiles (a block walking one column's
// m-tiles in turn would find them evicted by the other blocks' columns). The grid is one resident wave
// (`splits` 0) or `splits` blocks per tile (classic split-K). A tile cut between
// blocks leaves fp32 partials in the workspace (two slots per block: only its first and
// last tile can be partial); the tile's last contributor adds them in block order
// (deterministic) and re-arms the tile's counter (CUDA-graph safe).
#pragma once

#include <cuda.h>  // (CUtensorMap)

#include <cstdint>

#include "gemv.cuh"  // converters, fragment helpers, the acq_rel counter
#include "wgmma.cuh"

namespace woq {

// Shared-memory ring depth, at most (gemm_launch.cuh): deeper rings measured no faster.
constexpr int kGemmMaxStages = 4;
// wgmma groups (one per k16 step) a warpgroup keeps in flight while it converts the next
// step's weights; each holds its A registers until it completes.
constexpr int kWgmmaInFlight = 4;
static_assert(kGemmStageK / 16 >= kWgmmaInFlight, "a stage's own groups are the ones left in flight");

// A configuration of kGemmTileConfigs (woq_kernels.h). kMinBlocks: resident blocks per SM
// the registers are capped for (2: <= 128 registers; 1: 64 accumulators per thread, 128 for
// config 8). kStageK4: k per stage with int4 weights; configs 5 (M <= 32) and 9 (M <= 16)
// take 256: they do little math per weight byte, so the per-stage round trip (barrier,
// first shared-memory loads and conversions) bounds them, and twice the k halves it per
// byte. (Their int8 stages stay at 128: 256 would leave too few stages for wgmma's ring.)
template <int CFG>
struct GemmTile {
  static constexpr GemmTileConfig kConfig = kGemmTileConfigs[CFG];
  static constexpr int kWM = kConfig.wm, kMBW = kConfig.mbw, kNTW = kConfig.ntw;
  static constexpr int kMinBlocks = kConfig.min_blocks, kStageK4 = kConfig.stage_k4;
  static constexpr bool kWgmma = kConfig.wgmma;
};

template <int CFG>
struct GemmShape {
  static constexpr int kWM = GemmTile<CFG>::kWM, kWN = kGemmWarps / kWM;
  static constexpr int kMBW = GemmTile<CFG>::kMBW, kNTW = GemmTile<CFG>::kNTW;
  static constexpr int kBM = kWM * kMBW * 8;
  static constexpr int kBN = kWN * kNTW * 16;
  static constexpr int kTiles = kBN / 16;  // n-tiles per block
  static constexpr int kMinBlocks = GemmTile<CFG>::kMinBlocks;
  static constexpr bool kWgmma = GemmTile<CFG>::kWgmma;
  // Stages by tensor copies (TMA, GemmParams::tma): wgmma tiles of 64 rows and more. Tiles
  // of 16 and 32 rows (configs 9, 5) keep cp.async: their stages go by fast, and one
  // thread's copies added latency there (mixed_gemm.md).
  static constexpr bool kTensorCopies = kWgmma && kBM >= 64;
  static_assert(!kWgmma || kWM == 1, "wgmma: both warpgroups share the rows, each its own channels");
  // The block-tile n-tile (16 channels) of a warp's nt-th n-tile, and its first row. mma:
  // warp (warp_m, warp_n) of the WM x WN grid owns NTW adjacent n-tiles. wgmma: warpgroup
  // g owns NTW 64-channel slices (4 n-tiles each), warp w of it the w-th n-tile of each --
  // the rows wgmma's A fragments give it.
  __device__ static int n_tile(int warp, int nt) {
    return kWgmma ? (warp / 4) * kNTW * 4 + nt * 4 + warp % 4 : (warp % kWN) * kNTW + nt;
  }
  __device__ static int row0(int warp) { return kWgmma ? 0 : (warp / kWN) * kMBW * 8; }
};


struct GemmParams : KernelOperands {  // workspace: [gridDim.x, 2, BM * BN]; counters: [tiles]
  int nstages;  // ceil(K_pad / stage k)
  int m_tiles;  // ceil(M / BM)
  int units;    // tiles * nstages: (tile, stage) work units; gridDim.x <= units
  int stages;   // depth of the shared-memory ring, 2..kGemmMaxStages
  // Configurations with kTensorCopies (6, 7, 8): a stage arrives as tensor copies (TMA) of
  // these boxes, issued by one thread (gemm_launch.cuh encodes them; tma 0 where the driver
  // refused one), else as every thread's cp.async copies.
  //   tm_w: the weights as [n_tiles][K_pad / KT][128 x 4 bytes], box [kTiles][kSegs][128]
  //   tm_x: x as [M][K], box [BM][64], 128-byte swizzle (wgmma's B layout, below)
  //   tm_s, tm_z: scales, zero points as [n_tiles][groups_pad * 16], box [kTiles][kGroups * 16]
  int tma;
  CUtensorMap tm_w, tm_x, tm_s, tm_z;
};

// Shared memory of one stage, in bytes (every part a multiple of 16).
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
struct GemmStage {
  using Shape = GemmShape<CFG>;
  static constexpr int kK = BITS == 4 ? GemmTile<CFG>::kStageK4 : kGemmStageK;  // k per stage
  static constexpr int kXStride = kK + 8;  // mma: +16 B per x row, conflict-free ldmatrix
  static constexpr int kSegs = kK / TileShape<BITS>::kK;  // 512-byte segments per n-tile
  static constexpr int kGroups = GROUP == 0 ? 0 : kK / GROUP;
  static constexpr int kW = Shape::kTiles * kSegs * 512;
  // x: mma, rows padded by 16 bytes; wgmma, the 128-byte swizzle (wgmma.cuh) in 64-k
  // slices of BM rows (two, or four for config 5's 256-k stages), each 1024-byte aligned
  // (kW is a multiple of 1024 and the stage size rounded up to one: the kernel aligns the
  // ring's base).
  static constexpr int kX = Shape::kBM * (Shape::kWgmma ? kK : kXStride) * static_cast<int>(sizeof(T));
  static constexpr int kS = Shape::kTiles * kGroups * 16 * static_cast<int>(sizeof(T));
  static constexpr int kZ = ZEROS ? kS : 0;
  static constexpr int kAlign = Shape::kWgmma ? 1024 : 16;
  static constexpr int kBytes = (kW + kX + kS + kZ + kAlign - 1) / kAlign * kAlign;
  static_assert(!Shape::kWgmma || kW % 1024 == 0, "the swizzled x tile must start 1024-byte aligned");
};

// One row's group scale, applied to a register of two converted (code - z) values so that
// each product (code - z) * s rounds once, to T. Built from the fp16 scale per group.
template <typename T, int BITS>
struct RowScale;

// fp16: one packed multiply (the exact product rounded once).
template <int BITS>
struct RowScale<__half, BITS> {
  uint32_t s2;  // half2(s, s)
  RowScale() = default;
  __device__ __forceinline__ explicit RowScale(__half s) : s2(as_u32(__half2half2(s))) {}
  __device__ __forceinline__ uint32_t apply(uint32_t a) const { return as_u32(__hmul2(as_h2(a), as_h2(s2))); }
};

// bf16, int4: s is split exactly into hi = bf16(s) and lo = s - hi. lo is a multiple of
// s's fp16 ulp of magnitude at most 4 ulps (half a bf16 ulp), so it has at most 3
// significant bits, and (code - z) * lo, with |code - z| <= 15, at most 7: exact in bf16.
// fma(a, hi, a * lo) then rounds the exact a * s once. (tests/test_layout.py checks every
// fp16 scale and code.)
template <>
struct RowScale<__nv_bfloat16, 4> {
  uint32_t hi2, lo2;  // bf16x2(hi, hi), bf16x2(lo, lo)
  RowScale() = default;
  __device__ __forceinline__ explicit RowScale(__half s) {
    const float f = __half2float(s);
    const __nv_bfloat16 hi = __float2bfloat16_rn(f);
    const __nv_bfloat16 lo = __float2bfloat16_rn(f - __bfloat162float(hi));  // (exact)
    const __nv_bfloat162 h2 = __bfloat162bfloat162(hi), l2 = __bfloat162bfloat162(lo);
    hi2 = *reinterpret_cast<const uint32_t*>(&h2);
    lo2 = *reinterpret_cast<const uint32_t*>(&l2);
  }
  __device__ __forceinline__ uint32_t apply(uint32_t a) const {
    return fma_bf16x2(a, hi2, fma_bf16x2(a, lo2, 0x80008000u));  // a * hi + (a * lo + -0)
  }
};

// bf16, int8: |code - z| <= 255 leaves no room for the split, so through fp32 (exact
// product) and one conversion of the pair to bf16x2.
template <>
struct RowScale<__nv_bfloat16, 8> {
  float s;
  RowScale() = default;
  __device__ __forceinline__ explicit RowScale(__half h) : s(__half2float(h)) {}
  __device__ __forceinline__ uint32_t apply(uint32_t a) const {
    const float2 v = pair_to_float2<__nv_bfloat16>(a);
    return float2_to_pair<__nv_bfloat16>(v.x * s, v.y * s);
  }
};

// The row scales of a stored pair (rows gid, gid + 8).
template <typename T, int BITS>
__device__ __forceinline__ void row_scales(uint32_t pair, RowScale<T, BITS>& lo, RowScale<T, BITS>& hi) {
  const __half2 s = as_h2(pair);
  lo = RowScale<T, BITS>(__low2half(s));
  hi = RowScale<T, BITS>(__high2half(s));
}

// GROUP: group size in k (64 or 128; a divisor of the stage), or 0 for per-channel.
template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
__device__ __forceinline__ void gemm_units(const GemmParams& p) {
  using Shape = GemmShape<CFG>;
  using Stage = GemmStage<T, BITS, CFG, GROUP, ZEROS>;
  constexpr int kThreads = kGemmWarps * 32;
  constexpr int BM = Shape::kBM, MBW = Shape::kMBW, NTW = Shape::kNTW, kTiles = Shape::kTiles;
  constexpr int KT = TileShape<BITS>::kK, KT16 = KT / 16, kSegs = Stage::kSegs;
  constexpr int SK = Stage::kK, XS = Stage::kXStride;
  constexpr int kGroups = Stage::kGroups;
  constexpr int kGroupK = GROUP == 0 ? SK : GROUP;  // (per-channel: as if one group a stage)
  static_assert(SK % kGroupK == 0 && kGroupK % KT == 0, "a group is whole segments of a stage");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, t4 = lane & 3;
  const int ktiles = p.K_pad / KT;
  // This block's run of units L = tile * nstages + stage (32-bit: see the GEMV).
  const UnitPartition part_of(p.units, gridDim.x);
  const int L_begin = part_of.begin(blockIdx.x), L_end = part_of.begin(blockIdx.x + 1);
  const BlockStamps stamps(p);  // (a timed launch: as the GEMV's, launch.cuh)
  if (L_begin >= L_end) {  // (the launcher sizes the grid so that this never happens)
    wait_for_prior_grid();
    stamps.start();
    return;
  }
  // The output tile of unit L: its first row and its first n-tile.
  const int columns = (p.n_tiles + kTiles - 1) / kTiles;
  auto tile_m0 = [&](int tile) { return tile / columns * BM; };
  auto tile_n0 = [&](int tile) { return tile % columns * kTiles; };

  extern __shared__ uint4 smem_raw[];
  __shared__ int is_last_contributor;
  const T* x = static_cast<const T*>(p.x);
  const Scale* scales = static_cast<const Scale*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  // The ring's base: 1024-byte aligned for wgmma's swizzled tiles (the launcher adds the
  // slack), as given otherwise.
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_addr = (raw_addr + Stage::kAlign - 1) & ~static_cast<uint32_t>(Stage::kAlign - 1);
  const char* smem = reinterpret_cast<const char*>(smem_raw) + (smem_addr - raw_addr);

  // The ring's barriers (wgmma configurations; the pipeline below says how they are used).
  constexpr bool kRing = Shape::kWgmma;
  __shared__ alignas(8) uint64_t ring_barriers[2 * kGemmMaxStages];  // full[slot], then empty[slot]
  const uint32_t full_bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring_barriers));
  auto full_bar = [&](int s) { return full_bar0 + 8u * s; };
  auto empty_bar = [&](int s) { return full_bar0 + 8u * (kGemmMaxStages + s); };

  // Where a unit lies: its output tile's m-tile and column (of kTiles n-tiles) and its
  // stage. The fetches walk units one at a time, so these advance without divisions by the
  // run-time m_tiles and nstages (which made the copy code ~30 instructions per cp.async).
  struct UnitPos {
    int mt, col, st;
  };
  auto advance = [&](UnitPos& u) {
    if (++u.st == p.nstages) {
      u.st = 0;
      if (++u.col == columns) {
        u.col = 0;
        ++u.mt;
      }
    }
  };

  // The cp.async copies of a unit into ring slot `slot`, in two parts: what is constant
  // while serving (weights, scales, zero points) and the activations, which the previous
  // kernel may still be writing (launch.cuh). Every part is a run of 16-byte chunks, chunk
  // c to thread c % kThreads; out-of-range chunks are zero-filled (zero codes convert to
  // finite values, and they meet zero-filled x).
  //
  // A thread's chunks of a part are one fixed chunk of every j-th n-tile (weights) or row
  // (x): c = tid + j * kThreads splits into a per-thread part and j times a whole number of
  // n-tiles or rows, so each copy costs a pointer step and a compare (indexing by c cost
  // ~15 instructions per copy). x steps a pointer by kXRowStep rows rather than
  // multiplying (m0 + row + j * step) * K per copy, and each thread's one scale chunk is
  // fixed relative to the unit.
  // A zero-filled copy reads nothing (src-size 0), so its source is passed as computed --
  // possibly past the end of x or the weights -- instead of being selected to a valid one.
  constexpr int kWTileChunks = kSegs * 32;  // one n-tile's chunks of a stage
  static_assert(kThreads % kWTileChunks == 0, "a thread's weight chunks lie in every j-th n-tile");
  constexpr int kWTileStep = kThreads / kWTileChunks;
  const int w_tile = tid / kWTileChunks, w_chunk = tid % kWTileChunks;
  const size_t w_tile_stride = static_cast<size_t>(ktiles) * 32 * kWTileStep;  // (uint4)
  // Group scales (and zero points): 16 values = 2 chunks per (n-tile, group) of a stage,
  // at most one chunk per thread; what a thread copies, relative to the unit's first
  // n-tile and group, is fixed (tid < kSChunks: scales, then the zero points).
  constexpr int kPerTile = kGroups > 0 ? kGroups * 2 : 1;  // (per-channel: never used; 1 keeps "/" defined)
  constexpr int kSChunks = kGroups > 0 ? kTiles * kPerTile : 0;
  static_assert(kSChunks * (ZEROS ? 2 : 1) <= kThreads, "one scale chunk per thread at most");
  const bool s_copier = tid < kSChunks * (ZEROS ? 2 : 1);
  const bool s_is_zero = tid >= kSChunks;
  const int s_chunk = s_is_zero ? tid - kSChunks : tid;
  const int s_tile = s_chunk / kPerTile, s_group = s_chunk % kPerTile / 2;
  const uint16_t* s_src = static_cast<const uint16_t*>(ZEROS && s_is_zero ? p.zeros : p.scales) +  // (2-byte values)
                          (static_cast<size_t>(s_tile) * p.groups_pad + s_group) * 16 + s_chunk % 2 * 8;
  const uint32_t s_dst = Stage::kW + Stage::kX + (s_is_zero ? Stage::kS : 0) + s_chunk * 16;
  auto fetch_weights = [&](const UnitPos& u, int slot) {
    const int tile0 = u.col * kTiles, st = u.st;
    const uint32_t base = smem_addr + slot * Stage::kBytes;
    // weights: each n-tile's kSegs segments of this stage lie contiguous in global memory
    constexpr int kWChunks = kTiles * kSegs * 32;
    static_assert(kWChunks % kThreads == 0, "whole weight copies per thread");
    const uint4* src = p.w + (static_cast<size_t>(tile0 + w_tile) * ktiles + st * kSegs) * 32 + w_chunk;
    const bool k_valid = st * kSegs + w_chunk / 32 < ktiles;
    const int tiles_left = p.n_tiles - tile0 - w_tile;  // this thread's n-tiles in range
#pragma unroll
    for (int j = 0; j < kWChunks / kThreads; ++j) {
      const bool valid = k_valid && j * kWTileStep < tiles_left;
      copy16_async(base + (tid + j * kThreads) * 16, src + j * w_tile_stride, valid);
    }
    // group scales (and zeros): threads tid < kSChunks (x 2 with zero points), one chunk each
    if constexpr (kGroups > 0) {
      if (s_copier) {
        const bool valid = tile0 + s_tile < p.n_tiles && st * kGroups + s_group < p.groups_pad;
        const uint16_t* src = s_src + (static_cast<size_t>(tile0) * p.groups_pad + st * kGroups) * 16;
        copy16_async(base + s_dst, src, valid);
      }
    }
  };
  constexpr int kXRowChunks = SK / 8;  // one x row's chunks of a stage
  static_assert(kThreads % kXRowChunks == 0 && (kThreads / kXRowChunks) % 8 == 0,
                "a thread's x chunks lie in every j-th row, j a multiple of 8 (its swizzle is fixed)");
  constexpr int kXRowStep = kThreads / kXRowChunks;
  const int x_row = tid / kXRowChunks, x_chunk = tid % kXRowChunks;
  // the chunk's place in the row-0 slice of a stage (wgmma: 64-k slice, row of 128 bytes,
  // chunk XOR row % 8, the same for all of this thread's rows; mma: rows padded)
  const uint32_t x_dst = Shape::kWgmma
                             ? (x_chunk / 8) * BM * 128 + x_row * 128 + ((x_chunk % 8) ^ (x_row % 8)) * 16
                             : (x_row * XS + x_chunk * 8) * static_cast<uint32_t>(sizeof(T));
  constexpr uint32_t kXDstStep = Shape::kWgmma ? kXRowStep * 128 : kXRowStep * XS * sizeof(T);
  const size_t x_thread = static_cast<size_t>(x_row) * p.K + x_chunk * 8;  // (elements, from the unit's first)
  const size_t x_row_step = static_cast<size_t>(kXRowStep) * p.K;
  auto fetch_x = [&](const UnitPos& u, int slot) {
    const int m0 = u.mt * BM, k0 = u.st * SK;
    const uint32_t base = smem_addr + slot * Stage::kBytes + Stage::kW + x_dst;
    // activations: BM rows x SK / 8 chunks of 8 elements; rows past M and k past K zero-filled
    constexpr int kXChunks = BM * (SK / 8);
    static_assert(kXChunks % kThreads == 0, "whole x copies per thread");
    const T* src = x + x_thread + (static_cast<size_t>(m0) * p.K + k0);
    const bool k_valid = k0 + x_chunk * 8 < p.K;
    const int rows_left = p.M - m0 - x_row;
#pragma unroll
    for (int j = 0; j < kXChunks / kThreads; ++j) {
      if (j > 0) src += x_row_step;  // (a pointer step: the j * K products cost ~20 instructions a copy)
      const bool valid = k_valid && j * kXRowStep < rows_left;
      copy16_async(base + j * kXDstStep, src, valid);
    }
  };
  // The same parts as tensor copies (p.tma; thread 0 issues them): one box of weights, one
  // of scales and one of zero points, and x in 64-k slices of BM rows -- the copy engine
  // writes each slice in the 128-byte swizzle that the cp.async path computes per chunk,
  // and zero-fills what lies past M, K or the weight's n-tiles as that path does. They
  // complete on the slot's full barrier by bytes (kTmaWeightBytes, kTmaXBytes).
  // (The maps are kernel parameters, so each copy reads its box's description there.)
  constexpr uint32_t kTmaWeightBytes = Stage::kW + Stage::kS + Stage::kZ;
  constexpr uint32_t kTmaXBytes = Stage::kX;
  auto tma_weights = [&](const UnitPos& u, int slot) {
    const uint32_t base = smem_addr + slot * Stage::kBytes;
    const int n_tile0 = u.col * kTiles;
    tma_load_3d(base, &p.tm_w, full_bar(slot), 0, u.st * kSegs, n_tile0);
    if constexpr (kGroups > 0) {
      tma_load_2d(base + Stage::kW + Stage::kX, &p.tm_s, full_bar(slot), u.st * kGroups * 16, n_tile0);
      if constexpr (ZEROS) tma_load_2d(base + Stage::kW + Stage::kX + Stage::kS, &p.tm_z, full_bar(slot), u.st * kGroups * 16, n_tile0);
    }
  };
  auto tma_x = [&](const UnitPos& u, int slot) {
    const uint32_t base = smem_addr + slot * Stage::kBytes + Stage::kW;
#pragma unroll
    for (int s = 0; s < SK / 64; ++s) tma_load_2d(base + s * BM * 128, &p.tm_x, full_bar(slot), u.st * SK + s * 64, u.mt * BM);
  };

  // Per-tile state, set as the walk enters a tile. A warp whose rows all lie past M skips
  // the math (warp-uniform). Within a warp every row block is computed: a branch per mma
  // split the unrolled loop into basic blocks and halved the tensor throughput.
  int tile0 = 0, warp_row0 = 0;
  bool warp_live = false;
  const float bz = zero_point_bias(BITS);
  ZeroConsts<T, BITS> zc[NTW];
  float acc[NTW][MBW][4];
  auto enter_tile = [&](int tile) {
    tile0 = tile_n0(tile);
    warp_row0 = tile_m0(tile) + Shape::row0(warp);
    warp_live = warp_row0 < p.M;
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      zc[nt] = ZeroConsts<T, BITS>(bz, bz);
      if constexpr (ZEROS && GROUP == 0) {  // per-channel zero points: fixed for the tile
        const int n_tile = tile0 + Shape::n_tile(warp, nt);
        if (n_tile < p.n_tiles) {
          const float2 z = pair_to_float2<T>(reinterpret_cast<const uint32_t*>(zeros + static_cast<size_t>(n_tile) * 16)[gid]);
          zc[nt] = ZeroConsts<T, BITS>(z.x, z.y);
        }
      }
#pragma unroll
      for (int h = 0; h < MBW; ++h)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][h][i] = 0.f;
    }
  };

  auto compute = [&](int slot) {
    const char* base = smem + slot * Stage::kBytes;
    const uint4* wsm = reinterpret_cast<const uint4*>(base) + Shape::n_tile(warp, 0) * kSegs * 32 + lane;
    const T* xsm = reinterpret_cast<const T*>(base + Stage::kW) + (Shape::row0(warp) + (lane & 7)) * XS + 8 * (lane >> 3);
    [[maybe_unused]] const uint32_t* ssm =
        reinterpret_cast<const uint32_t*>(base + Stage::kW + Stage::kX) + Shape::n_tile(warp, 0) * kGroups * 8 + gid;
    [[maybe_unused]] RowScale<T, BITS> s_lo[NTW], s_hi[NTW];
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
              row_scales(ssm[(nt * kGroups + g) * 8], s_lo[nt], s_hi[nt]);
              if constexpr (ZEROS) {
                zc[nt] = zero_consts<T, BITS>(ssm[Stage::kS / 4 + (nt * kGroups + g) * 8]);
              }
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          uint32_t a[4];
          convert_segment_k16<T, BITS, ZEROS>(wv[nt], j, zc[nt], a);
          if constexpr (GROUP != 0) {  // rows gid (a[0], a[2]) and gid + 8 (a[1], a[3])
            a[0] = s_lo[nt].apply(a[0]);
            a[1] = s_hi[nt].apply(a[1]);
            a[2] = s_lo[nt].apply(a[2]);
            a[3] = s_hi[nt].apply(a[3]);
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

  // wgmma: per k16 step each warp converts its n-tiles' A fragments as above, and its
  // warpgroup issues one m64 x BM x k16 wgmma per 64-channel slice with B, the stage's x
  // tile, read by the tensor cores straight from shared memory (no ldmatrix, no x
  // registers). Converting step i + 1 overlaps the wgmma of the steps before it (up to
  // kWgmmaInFlight groups in flight).
  auto compute_wgmma = [&](int slot, uint32_t release_bar) {
    if constexpr (Shape::kWgmma) {  // (never instantiated for the mma configurations)
      const char* base = smem + slot * Stage::kBytes;
      const uint4* wsm = reinterpret_cast<const uint4*>(base) + Shape::n_tile(warp, 0) * kSegs * 32 + lane;
      [[maybe_unused]] const uint32_t* ssm =
          reinterpret_cast<const uint32_t*>(base + Stage::kW + Stage::kX) + Shape::n_tile(warp, 0) * kGroups * 8 + gid;
      const uint32_t x_addr = smem_addr + slot * Stage::kBytes + Stage::kW;
      [[maybe_unused]] RowScale<T, BITS> s_lo[NTW], s_hi[NTW];
      // A segment's weights are loaded from shared memory while the segment before it is
      // converted (one segment ahead) where the wgmma are short (BM <= 64): the wgmma asm's
      // memory clobbers keep the compiler from hoisting the loads itself, and each load's
      // latency otherwise sat between two segments' MMAs. (At 128 rows: measured no gain.)
      constexpr bool kPrefetch = BM <= 64;
      uint4 wv_next[NTW];
      // (the warp's nt-th n-tile is 4 nt n-tiles past its first: Shape::n_tile)
      auto load_segment = [&](int s) {
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) wv_next[nt] = wsm[(nt * 4 * kSegs + s) * 32];
      };
      load_segment(0);
#pragma unroll
      for (int s = 0; s < kSegs; ++s) {
        uint4 wv[NTW];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) wv[nt] = wv_next[nt];
        if (kPrefetch && s + 1 < kSegs) load_segment(s + 1);
#pragma unroll
        for (int j = 0; j < KT16; ++j) {
          const int i = s * KT16 + j;  // k16 block within the stage (compile-time)
          if constexpr (GROUP != 0) {
            if (i % (GROUP / 16) == 0) {
              const int g = i * 16 / GROUP;
#pragma unroll
              for (int nt = 0; nt < NTW; ++nt) {
                row_scales(ssm[(nt * 4 * kGroups + g) * 8], s_lo[nt], s_hi[nt]);
                if constexpr (ZEROS) {
                  zc[nt] = zero_consts<T, BITS>(ssm[Stage::kS / 4 + (nt * 4 * kGroups + g) * 8]);
                }
              }
            }
          }
          uint32_t a[NTW][4];
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt) {
            convert_segment_k16<T, BITS, ZEROS>(wv[nt], j, zc[nt], a[nt]);
            if constexpr (GROUP != 0) {
              a[nt][0] = s_lo[nt].apply(a[nt][0]);
              a[nt][1] = s_hi[nt].apply(a[nt][1]);
              a[nt][2] = s_lo[nt].apply(a[nt][2]);
              a[nt][3] = s_hi[nt].apply(a[nt][3]);
            }
          }
          // k16 block i: 64-k slice i / 4 of the swizzled tile, 32 bytes per k16 into its rows
          const uint64_t desc = smem_desc_sw128(x_addr + (i / 4) * BM * 128 + (i % 4) * 32);
          wgmma_fence();
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt) wgmma_rs<T, MBW * 8>(&acc[nt][0][0], a[nt], desc);
          wgmma_commit();
          wgmma_wait<kWgmmaInFlight - 1>();
          // Ring barriers: the groups left in flight are now all this stage's, so the
          // previous stage's slot is read for the last time -- it may be refilled.
          if (i == kWgmmaInFlight - 1 && release_bar != 0) mbarrier_arrive(release_bar);
        }
        if (!kPrefetch && s + 1 < kSegs) load_segment(s + 1);
      }
      // (the stage's last groups stay in flight into the next stage: the ring refills the
      // slot computed two units back, see the main loop; finish_tile waits for them)
    }
  };

  // wgmma configurations: y in 16-byte stores. A thread's accumulators hold pairs of
  // consecutive *rows* of one channel, so storing them a value at a time is ~18
  // instructions per value -- for config 8, straight-line code too long for the
  // instruction cache. Instead each warp transposes two n8 blocks (16 rows x 16 channels)
  // at a time through 512 bytes of its own shared memory with stmatrix.trans, then each
  // lane stores 8 channels of one row: 16 bytes. Needs rows of y 16-byte aligned (N % 8 ==
  // 0, y 16-byte aligned: checked below), else the value-at-a-time loop.
  __shared__ alignas(16) uint4 y_staging[Shape::kWgmma ? kGemmWarps * 32 : 1];
  const bool y_by_16_bytes = p.N % 8 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  auto store_tile_staged = [&]() {
    // 16 rows x 32 bytes; a row's two 16-byte halves swapped on rows 4-7 and 12-15, so the
    // 8 rows of one stmatrix matrix (a half each) and the 8 lanes of one 128-byte phase of
    // the read-back fall in 32 different banks.
    auto staged = [&](int row, int half) {
      return static_cast<uint32_t>(__cvta_generic_to_shared(y_staging + warp * 32)) + row * 32 + ((half ^ (row >> 2 & 1)) * 16);
    };
    // stmatrix.trans: lane 8 j + i addresses column i of matrix j -- activation row i of
    // n8 block h + j / 2, its channel half j % 2 (8 channels, 16 bytes)
    const int mat = lane >> 3;
    const uint32_t st_addr = staged(8 * (mat >> 1) + (lane & 7), mat & 1);
    const int row = lane >> 1, half = lane & 1;  // read-back: lane -> (row, 8 channels)
    const uint32_t ld_addr = staged(row, half);
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int n_tile0 = 16 * (tile0 + Shape::n_tile(warp, nt));
      float b_lo = 0.f, b_hi = 0.f;  // bias of channels gid and gid + 8 (added before rounding)
      if (bias) {
        if (n_tile0 + gid < p.N) b_lo = to_float(bias[n_tile0 + gid]);
        if (n_tile0 + gid + 8 < p.N) b_hi = to_float(bias[n_tile0 + gid + 8]);
      }
      const int n = n_tile0 + 8 * half;
#pragma unroll
      for (int h = 0; h < MBW; h += 2) {
        uint32_t r[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float* a = acc[nt][h + j / 2] + 2 * (j % 2);
          const float b = j % 2 ? b_hi : b_lo;
          r[j] = float2_to_pair<T>(a[0] + b, a[1] + b);
        }
        stmatrix_x4_trans(st_addr, r);
        __syncwarp();
        const uint4 v = load16_shared(ld_addr);
        const int m = warp_row0 + 8 * h + row;
        if (m < p.M && n < p.N) *reinterpret_cast<uint4*>(y + static_cast<size_t>(m) * p.N + n) = v;
        __syncwarp();  // (read back before the next pair overwrites it)
      }
    }
  };

  // The tile's output: per-channel scales on the fp32 sums; a block that computed only
  // some of the tile's stages leaves its partial in its workspace slot (0: the tile where
  // its run starts, 1: where it ends), and the tile's last contributor adds all of them.
  auto finish_tile = [&](int tile, bool whole, bool first_of_run) {
    if constexpr (Shape::kWgmma) wgmma_wait<0>();
    if constexpr (GROUP == 0) {
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        const int n_tile = tile0 + Shape::n_tile(warp, nt);
        if (n_tile < p.n_tiles) {
          const float2 sc = pair_to_float2<Scale>(reinterpret_cast<const uint32_t*>(scales + static_cast<size_t>(n_tile) * 16)[gid]);
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
    if (!whole) {
      // Partials in fragment order, an n8 block's 4 accumulators as one float4 per thread
      // (16-byte accesses, a warp's 512 contiguous bytes: a quarter of the instructions of
      // one float at a time).
      constexpr int kTileFloats = BM * Shape::kBN;
      auto idx = [&](int nt, int h) { return ((warp * NTW + nt) * MBW + h) * 32 + lane; };
      auto partials_of = [&](int b, int which) {
        return reinterpret_cast<float4*>(p.workspace + (static_cast<size_t>(b) * 2 + which) * kTileFloats);
      };
      float4* ws = partials_of(blockIdx.x, first_of_run ? 0 : 1);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int h = 0; h < MBW; ++h) ws[idx(nt, h)] = make_float4(acc[nt][h][0], acc[nt][h][1], acc[nt][h][2], acc[nt][h][3]);
      const int tu0 = tile * p.nstages;
      const int b_first = part_of.owner(tu0), b_last = part_of.owner(tu0 + p.nstages - 1);
      __syncthreads();  // every partial written before thread 0 releases them
      if (tid == 0) is_last_contributor = atomic_add_acq_rel(&p.counters[tile], 1) == b_last - b_first;
      __syncthreads();
      if (!is_last_contributor) return;
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int h = 0; h < MBW; ++h)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[nt][h][i] = 0.f;
      for (int b = b_first; b <= b_last; ++b) {  // block order: deterministic
        const float4* part = partials_of(b, part_of.begin(b) >= tu0 ? 0 : 1);
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int h = 0; h < MBW; ++h) {
            const float4 v = __ldcg(part + idx(nt, h));
            acc[nt][h][0] += v.x;
            acc[nt][h][1] += v.y;
            acc[nt][h][2] += v.z;
            acc[nt][h][3] += v.w;
          }
      }
      if (tid == 0) p.counters[tile] = 0;  // re-arm for the next launch / graph replay
    }
    // Accumulator (nt, h, i) holds y[m][n]: m = warp_row0 + 8h + 2*t4 + (i & 1),
    // n = 16 * (n-tile) + gid + 8 * (i >> 1).
    if constexpr (Shape::kWgmma) {
      if (y_by_16_bytes) {
        store_tile_staged();
        return;
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int n_lo = 16 * (tile0 + Shape::n_tile(warp, nt)) + gid;
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
  };

  // Pipeline over this block's units: `ahead` in flight ahead of the one computed. The
  // prologue fetches their weights before waiting for the previous kernel (a programmatic
  // launch, launch.cuh), x after. mma: p.stages - 1 ahead, one commit group per stage (the
  // first also holds the other stages' weights), and the slot refilled is the one just
  // computed. wgmma: one less ahead, so that the slot refilled is the one computed two
  // units back, whose wgmma groups are complete (compute_wgmma leaves at most
  // kWgmmaInFlight - 1 in flight, all its own): the tensor cores keep working through the
  // stage change instead of draining.
  //
  // Ring barriers (wgmma): no block barrier per stage. Each slot has a "full" barrier, on
  // which every thread's copies of a unit arrive as they land (cp.async.mbarrier.arrive: no
  // thread waits for its own copies), and an "empty" one, on which every thread arrives once
  // the slot's previous unit is read for the last time (its wgmma groups complete:
  // kWgmmaInFlight - 1 k16 steps into the next unit). A warp waits only for the data it is
  // about to read and, before refilling a slot, for the unit that slot held -- so warps
  // drift by up to a unit instead of meeting at every stage. Unit q (counted from the run's
  // start) lives in slot q % stages; its barriers' phase parity is (q / stages) % 2.
  // With tensor copies (p.tma) only thread 0 waits for a slot to empty, and refills it: its
  // arrival, expecting the unit's bytes, and the copies' bytes complete the full barrier
  // (the weights' bytes are expected before the wait for the previous kernel, x's with
  // the arrival after it). The other threads issue no copies at all, so a warpgroup
  // spends its time converting and issuing wgmma rather than on copies and their address
  // arithmetic (mixed_gemm.md).
  const bool tma = Shape::kTensorCopies && p.tma;  // (block-uniform)
  if constexpr (kRing) {
    if (tid < p.stages) {
      mbarrier_init(full_bar(tid), tma ? 1 : kThreads);  // tensor copies: thread 0's arrival and the bytes
      mbarrier_init(empty_bar(tid), kThreads);
    }
    fence_mbarrier_init();
    __syncthreads();
  }
  const int ahead = p.stages - 1 - (Shape::kWgmma ? 1 : 0);
  const int tile_begin = L_begin / p.nstages;
  UnitPos fetch_pos{tile_begin / columns, tile_begin % columns, L_begin % p.nstages};  // the next unit to fetch
  allow_dependent_launch();
  {
    UnitPos u = fetch_pos;
#pragma unroll
    for (int q = 0; q < kGemmMaxStages - 1; ++q) {
      if (q < ahead && L_begin + q < L_end) {
        if (!tma) {
          fetch_weights(u, q);
        } else if (tid == 0) {  // (the phase's arrival comes with x, after the wait)
          mbarrier_expect_tx(full_bar(q), kTmaWeightBytes);
          tma_weights(u, q);
        }
      }
      advance(u);
    }
  }
  wait_for_prior_grid();
  stamps.start();
#pragma unroll
  for (int q = 0; q < kGemmMaxStages - 1; ++q) {
    if (q < ahead) {
      if (L_begin + q < L_end) {
        if (!tma) {
          fetch_x(fetch_pos, q);
          if constexpr (kRing) mbarrier_arrive_on_copies(full_bar(q));
        } else if (tid == 0) {
          mbarrier_arrive_expect_tx(full_bar(q), kTmaXBytes);
          tma_x(fetch_pos, q);
        }
      }
      advance(fetch_pos);
      if constexpr (!kRing) cp_async_commit();
    }
  }
  // Two loops: over the tiles of this block's run, and over the units (stages) of one
  // tile. The inner loop touches the accumulators only through the MMAs, so with wgmma its
  // back edge carries them in flight. (With one loop, the tile's end -- finish_tile reads
  // the accumulators, enter_tile zeroes them -- sat under a branch inside it, and ptxas
  // waited for every wgmma group at the back edge, C7517: `make compile-cuda` rejects that.)
  int slot = 0;
  uint32_t round = 0;  // (ring barriers) parity of unit L's use of its slot
  for (int L = L_begin; L < L_end;) {
    const int tile = L / p.nstages;
    const int segment_end = min(L_end, (tile + 1) * p.nstages);  // this block's units of the tile
    const bool whole = L == tile * p.nstages && segment_end == (tile + 1) * p.nstages;
    const bool first_of_run = L == L_begin;
    enter_tile(tile);
    for (; L < segment_end; ++L) {
      if constexpr (kRing) {
        mbarrier_wait(full_bar(slot), round);  // unit L's copies, every thread's (or its tensor copies)
        if (!tma) fence_proxy_async_shared();  // ... read next by wgmma (tensor copies are its proxy's own)
        if (L + ahead < L_end) {
          const bool wraps = slot + ahead >= p.stages;
          const int refill = wraps ? slot + ahead - p.stages : slot + ahead;
          // the unit that slot held before (L + ahead - stages), released by every thread
          const bool reused = L - L_begin + ahead >= p.stages;
          if (!tma) {
            if (reused) mbarrier_wait(empty_bar(refill), round ^ wraps ^ 1u);
            fetch_weights(fetch_pos, refill);
            fetch_x(fetch_pos, refill);
            mbarrier_arrive_on_copies(full_bar(refill));
          } else if (tid == 0) {
            if (reused) mbarrier_wait(empty_bar(refill), round ^ wraps ^ 1u);
            mbarrier_arrive_expect_tx(full_bar(refill), kTmaWeightBytes + kTmaXBytes);
            tma_weights(fetch_pos, refill);
            tma_x(fetch_pos, refill);
          }
          advance(fetch_pos);
        }
        // (0: no unit before this one; an empty barrier's address never is 0, the full
        // barriers precede them)
        compute_wgmma(slot, L > L_begin ? empty_bar(slot == 0 ? p.stages - 1 : slot - 1) : 0u);
      } else {
        cp_async_wait_dynamic<kGemmMaxStages - 2>(ahead - 1);
        __syncthreads();  // unit L visible to all; the slot to refill free (see above)
        if (L + ahead < L_end) {
          const int ahead_slot = slot + ahead < p.stages ? slot + ahead : slot + ahead - p.stages;
          fetch_weights(fetch_pos, ahead_slot);
          fetch_x(fetch_pos, ahead_slot);
          advance(fetch_pos);
        }
        cp_async_commit();
        if (warp_live) compute(slot);
      }
      if (++slot == p.stages) {
        slot = 0;
        round ^= 1u;
      }
    }
    finish_tile(tile, whole, first_of_run);
  }
  cp_async_wait<0>();
}

template <typename T, int BITS, int CFG, int GROUP, bool ZEROS>
__global__ void __launch_bounds__(kGemmWarps * 32, GemmTile<CFG>::kMinBlocks) gemm_kernel(const __grid_constant__ GemmParams p) {
#if WOQ_SM80  // sm_80+ only: a T4's 64 KB hold 2 stages of few tiles; it runs dequant + cuBLAS
  // wgmma configurations: sm_90a code only (the host launches them nowhere else)
  if constexpr (!GemmTile<CFG>::kWgmma || WOQ_SM90A) gemm_units<T, BITS, CFG, GROUP, ZEROS>(p);
#endif
}

}  // namespace woq
