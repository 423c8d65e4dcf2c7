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
// Every warp keeps MBW * NTW * 4 fp32 accumulators (64 for configs 1 and 2). The tuner's
// picks on the H100 (kernels/tuned/) before the wgmma configurations: 0 or 4 at M <= 32 (0
// on the large shapes, which its 256-channel tiles fill; 4 on the small), 1 or 4 at
// M <= 64, 2 beyond (3 on some). With them: wgmma 5 / 6 / 7-8 at M <= 32 / 64 / beyond on
// about half the shape-format entries (all the large ones), mma 4 (M <= 64) or 3 (M = 128)
// on the rest. A 128 x 64 tile with two blocks per SM never won by more
// than 4 % and was dropped (build time).
//
// Where the time goes (ncu, 28672 x 8192, M = 128, config 2): the tensor pipe is active
// 43 % of the cycles, ~240 TFLOP/s; the top stall is "wait" (fixed-latency dependencies
// between the converts and the mma), with 2 warps per scheduler. mma.sync on an H100
// reaches about half of its wgmma peak at best, so this kernel wins against dequantize +
// cuBLAS, and against fp16 cuBLAS only while the weight bytes dominate (M <= ~64-128).
//
// wgmma configurations (5..9; sm_90a builds on an H100/H200, wgmma.cuh). Each warpgroup
// (warps 0-3, 4-7) owns NTW 64-channel slices of the block's channels and all BM rows:
// per k16 step its warps convert their A fragments exactly as above (the weight layout
// already matches wgmma's register fragments: the A fragment of warp w is rows 16w..16w+15)
// and it issues one wgmma.m64nBMk16 per slice, B = the stage's x tile, which the tensor
// cores read from shared memory in the 128-byte swizzle layout (fetch_x writes it so).
//
//   config   warpgroup tile (channels x rows)   block tile BM x BN   accumulators/thread
//     5      128 x 32   (NTW 2, m64n32k16)         32 x 256           32 (int4: 256 k a stage)
//     6      128 x 64   (NTW 2, m64n64k16)         64 x 256           64
//     7       64 x 128  (NTW 1, m64n128k16)       128 x 128           64
//     8      128 x 128  (NTW 2, m64n128k16)       128 x 256          128
//     9      128 x 16   (NTW 2, m64n16k16)         16 x 256            8 (int4: 256 k a stage)
//
// Config 9 is config 5 at half the rows, for decode batches of 9..16 rows (M <= 16 is the
// GEMV's by default; the tuner gives those rows to this tile where it measures faster,
// kernels/tuning.py): the per-weight-byte work -- copies, conversions, scales -- is the
// GEMV's, but the tensor cores read the 16 rows of x from shared memory, where each GEMV
// warp loads them into registers (see above). Measured on the H100 (gemm_configs.py,
// stream-K, M = 16, us, config 5 -> 9): int4 g128 28672 x 8192 58.6 -> 53.3, 21504 x 14336
// 72.1 -> 66.2; int8 85.0 -> 83.8 (split 1), 114.5 -> 109.8; the GEMV at 16 rows: int4 59.6
// and 72.5, int8 94.1 and 123.8 (docs/bench/kernels.md).
//
// Measured on the H100 (benchmarks/gemm_configs.py, int4 g128, 28672 x 8192, stream-K, us,
// best mma config -> best wgmma config): M = 32 82.6 -> 68.0; M = 64 126.9 -> 90.9; M = 128
// 231.6 -> 164.4; M = 256 457.2 -> 310.8; M = 512 961.6 -> 593.3. Those wgmma times had the
// tensor cores drain at every stage: ptxas waited for all wgmma groups at the back edge of
// the main loop (see the main loop). With that gone, 28672 x 8192 int4 g128, dispatched
// (docs/bench/kernels_msweep.md, previous build -> this one, us): M = 32 68.0 -> 65.9, M =
// 64 88.7 -> 82.3, M = 128 154.4 -> 130.0, M = 256 284.6 -> 256.6; int8 M = 256 362.2 ->
// 291.7; 21504 x 14336 int4 M = 128 200.8 -> 173.9. Then config 5's 256-k int4 stages and
// the weight prefetch (GemmTile, compute_wgmma), dispatched int4 g128 M = 32: 28672 x 8192
// 65.9 -> 58.2 (2.82x cuBLAS fp16), 21504 x 14336 85.1 -> 73.0 (3.15x); M = 17 60.9 -> 57.0
// and 75.3 -> 71.7. Still far from the tensor peak (M = 128: ~460 TFLOP/s of ~990): one
// block of 8 warps per SM issues the copies, the conversions and the wgmma in one
// instruction stream each, with 2 warps per scheduler to hide their latencies. Measured
// with the drain still there: 1, 2 and 4 wgmma groups in flight ran alike, and so did
// keeping the tensor cores busy through the stage barrier (both kept: they cost nothing);
// config 5 built for two blocks per SM (128 registers instead of 241: ~100 bytes of spills)
// was slower, M = 32, gemm_configs.py, us: 28672 x 8192 int4 69.2 -> 93.2, 21504 x 14336
// 85.0 -> 116.6, and with 2 groups in flight (<= 48 bytes of spills) 72.9 and 88.2.
// Re-measured with the drain gone: two blocks with 1 group in flight (4-8 bytes of spills)
// 67.1 -> 64.4 at M = 32 and 128.5 -> 115.0 at M = 48 on 28672 x 8192, but its int8 tile no
// longer fits wgmma's three stages per block, and config 5's 256-k stages (GemmTile) won
// more. Bulk copies (cp.async.bulk, one per n-tile, 1 KB for int4 at 128 k a stage,
// completing on an mbarrier) instead of every thread's cp.async for the weights: int4 g128
// M = 32 68.0 -> 81.7 us (and 134.1 with the scales' 32-byte runs bulk-copied too), int8
// alike (86.4 -> 82.4 at M = 32, 152.4 -> 156.1 at M = 128): the copies' instructions were
// not what bounds the kernel. ncu at M = 32 (config 5): ~520 instructions per warp per
// stage, issue slots half busy, 2 warps per scheduler; the top stall was the wait at each
// stage's barrier and the first shared-memory loads after it. Then two changes, each timed
// against the block barrier in one device call (gemm_configs.py, stream-K, fp16, int4 g128,
// us, best tile; docs/bench/gemm_ring.md):
//  - ring barriers (an mbarrier pair per ring slot instead of a block barrier per stage,
//    see the main loop), with the copies as they were: M = 32 (config 5) 28672 x 8192
//    60.1 -> 58.0, 21504 x 14336 73.1 -> 71.5; M = 128 (config 8) 150.4 -> 133.4 and
//    181.0 -> 175.1; M = 16 (config 9) 53.7 -> 52.2 and 67.1 -> 65.9.
//  - copies indexed per thread (fetch_weights, fetch_x): config 5's copy code had been ~15
//    instructions per 16-byte copy, a quarter of its instructions per unit (SASS), and
//    its registers went from 253 to 211. With them, block barrier -> ring barriers: M = 32
//    55.6 -> 54.7 and 67.4 -> 68.1, M = 128 141.3 -> 140.9 and 180.0 -> 177.8, M = 16
//    50.5 -> 51.0 and 63.2 -> 63.2: the copies were most of what the ring had saved, and
//    the two synchronizations now run alike within the noise between runs (config 8 at M
//    = 128 took 133.4 in the first call). The ring stays: the shipped measurements
//    (kernels_msweep.md) are with it, and the producer warpgroup below was built on it.
// ncu with the ring barriers and the old copies, M = 32, config 5 (stalls per issued
// instruction): "wait" (fixed-latency dependencies) 0.84, long scoreboard 0.40, dispatch
// 0.33, math-pipe throttle 0.26, barrier 0.12; the tensor pipe active 26 % of the cycles
// (50 % at M = 128, config 8). Warp specialization -- a producer warpgroup issuing every
// copy, the two computing warpgroups only converting and multiplying, registers moved to
// them with setmaxnreg (232 / 40) -- was built and measured: int8 per-channel alike, int4
// g128 3-9 % slower (M = 128: 133.0 -> 136.6 and 165.1 -> 170.8 us; it spilled under the
// cap), so not kept (docs/bench/gemm_producer_tried.md). Not tried: bigger tiles per SM,
// x shared between SMs (clusters).
//
// Group scales are applied to the converted weights, not to the accumulators:
// (code - z) is an exact small integer and the scale a T, so their product is exact in
// fp32 and one rounding to T gives exactly the weight dequant + cuBLAS would use
// (dequant.cuh rounds the fp32 product once too). One packed multiply per fragment
// register costs less than the GEMV's per-group fp32 rescaling of NTW * MBW * 4
// accumulators, and needs no second set of them. Per-channel scales stay on the fp32
// accumulators (applied once, at the end).
//
// Work decomposition, "stream-K" as in the GEMV: the (output tile, stage) units of the
// whole product -- tile after tile, each tile's stages of 128 k in order -- are cut into
// gridDim.x balanced contiguous runs, one per block. Tiles are numbered column-major with
// the M tiles of one column adjacent, so the blocks that read the same weights run
// together and all but the first find them in L2. The grid is either one resident wave
// (`splits` 0: every SM gets the same number of stages, whatever the tile count -- at 21504
// x 14336, M = 128, the 64 x 128 tile's 336 tiles made 1.27 waves of 264 resident
// blocks, i.e. two with the second three-quarters idle) or `splits` blocks per tile (the
// classic split-K, kept for the shapes where the tuner measures it faster). Measured on
// the H100 (docs/bench/kernels_msweep.md, dispatched int4 g128, before -> after): 21504 x
// 14336 M = 64 205.9 -> 164.2 us, M = 128 359.4 -> 300.4; 28672 x 8192 M = 128 239.3 ->
// 235.0 (its 224 tiles of 128 x 128 already made 1.7 waves of 132). A tile cut
// between blocks leaves fp32 partial sums in a workspace (two slots per block: its first
// and its last tile can be partial, the ones between are whole); the tile's last finishing
// contributor adds them in block order (deterministic) and re-arms the tile's counter
// (CUDA-graph safe). Partials are in fragment order (thread-contiguous: coalesced).
#pragma once

#include <cstdint>

#include "gemv.cuh"  // converters, fragment helpers, the acq_rel counter
#include "wgmma.cuh"

namespace woq {

constexpr int kGemmWarps = 8;
constexpr int kGemmStageK = 128;  // k per pipeline stage (but see GemmTile::kStageK4)
// Shared-memory ring depth, at most (gemm_launch.cuh). A build-time macro only so that
// deeper rings can be timed (WOQ_NVCC_FLAGS="-DWOQ_GEMM_STAGES=8"): more bytes in flight
// did not help, H100, gemm_configs.py, int4 g128 M = 32, config 5 at 128 k a stage, us, 4 /
// 6 / 8 stages: 28672 x 8192 68.0 / 67.0 / 66.5, 21504 x 14336 86.7 / 84.8 / 83.8.
#ifndef WOQ_GEMM_STAGES
#define WOQ_GEMM_STAGES 4
#endif
constexpr int kGemmMaxStages = WOQ_GEMM_STAGES;
// wgmma configurations: the ring's slots handed over through mbarriers (a "full" and an
// "empty" barrier per slot) instead of a block barrier per stage; see the main loop. A
// build-time macro so that the block barrier can still be timed against it
// (WOQ_NVCC_FLAGS="-DWOQ_GEMM_RING_BARRIERS=0").
#ifndef WOQ_GEMM_RING_BARRIERS
#define WOQ_GEMM_RING_BARRIERS 1
#endif
// wgmma groups (one per k16 step) a warpgroup keeps in flight while it converts the next
// step's weights: each holds its A registers until it completes. (Measured on the H100,
// 28672 x 8192 int4: 1 and 4 ran alike, e.g. M = 32 73.7 vs 73.2 us; 4 leaves the
// scheduler the most freedom.)
constexpr int kWgmmaInFlight = 4;
static_assert(kGemmStageK / 16 >= kWgmmaInFlight, "a stage's own groups are the ones left in flight");

// kMinBlocks: resident blocks per SM the configuration is built for (2: registers capped
// at 128 per thread, so 16 warps per SM hide latency; 1: 64 accumulators per thread, 128
// for wgmma config 8).
// kWgmma: Hopper warpgroup MMA (configs 5..9, sm_90a only; see "wgmma configurations").
// kStageK4: k per pipeline stage with int4 weights (int8: kGemmStageK). Configs 5 (M <= 32)
// and 9 (M <= 16) take 256: their blocks do little math per weight byte, so what bounds
// them is the per-stage round trip (the barrier, then the first shared-memory loads and
// conversions before the tensor cores start again); twice the k per stage halves those
// per byte.
// Measured on the H100 (benchmarks/gemm_configs.py, int4 g128, M = 32, stream-K, us, 128 ->
// 256, both with the weight prefetch in compute_wgmma): 28672 x 8192 64.5 -> 57.8, 21504 x
// 14336 80.6 -> 74.5. Config 5's int8 stage at 256 would be 80 KB (2 stages: too few for
// wgmma's ring; config 9's 72 KB, 3 stages, one in flight), and config 6 (M <= 64) at 256
// fits 3 stages, one in flight: 78.5 -> 118.7 us.
template <int CFG>
struct GemmTile;
template <>
struct GemmTile<0> { static constexpr int kWM = 1, kMBW = 4, kNTW = 2, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = false; };
template <>
struct GemmTile<1> { static constexpr int kWM = 2, kMBW = 4, kNTW = 4, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = false; };
template <>
struct GemmTile<2> { static constexpr int kWM = 2, kMBW = 8, kNTW = 2, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = false; };
template <>
struct GemmTile<3> { static constexpr int kWM = 2, kMBW = 4, kNTW = 2, kMinBlocks = 2, kStageK4 = kGemmStageK; static constexpr bool kWgmma = false; };
template <>
struct GemmTile<4> { static constexpr int kWM = 1, kMBW = 4, kNTW = 1, kMinBlocks = 2, kStageK4 = kGemmStageK; static constexpr bool kWgmma = false; };
template <>
struct GemmTile<5> { static constexpr int kWM = 1, kMBW = 4, kNTW = 2, kMinBlocks = 1, kStageK4 = 256; static constexpr bool kWgmma = true; };
template <>
struct GemmTile<6> { static constexpr int kWM = 1, kMBW = 8, kNTW = 2, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = true; };
template <>
struct GemmTile<7> { static constexpr int kWM = 1, kMBW = 16, kNTW = 1, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = true; };
template <>
struct GemmTile<8> { static constexpr int kWM = 1, kMBW = 16, kNTW = 2, kMinBlocks = 1, kStageK4 = kGemmStageK; static constexpr bool kWgmma = true; };
template <>
struct GemmTile<9> { static constexpr int kWM = 1, kMBW = 2, kNTW = 2, kMinBlocks = 1, kStageK4 = 256; static constexpr bool kWgmma = true; };

template <int CFG>
struct GemmShape {
  static constexpr int kWM = GemmTile<CFG>::kWM, kWN = kGemmWarps / kWM;
  static constexpr int kMBW = GemmTile<CFG>::kMBW, kNTW = GemmTile<CFG>::kNTW;
  static constexpr int kBM = kWM * kMBW * 8;
  static constexpr int kBN = kWN * kNTW * 16;
  static constexpr int kTiles = kBN / 16;  // n-tiles per block
  static constexpr int kMinBlocks = GemmTile<CFG>::kMinBlocks;
  static constexpr bool kWgmma = GemmTile<CFG>::kWgmma;
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
  if (L_begin >= L_end) {  // (the launcher sizes the grid so that this never happens)
    wait_for_prior_grid();
    return;
  }
  // The output tile of unit L: its first row and its first n-tile.
  auto tile_m0 = [&](int tile) { return tile % p.m_tiles * BM; };
  auto tile_n0 = [&](int tile) { return tile / p.m_tiles * kTiles; };

  extern __shared__ uint4 smem_raw[];
  __shared__ int is_last_contributor;
  const T* x = static_cast<const T*>(p.x);
  const T* scales = static_cast<const T*>(p.scales);
  const T* zeros = static_cast<const T*>(p.zeros);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  // The ring's base: 1024-byte aligned for wgmma's swizzled tiles (the launcher adds the
  // slack), as given otherwise.
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_addr = (raw_addr + Stage::kAlign - 1) & ~static_cast<uint32_t>(Stage::kAlign - 1);
  const char* smem = reinterpret_cast<const char*>(smem_raw) + (smem_addr - raw_addr);

  // Where a unit lies: its output tile's m-tile and column (of kTiles n-tiles) and its
  // stage. The fetches walk units one at a time, so these advance without the divisions
  // by m_tiles and nstages (run-time values) that indexing by unit number costs: with them
  // the copy code was ~30 instructions per 16-byte cp.async, as many per stage as the
  // conversions and wgmma of a 128 x 256 tile (SASS of config 8).
  struct UnitPos {
    int mt, col, st;
  };
  auto advance = [&](UnitPos& u) {
    if (++u.st == p.nstages) {
      u.st = 0;
      if (++u.mt == p.m_tiles) {
        u.mt = 0;
        ++u.col;
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
  // (x): c = tid + j * kThreads splits into a per-thread part (tid's n-tile or row, its
  // 16 bytes in it) and j times a whole number of n-tiles or rows. Written that way, each
  // copy costs a pointer step and a compare; indexing by c (divisions, 64-bit products per
  // chunk) cost ~15 instructions per copy, a quarter of config 5's instructions per unit
  // (SASS, int4 g128). Two more places where the instructions went (SASS of the main
  // loop, int4 g128 with zero points): x's rows addressed as (m0 + row + j * 16) * K,
  // which the compiler multiplied out per copy (~20 instructions each, 8 copies a unit
  // in config 8), and the scales' loop over chunks (divisions, ~200 instructions of
  // loop for warps 0-1). Now x steps a pointer by 16 rows, and each thread's one scale
  // chunk is fixed relative to the unit. Main loop, config 8: 819 -> 519 instructions
  // (the copies 509 -> 211, the math 310); config 5 1061 -> 785, 6 717 -> 476, 9 1050
  // -> 780. Measured on the H100 (gemm_configs.py, int4 g128, best tile, us): M = 128
  // 28672 x 8192 129.0 -> 118.8, 21504 x 14336 164.9 -> 154.0; M = 256 259.5 -> 240.2 and
  // 330.5 -> 310.9; M = 16 50.5 -> 47.1; M = 32 alike (docs/bench/gemm_fetch.md).
  // A zero-filled copy reads nothing (src-size 0), so its source is passed as computed,
  // past the end of x or the weights, instead of selected to a valid address: the select
  // was 2 instructions a copy (config 8's main loop: 519 -> 489; memcheck clean).
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
  const T* s_src = (ZEROS && s_is_zero ? zeros : scales) + (static_cast<size_t>(s_tile) * p.groups_pad + s_group) * 16 + s_chunk % 2 * 8;
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
        const T* src = s_src + (static_cast<size_t>(tile0) * p.groups_pad + st * kGroups) * 16;
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
          convert_segment_k16<T, BITS, ZEROS>(wv[nt], j, zc[nt], a);
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
      [[maybe_unused]] uint32_t s_lo[NTW], s_hi[NTW];
      // A segment's weights are loaded from shared memory while the segment before it is
      // converted (one segment ahead) where the wgmma are short (BM <= 64 rows): the
      // wgmma_* asm (memory clobbers) keeps the compiler from hoisting the loads itself,
      // and each load's latency otherwise sat between two segments' MMAs. Measured on the
      // H100 (gemm_configs.py, int4 g128, stream-K, us, without -> with): config 5 M = 32
      // 28672 x 8192 67.0 -> 64.5, 21504 x 14336 87.1 -> 80.6; config 6 M = 64 79.5 -> 78.5,
      // 102.1 -> 98.8; config 8 M = 128 (128 rows) 138.6 -> 142.4, 181.3 -> 182.7: not there.
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
                const uint32_t sc = ssm[(nt * 4 * kGroups + g) * 8];
                s_lo[nt] = dup_lo(sc);
                s_hi[nt] = dup_hi(sc);
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
              a[nt][0] = mul_pair<T>(a[nt][0], s_lo[nt]);
              a[nt][1] = mul_pair<T>(a[nt][1], s_hi[nt]);
              a[nt][2] = mul_pair<T>(a[nt][2], s_lo[nt]);
              a[nt][3] = mul_pair<T>(a[nt][3], s_hi[nt]);
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
  // consecutive *rows* of one channel (the fragment layout above), so storing them one
  // value at a time took ~18 instructions per value -- 2,300 per warp for config 8's 128,
  // in straight-line code too long for the instruction cache: ncu (28672 x 8192, M = 128,
  // config 8, one tile per block) put 14 % of the kernel's warp samples in that epilogue,
  // two thirds of them waiting for instructions. Instead each warp transposes two n8
  // blocks (16 rows x 16 channels) at a time through 512 bytes of shared memory of its
  // own with stmatrix.trans, then each lane stores 8 channels of one row: 16 bytes. Needs
  // rows of y 16-byte aligned (N % 8 == 0, y 16-byte aligned: checked below), else the
  // value-at-a-time loop. With it (and the split-K partials as float4, below) that
  // profile's epilogue fell to 3 % of the samples and the kernel from 120.8 to 112.3 us
  // under ncu. Timed (gemm_configs.py, int4 g128, best tile and split, us, before -> after
  // -> before again, one device call; docs/bench/gemm_epilogue.md): M = 64 28672 x 8192
  // 74.4 -> 68.0 -> 75.1, 21504 x 14336 94.7 -> 86.8 -> 94.4; M = 128 117.6 -> 122.1 ->
  // 119.0 (one tile per block, split 1: no gain in back-to-back launches; 116.6 -> 116.6
  // in another call) and 157.1 -> 151.5 -> 157.2; M = 256 240.6 -> 223.9 -> 244.1 and
  // 321.8 -> 296.9 -> 315.1.
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
  // prologue fetches their weights before waiting for the previous kernel (a
  // programmatic launch, launch.cuh), x after; one commit group per stage (the first also
  // holds the other stages' weights), so the main loop's wait counts are unchanged.
  // mma: p.stages - 1 ahead; the slot refilled is the one just computed. wgmma: one less,
  // so that the slot refilled is the one computed two units back, whose wgmma groups are
  // complete (compute_wgmma leaves at most kWgmmaInFlight - 1 in flight, all its own):
  // the tensor cores keep working through the barrier instead of draining at every stage.
  //
  // Ring barriers (wgmma, WOQ_GEMM_RING_BARRIERS): no block barrier per stage. Each slot
  // has a "full" barrier, on which every thread's copies of a unit arrive as they land
  // (cp.async.mbarrier.arrive: no thread waits for its own copies), and an "empty" one, on
  // which every thread arrives once the slot's previous unit is read for the last time
  // (its wgmma groups complete: kWgmmaInFlight - 1 k16 steps into the next unit). A warp
  // waits only for the data it is about to read and, before refilling a slot, for the
  // unit that slot held two units back -- so warps drift by up to a unit against each
  // other instead of meeting at every stage, where ncu placed this kernel's top stall
  // (the barrier, then the first shared-memory loads after it). Unit q (counted from the
  // run's start) lives in slot q % stages; its barriers' phase parity is (q / stages) % 2.
  constexpr bool kRing = Shape::kWgmma && WOQ_GEMM_RING_BARRIERS;
  __shared__ alignas(8) uint64_t ring_barriers[2 * kGemmMaxStages];  // full[slot], then empty[slot]
  const uint32_t full_bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring_barriers));
  auto full_bar = [&](int s) { return full_bar0 + 8u * s; };
  auto empty_bar = [&](int s) { return full_bar0 + 8u * (kGemmMaxStages + s); };
  if constexpr (kRing) {
    if (tid < p.stages) {
      mbarrier_init(full_bar(tid), kThreads);
      mbarrier_init(empty_bar(tid), kThreads);
    }
    fence_mbarrier_init();
    __syncthreads();
  }
  const int ahead = p.stages - 1 - (Shape::kWgmma ? 1 : 0);
  const int tile_begin = L_begin / p.nstages;
  UnitPos fetch_pos{tile_begin % p.m_tiles, tile_begin / p.m_tiles, L_begin % p.nstages};  // the next unit to fetch
  allow_dependent_launch();
  {
    UnitPos u = fetch_pos;
#pragma unroll
    for (int q = 0; q < kGemmMaxStages - 1; ++q) {
      if (q < ahead && L_begin + q < L_end) fetch_weights(u, q);
      advance(u);
    }
  }
  wait_for_prior_grid();
#pragma unroll
  for (int q = 0; q < kGemmMaxStages - 1; ++q) {
    if (q < ahead) {
      if (L_begin + q < L_end) {
        fetch_x(fetch_pos, q);
        if constexpr (kRing) mbarrier_arrive_on_copies(full_bar(q));
      }
      advance(fetch_pos);
      if constexpr (!kRing) cp_async_commit();
    }
  }
  // Two loops: over the tiles of this block's run, and over the units (stages) of one
  // tile. The inner loop touches the accumulators only through the MMAs, so with wgmma
  // its back edge carries them in flight: when one loop held both, the tile's end
  // (finish_tile reads the accumulators, enter_tile zeroes them) sat under a branch inside
  // it, and ptxas made every iteration wait for all wgmma groups at the back edge
  // ("warpgroup.wait is injected ... to allow use of registers defined by GMMA", C7517):
  // the tensor cores drained at every stage.
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
        mbarrier_wait(full_bar(slot), round);  // unit L's copies, every thread's
        fence_proxy_async_shared();            // ... read next by wgmma
        if (L + ahead < L_end) {
          const bool wraps = slot + ahead >= p.stages;
          const int refill = wraps ? slot + ahead - p.stages : slot + ahead;
          // the unit that slot held before (L + ahead - stages), released by every thread
          if (L - L_begin + ahead >= p.stages) mbarrier_wait(empty_bar(refill), round ^ wraps ^ 1u);
          fetch_weights(fetch_pos, refill);
          fetch_x(fetch_pos, refill);
          advance(fetch_pos);
          mbarrier_arrive_on_copies(full_bar(refill));
        }
        // (0: no unit before this one; an empty barrier's address never is 0, the full
        // barriers precede them)
        compute_wgmma(slot, L > L_begin ? empty_bar(slot == 0 ? p.stages - 1 : slot - 1) : 0u);
      } else {
        cp_async_wait_dynamic<kGemmMaxStages - 2>(ahead - 1);
        if constexpr (Shape::kWgmma) fence_proxy_async_shared();  // this stage's cp.async data, read by wgmma
        __syncthreads();  // unit L visible to all; the slot to refill free (see above)
        if (L + ahead < L_end) {
          const int ahead_slot = slot + ahead < p.stages ? slot + ahead : slot + ahead - p.stages;
          fetch_weights(fetch_pos, ahead_slot);
          fetch_x(fetch_pos, ahead_slot);
          advance(fetch_pos);
        }
        cp_async_commit();
        if constexpr (Shape::kWgmma) {
          compute_wgmma(slot, 0u);  // (every warp: a warpgroup's rows are the block's, never all past M)
        } else if (warp_live) {
          compute(slot);
        }
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
__global__ void __launch_bounds__(kGemmWarps * 32, GemmTile<CFG>::kMinBlocks) gemm_kernel(const GemmParams p) {
#if WOQ_SM80  // sm_80+ only: a T4's 64 KB hold 2 stages of few tiles; it runs dequant + cuBLAS
  // wgmma configurations: sm_90a code only (the host launches them nowhere else)
  if constexpr (!GemmTile<CFG>::kWgmma || WOQ_SM90A) gemm_units<T, BITS, CFG, GROUP, ZEROS>(p);
#endif
}

}  // namespace woq
